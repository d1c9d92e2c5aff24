"""Machines the user already has, reached over SSH: config (the job's `cluster.ssh:` section, validated before
anything runs) and provider (reserve, bootstrap, run, terminate over SSH). The job spec imports config alone, which
needs only pydantic (paramiko on first use). May import what every provider may (see infra.compute.providers)."""
