"""Google Compute Engine: provider (launch, find again by labels, terminate, preemption notices from the metadata
server, the startup-script boot) and errors (both shapes of Compute Engine errors as the launch errors failover acts
on). Imported only when a job names gcp: it pulls in google-cloud-compute. May import what every provider may (see
infra.compute.providers)."""
