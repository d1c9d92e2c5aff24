"""Compute: where nodes come from and how they are reached.

providers (one per kind of node: local, netns, ssh, aws, gcp; launcher records who launched a cluster), catalog (the
instance types and their figures), optimizer (which offers meet the job's floors), failover (try candidates until
one launches) and access (runners, SSH, host keys, bootstrap: node access underneath every provider).

May import: job (the spec), lifecycle (lease renewal while launching), the node agent's shared pieces (process
tags, preemption notices), storage and the shared infra modules. Never imported by the node agent or by storage.
"""
