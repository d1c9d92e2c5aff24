"""The job and its plan: the job spec users write (spec, recovery_spec), the checks made before a cluster is paid
for (plan) and the record of a run (summary).

A provider's own config section (cluster.ssh, cluster.netns) lives in that provider's package and the spec composes
it, so the spec imports only those config modules and the provider registry from compute at load time.
May import: compute (placement candidates, provider config sections), checkpoints, dataset, workload, storage and
the shared infra modules.
The node agent never imports this package.
"""
