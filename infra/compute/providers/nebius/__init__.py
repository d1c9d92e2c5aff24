"""Nebius AI Cloud: provider (launch into one GPU cluster, replace, find again by labels, terminate, preemption
notices), api (the SDK's clients, calls retried and operations awaited), labels (how a cluster is labelled and named),
boot (the cloud-init script: login user, host key, local disks, filesystem, the stop notice), config (cluster.nebius)
and errors (the API's status codes and service errors as the launch errors failover acts on). Imported only when a
job names nebius: it pulls in the nebius SDK, and that only on first use. May import what every provider may (see
infra.compute.providers)."""
