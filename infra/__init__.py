"""Plain-Python core of trainpipe (no Prefect anywhere under it), one package per box of the architecture.

Orchestration, run on the machine that drives a job: job (the spec and the plan), compute (providers, node access),
lifecycle (lease, sweeper, recoveries) and analysis (step breakdown, predictor, cluster bench); they may import each
other and everything below. Below them, also shipped to and run on every node: node (the node agent), checkpoints,
dataset, workload and storage. The modules here (errors, models, workspace, cancel) are shared by all and import
nothing of trainpipe. Directions are checked by tests/test_layering.py.
"""
