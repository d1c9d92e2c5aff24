"""The run's lifecycle: the orchestrator's lease on its nodes (lease), the orphan sweeper (sweep) and the
bookkeeping of recoveries from preemption (recovery) and the watch during training that tells a preemption
from a failure (preemption_watch).

May import: job, compute and everything below them (tests/test_layering.py). The node agent's side of the lease
(its watchdog) lives in infra.node, which never imports this package.
"""
