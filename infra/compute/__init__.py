"""Compute: where nodes come from and how they are reached.

spec (the job's `cluster:` section, what every provider's launch() reads), providers (one per kind of node: local,
netns, ssh, aws, gcp; owner records who launched a cluster), catalog (the instance types and their figures),
optimizer (which offers meet the job's floors), failover (try candidates until one launches), renewal (a heartbeat
renewed on a daemon thread) and access (runners, SSH, host keys, bootstrap: node access underneath every provider).

May import: the node agent's shared pieces (process tags, preemption notices, the node protocol), the dataset's
staging cache, storage and the shared infra modules: every room below it (tests/test_layering.py), never the job or
the lifecycle above it. Never imported by the node agent or by storage.
"""
