"""Prefect flows: order the tasks and own teardown (retrain, sweep, cluster_bench), plus their deployments and
automations. The top of the tree: may import tasks, infra and Prefect; nothing imports flows."""
