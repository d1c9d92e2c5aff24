"""Checkpoints: their naming (steps), the commit protocol and layout in the store (commit) and which checkpoints a
framework has completed on a node's disk (formats).

May import: storage and the shared infra modules only; the node agent and the trainer build on it.
"""
