"""The node agent: `python -m infra.node COMMAND` on every node (probe, stage, sync, restore, verify-ckpt, watch,
chaos, code, benches), plus what it shares with the providers that start it: the tags its processes carry and how
to find and end them (processes) and where a node learns it is about to be taken away (preemption_notice); its
watchdog (the `watch` command: lease expiry and preemption notices on its own node) is watchdog.

May import: registry, checkpoints, dataset, workload, storage and the shared infra modules. Never orchestration (job,
compute, lifecycle, analysis, the CLI, flows, tasks), not even through what it imports (tests/test_layering.py).
"""
