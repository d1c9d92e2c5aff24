"""Checkpoints: their naming (steps), where they live in the store and the records kept there (layout), reading them
(reading: listing, manifests, latest, verify), the commit protocol with set-aside and retention (commit), restoring
onto a node's disk (restore), the one object callers hold over a run's checkpoints (store: CheckpointStore), the
node-local upload lease (upload_lease), lineage records (lineage) and which checkpoints a framework has completed
on a node's disk (formats).

May import: storage and the shared infra modules only; the node agent and the trainer build on it.
"""
