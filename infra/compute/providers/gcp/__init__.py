"""Google Compute Engine: provider (launch, replace, find again by labels, terminate, preemption notices), api (the
Compute API calls, retried and polled), labels (how a cluster is labelled and named), boot (image, disks, the
startup-script), config (cluster.gcp) and errors (both shapes of Compute Engine errors as the launch errors failover
acts on). Imported only when a job names gcp: it pulls in google-cloud-compute. May import what every provider may
(see infra.compute.providers)."""
