"""Plain-Python core of trainpipe (no Prefect anywhere under it), one package per box of the architecture.

Orchestration, run on the machine that drives a job: compute (the cluster spec, providers, node access), above it
job (the job spec composing the rooms' sections, the plan) and analysis (step breakdown, predictor, cluster bench),
and above job lifecycle (lease, sweeper, preemption watch, recoveries). Below them, also shipped to and run on every
node: node (the node agent), registry, checkpoints, dataset, workload and storage. The modules here (errors,
strict_model, workspace, cancel) are shared by all and import nothing of trainpipe. Every arrow points down the
order in tests/test_layering.py (LAYERS), which checks it.
"""
