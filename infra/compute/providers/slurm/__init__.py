"""A site's Slurm as a provider: config (the job's `cluster.slurm:` section, validated before anything is submitted),
cli (sbatch, squeue, scontrol, scancel on the login node, their failures typed), holder (the batch script that holds
the allocation, raises preemption notices and ends the allocation when the lease lapses), runner (a node's commands
as job steps) and provider (launch, describe, terminate, list). The job spec imports config alone. May import what
every provider may (see infra.compute.providers)."""
