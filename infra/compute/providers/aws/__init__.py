"""AWS EC2: provider (launch, find again by tags, terminate, preemption notices from IMDSv2, the user-data boot
script), images (the AMI the nodes boot: cluster.aws.ami, TRAINPIPE_AWS_AMI, else the Deep Learning Base AMI's public
SSM parameter), config (cluster.aws) and errors (EC2 error codes as the launch errors failover acts on). Imported only
when a job names aws: it pulls in boto3. May import what every provider may (see infra.compute.providers)."""
