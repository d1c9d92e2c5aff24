"""The job and its plan: the job spec users write (spec, recovery_spec), the checks made before a cluster is paid
for (plan) and the record of a run (summary).

May import: compute (placement candidates), checkpoints, dataset, workload, storage and the shared infra modules.
The node agent never imports this package.
"""
