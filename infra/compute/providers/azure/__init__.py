"""Microsoft Azure: provider (launch, replace, find again by tags, terminate, preemption notices), arm (the Resource
Manager clients, credentials, and waiting on long-running operations), names (resource group, resource names and
tags), boot (image, the custom-data boot script), config (cluster.azure) and errors (ARM's error codes as the launch
errors failover acts on). Imported only when a job names azure: it pulls in the azure-mgmt SDKs. May import what every
provider may (see infra.compute.providers)."""
