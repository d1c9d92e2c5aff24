"""AWS EC2: a cluster is N instances in one placement group and one security group, found again by their tags.

Everything launched carries the cluster's tags, so describe, terminate and the orphan sweeper find it from any
process. Each node is its own RunInstances call with its own ClientToken (derived from the cluster, the candidate
and the rank), so a retried launch adopts the instances it already started instead of starting more.

A lost node is replaced alone (replace_nodes): its new instance copies the shape of the cluster's surviving ones
(AMI, type, market, placement group, zone and subnet, security group, instance profile, key pair), keeps the node's
name and rank and carries the cluster's tags, so describe, teardown and the sweeper see the new membership.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from infra.cancel import CANCEL
from infra.compute.access.agent_env import agent_python
from infra.compute.access.hostkeys import HostKey
from infra.compute.catalog import Catalog
from infra.compute.optimizer import Candidate
from infra.compute.providers.aws.errors import CapacityError, InvalidRequestError, LaunchError, classify, error_code
from infra.compute.providers.aws.images import AMI_ENV, boot_image
from infra.compute.providers.base import Cluster, ClusterRecord, Node, PreemptionNotice, ReplacementUnavailable
from infra.compute.providers.cloud import (
    HOST_KEYS,
    LEASE_TTL,
    MOUNT,
    CloudProvider,
    boot_script,
    lease_alive,
    rolled_back,
)
from infra.compute.providers.nvme_boot import nvme_script
from infra.compute.providers.operations import WATCH_ATTEMPTS, WATCH_TIMEOUT_S
from infra.compute.providers.owner import launcher_stamp
from infra.compute.spec import ClusterSpec

log = logging.getLogger(__name__)

TAG_CLUSTER = "trainpipe:cluster"
TAG_RUN = "trainpipe:run-id"
TAG_OWNER = "trainpipe:owner"
TAG_CREATED = "trainpipe:created-at"
TAG_RANK = "trainpipe:rank"
TAG_TOKEN = "trainpipe:launch-token"
TAG_HOST_KEY = "trainpipe:host-key"  # the SHA256 fingerprint of the host key the instance's user-data installs
TAG_HEARTBEAT = "trainpipe:heartbeat"  # unix time of the orchestrator's latest renewal (cloud.lease_alive)
TAG_LEASE_TTL = "trainpipe:lease-ttl-s"  # how old the heartbeat may get before the run counts as gone
LIVE_STATES = ("pending", "running", "stopping", "stopped")
SPOT_NOTICE_CODES = ("marked-for-termination", "marked-for-stop", "instance-terminated-by-price")
SPOT_NOTICE_S = 120.0  # EC2 gives a spot instance two minutes between the notice and the reclaim
WAIT_S = 600.0  # for instances to reach running / terminated
DELETE_RETRIES = 6  # groups stay "in use" for a short while after their instances end
# Where this process last launched or found each cluster: teardown (a fresh provider, from the teardown task) goes there
# first. Only an order: every region is still asked.
_known_regions: dict[str, str] = {}

# Instance store NVMe, as EC2 names its model; EC2 runs user-data once, at the instance's first boot.
NVME_SCRIPT = nvme_script("mapfile -t devices < <(lsblk -dpno NAME,MODEL | awk '/Instance Storage/ {print $1}')")


def user_data(host_key: HostKey) -> str:
    """The instance's user-data: the cluster's host key installed first, then the NVMe mount. Anyone who may call
    DescribeInstanceAttribute in the account can read it, host private key included: see
    infra.compute.access.hostkeys."""
    return boot_script(host_key, NVME_SCRIPT)


def _tags(instance_or_group: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in instance_or_group.get("Tags", [])}


def _tag_spec(kind: str, tags: dict[str, str]) -> dict[str, Any]:
    return {"ResourceType": kind, "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}


def replacement_token(cluster_name: str, node_name: str, host_key: HostKey) -> str:
    """One token per replacement (its host key is new each time): botocore's retries of one RunInstances reuse it
    and start no second instance, while a later replacement of the same node gets a fresh instance, not the ended
    one EC2 remembers the token by."""
    return hashlib.sha256("|".join([cluster_name, node_name, host_key.fingerprint]).encode()).hexdigest()[:48]


# The tags that say which node an instance is, and when it was last renewed; every other tag is the cluster's.
NODE_TAGS = ("Name", TAG_RANK, TAG_TOKEN, TAG_HOST_KEY, TAG_HEARTBEAT)


def launch_token(cluster_name: str, candidate: Candidate, rank: int, after: tuple[str, ...] = ()) -> str:
    """Same cluster, candidate and rank → same token. `after` lists the ended instances an earlier launch with the
    previous token left, so a relaunch of a torn-down cluster gets fresh instances (EC2 remembers tokens)."""
    text = "|".join([cluster_name, candidate.key, str(rank), *after])
    return hashlib.sha256(text.encode()).hexdigest()[:48]


class AwsProvider(CloudProvider):
    name = "aws"
    key_hint = "the private key of the EC2 key pair TRAINPIPE_AWS_KEY_NAME names"
    boot_log = "/var/log/cloud-init-output.log"

    def __init__(self, catalog: Catalog | None = None, regions: tuple[str, ...] | None = None,
                 endpoint_url: str | None = None, ami: str | None = None, ssh_cidr: str | None = None,
                 key_name: str | None = None, bootstrap: bool = True) -> None:
        super().__init__(catalog, bootstrap=bootstrap)
        env_regions = tuple(r for r in os.environ.get("TRAINPIPE_AWS_REGIONS", "").split(",") if r)
        self._regions = regions or env_regions or None
        self._endpoint_url = endpoint_url
        self._ami = ami or os.environ.get(AMI_ENV)  # cluster.aws.ami wins over it (images.boot_image)
        self._ssh_cidr = ssh_cidr or os.environ.get("TRAINPIPE_SSH_CIDR")
        self._key_name = key_name or os.environ.get("TRAINPIPE_AWS_KEY_NAME")
        self._clients: dict[str, Any] = {}

    # -- plumbing -----------------------------------------------------------------------------------------------

    def regions(self) -> tuple[str, ...]:
        """Where to look for clusters: TRAINPIPE_AWS_REGIONS, else every region the catalog sells AWS types in."""
        return self._regions or self.catalog.regions(self.name)

    def client(self, region: str) -> Any:
        if region not in self._clients:
            # botocore's standard mode retries throttling and 5xx with backoff; launch errors are ours to handle.
            config = Config(retries={"mode": "standard", "max_attempts": 5})
            self._clients[region] = boto3.session.Session().client(
                "ec2", region_name=region, endpoint_url=self._endpoint_url, config=config)
        return self._clients[region]

    def watch_client(self, region: str) -> Any:
        """The client of the preemption watch's reads: asked once (operations.WATCH_ATTEMPTS), not retried by
        botocore (standard mode backs off up to 20 s a retry, and EC2 throttles with 503 RequestLimitExceeded)."""
        key = f"watch:{region}"
        if key not in self._clients:
            config = Config(retries={"mode": "standard", "total_max_attempts": WATCH_ATTEMPTS},
                            connect_timeout=WATCH_TIMEOUT_S, read_timeout=WATCH_TIMEOUT_S)
            self._clients[key] = boto3.session.Session().client(
                "ec2", region_name=region, endpoint_url=self._endpoint_url, config=config)
        return self._clients[key]

    def _has_credentials(self) -> bool:
        return boto3.session.Session().get_credentials() is not None

    def _instances(self, region: str, filters: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        pages = self.client(region).get_paginator("describe_instances").paginate(Filters=filters)
        for page in pages:
            for reservation in page["Reservations"]:
                yield from reservation["Instances"]

    def _cluster_instances(self, region: str, cluster_name: str) -> list[dict[str, Any]]:
        filters = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster_name]},
                   {"Name": "instance-state-name", "Values": list(LIVE_STATES)}]
        found = list(self._instances(region, filters))
        return sorted(found, key=lambda i: int(_tags(i).get(TAG_RANK, "0")))

    # -- launch -------------------------------------------------------------------------------------------------

    def launch_candidate(self, cluster_name: str, spec: ClusterSpec, run_id: str, candidate: Candidate,
                         host_key: HostKey) -> Cluster:
        """Every node on this candidate or none: on any failure what this call started is rolled back."""
        region = candidate.region
        tags = {"Name": cluster_name, TAG_CLUSTER: cluster_name, TAG_RUN: run_id, TAG_OWNER: launcher_stamp(),
                TAG_CREATED: datetime.now(UTC).isoformat(timespec="seconds"), TAG_HEARTBEAT: f"{time.time():.0f}",
                TAG_LEASE_TTL: f"{spec.lease_ttl_s:g}"}
        try:
            ec2 = self.client(region)
            image = boot_image(spec.aws, self._ami, ec2, region, candidate.instance_type)
            subnet = self._subnet(ec2, candidate.zone)
            group_id = self._security_group(ec2, cluster_name, subnet["VpcId"], tags)
            placement = self._placement_group(ec2, cluster_name, tags)
            instances = [self._node_instance(ec2, cluster_name, spec, candidate, rank, image, subnet["SubnetId"],
                                             group_id, placement, tags, host_key) for rank in range(spec.nodes)]
            ids = [i["InstanceId"] for i in instances]
            self._wait_until(ec2, ids, "running")
        except (ClientError, BotoCoreError) as exc:
            failure: LaunchError = classify(exc, f"launch {cluster_name} on {candidate.label()}")
        except LaunchError as exc:
            failure = exc
        else:
            return self._cluster(cluster_name, region, self._cluster_instances(region, cluster_name))
        raise rolled_back(cluster_name, region, failure, lambda: self._call(
            f"roll back {cluster_name}", lambda: self._teardown_region(region, cluster_name)))

    @staticmethod
    def _wait_until(ec2: Any, ids: list[str], state: str) -> None:
        """Poll from 0.2 s up to 15 s apart (botocore's waiters poll every 15 s: slow for a node that is ready)."""
        deadline = time.monotonic() + WAIT_S
        delay = 0.2
        while True:
            pages = ec2.get_paginator("describe_instances").paginate(InstanceIds=ids)
            states = {i["InstanceId"]: i["State"]["Name"] for p in pages for r in p["Reservations"]
                      for i in r["Instances"]}
            if state == "running" and any(s in ("shutting-down", "terminated") for s in states.values()):
                ended = sorted(i for i, s in states.items() if s in ("shutting-down", "terminated"))
                raise CapacityError(f"aws: {', '.join(ended)} ended while starting (spot reclaimed?): trying elsewhere")
            if all(s == state for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise CapacityError(f"aws: {', '.join(ids)} not {state} after {WAIT_S:.0f}s: trying elsewhere")
            CANCEL.wait(delay)
            delay = min(delay * 2, 15.0)

    def _subnet(self, ec2: Any, zone: str | None) -> dict[str, Any]:
        filters = [{"Name": "default-for-az", "Values": ["true"]}]
        if zone:
            filters.append({"Name": "availability-zone", "Values": [zone]})
        subnets = sorted(ec2.describe_subnets(Filters=filters)["Subnets"], key=lambda s: s["AvailabilityZone"])
        if not subnets:
            raise InvalidRequestError(f"aws: no default subnet in {zone or 'the region'}: create a default VPC "
                                      "(aws ec2 create-default-vpc) or remove that zone from cluster.zones")
        return subnets[0]

    def _orchestrator_cidr(self) -> str:
        if self._ssh_cidr:
            return self._ssh_cidr
        try:
            with urllib.request.urlopen("https://checkip.amazonaws.com", timeout=10) as reply:
                self._ssh_cidr = reply.read().decode().strip() + "/32"
        except OSError as exc:
            raise InvalidRequestError(f"aws: cannot find this machine's public address for the SSH rule ({exc}): "
                                      "set TRAINPIPE_SSH_CIDR (e.g. 203.0.113.7/32)") from None
        return self._ssh_cidr

    def _security_group(self, ec2: Any, cluster_name: str, vpc_id: str, tags: dict[str, str]) -> str:
        """All traffic between the cluster's nodes (NCCL, EFA), SSH only from the orchestrator."""
        found = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [cluster_name]},
                                                      {"Name": "vpc-id", "Values": [vpc_id]}])["SecurityGroups"]
        if found:
            return str(found[0]["GroupId"])
        group_id = str(ec2.create_security_group(
            GroupName=cluster_name, Description=f"trainpipe cluster {cluster_name}", VpcId=vpc_id,
            TagSpecifications=[_tag_spec("security-group", tags)])["GroupId"])
        ec2.authorize_security_group_ingress(GroupId=group_id, IpPermissions=[
            {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id, "Description": "inside the cluster"}]},
            {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
             "IpRanges": [{"CidrIp": self._orchestrator_cidr(), "Description": "trainpipe orchestrator"}]},
        ])
        return group_id

    def _placement_group(self, ec2: Any, cluster_name: str, tags: dict[str, str]) -> str:
        try:
            ec2.describe_placement_groups(GroupNames=[cluster_name])
            return cluster_name
        except ClientError as exc:
            if error_code(exc) != "InvalidPlacementGroup.Unknown":
                raise
        # "cluster": all nodes in one low-latency, full-bisection segment of one zone.
        ec2.create_placement_group(GroupName=cluster_name, Strategy="cluster",
                                   TagSpecifications=[_tag_spec("placement-group", tags)])
        return cluster_name

    def _node_instance(self, ec2: Any, cluster_name: str, spec: ClusterSpec, candidate: Candidate, rank: int,
                       image: str, subnet_id: str, group_id: str, placement: str, tags: dict[str, str],
                       host_key: HostKey) -> dict[str, Any]:
        ended: tuple[str, ...] = ()
        while True:
            token = launch_token(cluster_name, candidate, rank, ended)
            earlier = list(self._instances(candidate.region, [{"Name": f"tag:{TAG_TOKEN}", "Values": [token]}]))
            live = [i for i in earlier if i["State"]["Name"] in ("pending", "running")]
            if live:
                log.info("%s rank %d: adopting %s from an earlier try of this launch", cluster_name, rank,
                         live[0]["InstanceId"])
                return live[0]
            if not earlier:
                break
            ended = tuple(sorted(i["InstanceId"] for i in earlier))
        # An adopted instance (above) keeps the key, and the tag, of the try that started it.
        node_tags = {**tags, "Name": f"{cluster_name}-node-{rank}", TAG_RANK: str(rank), TAG_TOKEN: token,
                     TAG_HOST_KEY: host_key.fingerprint}
        spot: dict[str, Any] | None = None
        if candidate.spot:
            spot = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
            if spec.max_price_per_hour is not None:
                spot["MaxPrice"] = f"{spec.max_price_per_hour / spec.nodes:.4f}"
        return self._run_node(ec2, token, host_key, node_tags, image=image, instance_type=candidate.instance_type,
                              placement={"GroupName": placement},
                              interfaces=self._interfaces(candidate.efa_interfaces, subnet_id, group_id),
                              profile=spec.aws.iam_instance_profile(), spot=spot, key_name=self._key_name)

    @staticmethod
    def _run_node(ec2: Any, token: str, host_key: HostKey, node_tags: dict[str, str], *, image: str,
                  instance_type: str, placement: dict[str, str], interfaces: list[dict[str, Any]],
                  profile: dict[str, Any] | None, spot: dict[str, Any] | None, key_name: str | None) -> dict[str, Any]:
        """One node's RunInstances: what a launched node and a replacement have in common."""
        request: dict[str, Any] = {
            "ImageId": image, "InstanceType": instance_type, "MinCount": 1, "MaxCount": 1,
            "ClientToken": token, "UserData": user_data(host_key), "InstanceInitiatedShutdownBehavior": "terminate",
            "Placement": placement, "NetworkInterfaces": interfaces,
            "TagSpecifications": [_tag_spec(kind, node_tags) for kind in ("instance", "volume", "network-interface")],
        }
        if key_name:
            request["KeyName"] = key_name
        if profile is not None:
            request["IamInstanceProfile"] = profile  # the nodes' own credentials for the dataset and checkpoints
        if spot is not None:
            request["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
            request["TagSpecifications"].append(_tag_spec("spot-instances-request", node_tags))
        return dict(ec2.run_instances(**request)["Instances"][0])

    @staticmethod
    def _interfaces(efa_interfaces: int, subnet_id: str, group_id: str) -> list[dict[str, Any]]:
        """One interface per EFA-capable network card (card 0 also carries the public address); ENA otherwise."""
        cards = max(efa_interfaces, 1)
        interfaces = []
        for card in range(cards):
            interface: dict[str, Any] = {"NetworkCardIndex": card, "DeviceIndex": 0 if card == 0 else 1,
                                         "SubnetId": subnet_id, "Groups": [group_id], "DeleteOnTermination": True}
            if efa_interfaces:
                interface["InterfaceType"] = "efa"
            if cards == 1:
                # EC2 assigns a public address only to instances with a single network interface.
                interface["AssociatePublicIpAddress"] = True
            interfaces.append(interface)
        return interfaces

    def _cluster(self, cluster_name: str, region: str, instances: list[dict[str, Any]]) -> Cluster:
        tags = _tags(instances[0])
        nodes = tuple(Node(
            name=_tags(i)["Name"], rank=int(_tags(i)[TAG_RANK]),
            address=i.get("PublicIpAddress") or i.get("PrivateIpAddress", ""),
            cluster_address=i.get("PrivateIpAddress", ""),
            workdir=f"{MOUNT}/trainpipe", data_dir=f"{MOUNT}/trainpipe/data", ckpt_dir=f"{MOUNT}/trainpipe/ckpt",
            python=agent_python(f"{MOUNT}/trainpipe"), node_python="python3",
        ) for i in instances)
        created = datetime.fromisoformat(tags[TAG_CREATED]).timestamp()
        _known_regions[cluster_name] = region
        # owner also says where the nodes are, so later calls (preemption, liveness) go straight to the region.
        owner = {"owner": tags[TAG_OWNER], "region": region,
                 "instances": {_tags(i)["Name"]: i["InstanceId"] for i in instances},
                 "instance_type": instances[0]["InstanceType"], LEASE_TTL: tags.get(TAG_LEASE_TTL),
                 "zone": instances[0]["Placement"]["AvailabilityZone"],
                 "placement_group": instances[0]["Placement"].get("GroupName", ""),
                 HOST_KEYS: {_tags(i)["Name"]: _tags(i)[TAG_HOST_KEY] for i in instances if TAG_HOST_KEY in _tags(i)}}
        return Cluster(name=cluster_name, provider=self.name, run_id=tags[TAG_RUN], nodes=nodes, created_at=created,
                       owner=owner)

    # -- replacing lost nodes -------------------------------------------------------------------------------------

    def placement(self, cluster: Cluster) -> str:
        owner = cluster.owner
        return (f"placement group {owner.get('placement_group') or '(none)'} in "
                f"{owner.get('zone') or owner.get('region')}")

    def end_nodes(self, cluster: Cluster, names: Sequence[str]) -> None:
        region = cluster.owner["region"]

        def end() -> None:
            ec2 = self.client(region)
            ids = [i["InstanceId"] for i in self._instances(region, [
                {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster.name]}, {"Name": "tag:Name", "Values": list(names)},
                {"Name": "instance-state-name", "Values": [*LIVE_STATES, "shutting-down"]}])]
            if ids:
                ec2.terminate_instances(InstanceIds=ids)
                self._wait_until(ec2, ids, "terminated")
                log.info("%s: terminated %s (%s)", cluster.name, ", ".join(ids), ", ".join(names))

        self._call(f"end {', '.join(names)} of {cluster.name}", end)

    def start_replacements(self, cluster: Cluster, lost: Sequence[Node], host_keys: dict[str, HostKey]) -> Cluster:
        region = cluster.owner["region"]

        def start() -> Cluster:
            ec2 = self.client(region)
            names = [node.name for node in lost]
            template = self._survivor(cluster, region, names)
            tags = {k: v for k, v in _tags(template).items() if k not in NODE_TAGS}
            primary = next(i for i in template["NetworkInterfaces"]
                           if i["Attachment"].get("NetworkCardIndex", 0) == 0 and i["Attachment"]["DeviceIndex"] == 0)
            efa = sum(1 for i in template["NetworkInterfaces"] if i.get("InterfaceType") == "efa")
            group = template["Placement"].get("GroupName")
            profile = template.get("IamInstanceProfile")
            ids = []
            for node in lost:
                key = host_keys[node.name]
                token = replacement_token(cluster.name, node.name, key)
                node_tags = {**tags, "Name": node.name, TAG_RANK: str(node.rank), TAG_TOKEN: token,
                             TAG_HOST_KEY: key.fingerprint, TAG_HEARTBEAT: f"{time.time():.0f}"}
                started = self._run_node(
                    ec2, token, key, node_tags, image=template["ImageId"], instance_type=template["InstanceType"],
                    placement={"GroupName": group} if group else {},
                    interfaces=self._interfaces(efa, primary["SubnetId"], primary["Groups"][0]["GroupId"]),
                    profile={"Arn": profile["Arn"]} if profile else None, spot=self._spot_options(ec2, template),
                    key_name=template.get("KeyName") or self._key_name)
                log.info("%s: %s started as %s", cluster.name, node.name, started["InstanceId"])
                ids.append(started["InstanceId"])
            self._wait_until(ec2, ids, "running")
            return self._cluster(cluster.name, region, self._cluster_instances(region, cluster.name))

        return self._call(f"replace nodes of {cluster.name} in {self.placement(cluster)}", start)

    def _survivor(self, cluster: Cluster, region: str, lost: list[str]) -> dict[str, Any]:
        """A live instance of the cluster that is not being replaced: the shape its replacements copy."""
        for instance in self._cluster_instances(region, cluster.name):
            if _tags(instance).get("Name") not in lost and instance["State"]["Name"] in ("pending", "running"):
                return instance
        raise ReplacementUnavailable(f"aws: no node of {cluster.name} survives in {region} to replace "
                                     f"{', '.join(lost)} next to: relaunch the cluster")

    @staticmethod
    def _spot_options(ec2: Any, template: dict[str, Any]) -> dict[str, Any] | None:
        """The market of the template: spot with its request's price cap, or on-demand (None)."""
        if template.get("InstanceLifecycle") != "spot":
            return None
        spot: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
        if request_id := template.get("SpotInstanceRequestId"):
            requests = ec2.describe_spot_instance_requests(SpotInstanceRequestIds=[request_id])
            price = next((r.get("SpotPrice") for r in requests["SpotInstanceRequests"]), None)
            if price:
                spot["MaxPrice"] = price
        return spot

    # -- describe / terminate / list ----------------------------------------------------------------------------

    def _call(self, doing: str, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except (ClientError, BotoCoreError) as exc:
            raise classify(exc, doing) from None

    def describe(self, cluster_name: str) -> Cluster | None:
        if not self._has_credentials():
            return None  # without credentials nothing of ours can exist: `down` and `status` ask every provider
        for region in self.regions():
            found = self._call(f"describe {cluster_name}", lambda r=region: self._cluster_instances(r, cluster_name))
            if found:
                return self._cluster(cluster_name, region, found)
        return None

    def terminate(self, cluster_name: str) -> bool:
        """Every region, the cluster's own first (where this process launched or found it): the region that bills is
        torn down before any other is asked, and a region that fails does not stop the others. The failures are
        raised once every region was tried (one as is, several together; transient when each was)."""
        if not self._has_credentials():
            return False
        removed = False
        failures: dict[str, LaunchError] = {}
        known = _known_regions.get(cluster_name)
        for region in ([known] if known else []) + [r for r in self.regions() if r != known]:
            try:
                removed = self._call(f"tear down {cluster_name} in {region}",
                                     lambda r=region: self._teardown_region(r, cluster_name)) or removed
            except LaunchError as exc:
                log.warning("%s: teardown in %s failed (%s): going on with the other regions", cluster_name, region,
                            exc)
                failures[region] = exc
        if len(failures) == 1:
            raise next(iter(failures.values()))
        if failures:
            error = LaunchError(f"aws: tear down {cluster_name} failed in {len(failures)} regions: "
                                + "; ".join(str(exc) for exc in failures.values()))
            error.transient = all(exc.transient for exc in failures.values())
            raise error
        return removed

    def _teardown_region(self, region: str, cluster_name: str) -> bool:
        """Instances first; the groups only once no instance uses them (else EC2 refuses, and they would leak)."""
        ec2 = self.client(region)
        ids = [i["InstanceId"] for i in self._instances(region, [
            {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster_name]},
            {"Name": "instance-state-name", "Values": [*LIVE_STATES, "shutting-down"]}])]
        if ids:
            ec2.terminate_instances(InstanceIds=ids)
            self._wait_until(ec2, ids, "terminated")
            log.info("terminated %d instances of %s in %s", len(ids), cluster_name, region)
        tagged = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster_name]}]
        groups = ec2.describe_security_groups(Filters=tagged)["SecurityGroups"]
        placements = ec2.describe_placement_groups(Filters=tagged)["PlacementGroups"]
        for group in placements:
            self._delete_when_free(lambda g=group: ec2.delete_placement_group(GroupName=g["GroupName"]),
                                   f"placement group {group['GroupName']}")
        for group in groups:
            self._delete_when_free(lambda g=group: ec2.delete_security_group(GroupId=g["GroupId"]),
                                   f"security group {group['GroupId']}")
        return bool(ids or groups or placements)

    @staticmethod
    def _delete_when_free(delete: Callable[[], Any], what: str) -> None:
        """EC2 keeps a group "in use" briefly after its instances end; that is transient, so retry with backoff."""
        for attempt in range(DELETE_RETRIES):
            try:
                delete()
                return
            except ClientError as exc:
                code = error_code(exc)
                if code in ("InvalidGroup.NotFound", "InvalidPlacementGroup.Unknown"):
                    return
                if code not in ("DependencyViolation", "InvalidPlacementGroup.InUse") or attempt == DELETE_RETRIES - 1:
                    raise
                delay = 2.0 * 2**attempt
                log.warning("%s still in use (%s): retry %d in %.0fs", what, code, attempt + 1, delay)
                time.sleep(delay)

    def list_clusters(self) -> list[ClusterRecord]:
        if not self._has_credentials():
            return []
        records = []
        for region in self.regions():
            records += self._call(f"list clusters in {region}", lambda r=region: self._region_records(r))
        return records

    def _region_records(self, region: str) -> list[ClusterRecord]:
        by_cluster: dict[str, list[dict[str, Any]]] = {}
        for instance in self._instances(region, [{"Name": "tag-key", "Values": [TAG_CLUSTER]},
                                                 {"Name": "instance-state-name", "Values": list(LIVE_STATES)}]):
            by_cluster.setdefault(_tags(instance)[TAG_CLUSTER], []).append(instance)
        # Groups without instances are what a crashed teardown left: list them too, so the sweeper removes them.
        groups = self.client(region).describe_security_groups(
            Filters=[{"Name": "tag-key", "Values": [TAG_CLUSTER]}])["SecurityGroups"]
        for group in groups:
            by_cluster.setdefault(_tags(group)[TAG_CLUSTER], [group])
        records = []
        for name, items in sorted(by_cluster.items()):
            tags = _tags(items[0])
            instances = [i for i in items if "InstanceId" in i]
            created = datetime.fromisoformat(tags[TAG_CREATED]).timestamp() if TAG_CREATED in tags else 0.0
            beats = [_tags(i).get(TAG_HEARTBEAT) for i in instances]
            records.append(ClusterRecord(
                name=name, provider=self.name, run_id=tags.get(TAG_RUN, "unknown"), created_at=created,
                nodes=len(instances), processes=len(instances),
                owner_alive=bool(instances) and lease_alive(beats, tags.get(TAG_LEASE_TTL), created)))
        return records

    # -- nodes --------------------------------------------------------------------------------------------------

    def _states(self, cluster: Cluster) -> dict[str, str]:
        ids = list(cluster.owner["instances"].values())
        ec2 = self.watch_client(cluster.owner["region"])
        pages = self._call(f"describe {cluster.name}", lambda: list(ec2.get_paginator("describe_instances").paginate(
            InstanceIds=ids)))
        return {_tags(i)["Name"]: i["State"]["Name"] for p in pages for r in p["Reservations"] for i in r["Instances"]}

    def heartbeat(self, cluster: Cluster) -> None:
        ids = list(cluster.owner["instances"].values())
        self._call(f"renew the heartbeat of {cluster.name}", lambda: self.client(cluster.owner["region"]).create_tags(
            Resources=ids, Tags=[{"Key": TAG_HEARTBEAT, "Value": f"{time.time():.0f}"}]))

    def nodes_alive(self, cluster: Cluster) -> dict[str, bool]:
        states = self._states(cluster)
        return {node.name: states.get(node.name) in ("pending", "running") for node in cluster.nodes}

    def preemption_notices(self, cluster: Cluster) -> list[PreemptionNotice]:
        """Spot requests EC2 marked for reclaim; the deadline is two minutes after the mark."""
        names = {iid: name for name, iid in cluster.owner["instances"].items()}
        reply = self._call(f"check spot notices of {cluster.name}",
                           lambda: self.watch_client(cluster.owner["region"]).describe_spot_instance_requests(
                               Filters=[{"Name": "instance-id", "Values": list(names)}]))
        notices = []
        for request in reply["SpotInstanceRequests"]:
            status = request.get("Status", {})
            if status.get("Code") in SPOT_NOTICE_CODES and request.get("InstanceId") in names:
                marked = status["UpdateTime"].timestamp()
                notices.append(PreemptionNotice(node=names[request["InstanceId"]], deadline=marked + SPOT_NOTICE_S,
                                                reason=f"spot {status['Code']}"))
        return notices
