"""The job and its plan: the job spec users write (spec, recovery_spec), the checks made before a cluster is paid
for (plan) and the record of a run (summary).

The spec composes the sections other rooms define: the cluster (infra.compute.spec, each provider's own section in
that provider's package) and the dataset and inputs (infra.dataset.spec).
May import: compute (the cluster spec, placement candidates), registry, checkpoints, dataset, workload, storage and
the shared infra modules; never lifecycle or analysis, which build on it (tests/test_layering.py).
The node agent never imports this package.
"""
