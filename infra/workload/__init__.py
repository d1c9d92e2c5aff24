"""The workload seam: what trainpipe promises a training script, and what it reads back from one.

A job names its code, an optional setup and a command; trainpipe ships the code to every node, starts the command
under torchrun there and tells it everything through the environment (contract); it follows the script's progress
through its metrics file and its framework's own log lines (progress) and ships the checkpoints it writes
(infra.checkpoints.formats). Nothing here knows any particular model: the bundled GPT in trainer/ is one user.
Plain Python: no Prefect, no torch, except the two scripts the node agent copies into the user's training
environment and never imports itself: launcher.py (stdlib only: torchrun, setup and evaluate under the agent's
lifeline) and allreduce_bench.py (torch, the cluster bench's all-reduce).

May import: storage and the shared infra modules; the node agent and the trainer build on it.
"""
