"""Prefect tasks: one step of a run each (plan, cluster, verify, stage, workload, train, checkpoint, report, sweep,
bench), with retries, logging and artifacts, plus the helpers they share (policy, capacity,
node_output). Thin: the work is in infra. May import Prefect and infra; never flows."""
