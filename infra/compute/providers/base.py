"""The few operations every provider implements (SkyPilot's provision interface, in spirit).

The flow only ever calls these: launch, replace_nodes, describe, terminate, list_clusters, runner and
preemption_notices. Launch failures are typed so failover can decide what to try next.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from infra.compute.access.remote import Runner

if TYPE_CHECKING:  # the job spec imports the providers' config sections, which import this package
    from infra.compute.spec import ClusterSpec


class LaunchError(Exception):
    """A cluster could not be launched; subclasses say whether trying elsewhere can help."""

    transient = False


class CapacityError(LaunchError):
    """No capacity of this type here now: another zone, region or later may have it."""

    transient = True


class QuotaError(LaunchError):
    """The account's quota forbids it: raise the quota or ask for less."""


class PriceError(LaunchError):
    """The price exceeds the cap (e.g. spot above max price)."""


class InvalidRequestError(LaunchError):
    """The request can never succeed as written: fix the config."""


class ReplacementUnavailable(LaunchError):
    """Lost nodes cannot be replaced in the cluster's own placement (no capacity there now, or a provider that cannot
    replace single nodes): the caller relaunches the whole cluster instead, under its failover policy."""

    transient = True


@dataclass(frozen=True)
class Attempt:
    candidate: str  # Candidate.key
    instance_type: str
    region: str
    zone: str | None
    market: str
    outcome: str  # launched | capacity | quota | price | error | invalid | skipped
    error: str | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Node:
    name: str
    rank: int
    address: str
    workdir: str
    data_dir: str
    ckpt_dir: str
    # The agent's interpreter: what runs `python -m infra.node` (stage, sync, restore, watch), in an environment of
    # its own on the node (infra/compute/access/agent_env.py); never the one that trains.
    python: str
    # The node's address on the cluster's own network (the VPC/subnet private IP, the fabric's address, the netns
    # address): what node-to-node traffic binds and dials (peer servers, replicas, torchrun's rendezvous). `address`
    # is how trainpipe reaches the node (SSH, the orchestrator), possibly a public or NAT address that cannot be bound
    # on the node. Empty means the same as address (a record written before the field, a host with one address).
    cluster_address: str = ""
    # The node's own interpreter (the one the agent's environment was made from): the training environment when the
    # job names neither training.image nor training.python. Empty means the same as python (local nodes, records
    # written before the field).
    node_python: str = ""

    def __post_init__(self) -> None:
        if not self.cluster_address:
            object.__setattr__(self, "cluster_address", self.address)
        if not self.node_python:
            object.__setattr__(self, "node_python", self.python)

    def path(self, *parts: str) -> str:
        return "/".join([self.workdir.rstrip("/"), *parts])

    @property
    def sync_dir(self) -> str:
        """trainpipe's own state for the node's checkpoint syncer: outside the script's checkpoint dir."""
        return self.path("sync")

    @property
    def code_dir(self) -> str:
        """Where the job's shipped code is unpacked: the training command's working dir."""
        return self.path("code")

    @property
    def metrics_file(self) -> str:
        return self.path("logs", "metrics.jsonl")


@dataclass(frozen=True)
class Cluster:
    name: str
    provider: str
    run_id: str
    nodes: tuple[Node, ...]
    created_at: float
    # The provider's own state (pids, regions, instance ids, host keys): opaque to everyone but that provider.
    owner: dict[str, Any] = field(default_factory=dict)
    # What the cluster runs on and how it was obtained: the run summary's launch record and cost come from here.
    instance_type: str | None = None
    market: str = "on-demand"
    price_per_hour: float = 0.0  # the whole cluster, USD
    attempts: tuple[dict[str, Any], ...] = ()  # failover.Attempt.to_dict() of every launch attempt, in order
    # What bootstrap found on each node (mount, GPUs, interfaces) by node name, for providers that bootstrap nodes
    # over SSH; public, unlike owner: the run summary reports it.
    bootstrap: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        data = json.loads(text)
        data["nodes"] = tuple(Node(**node) for node in data["nodes"])
        data["attempts"] = tuple(data.get("attempts", ()))
        # Records written before bootstrap had its own field kept it in the provider's owner state.
        data.setdefault("bootstrap", data.get("owner", {}).pop("bootstrap", {}))
        return cls(**data)


def lost_nodes(cluster: Cluster, lost: Sequence[str]) -> list[Node]:
    """The cluster's nodes named in lost, in rank order; a name the cluster does not have is a caller's bug."""
    unknown = sorted(set(lost) - {node.name for node in cluster.nodes})
    if unknown or not lost:
        raise ValueError(f"{cluster.name}: cannot replace {unknown or 'no nodes'}: its nodes are "
                         f"{', '.join(node.name for node in cluster.nodes)}")
    return [node for node in cluster.nodes if node.name in lost]


def count_replaced(cluster: Cluster, nodes: Sequence[Node]) -> dict[str, Any]:
    """The cluster's owner state with each of these nodes' replacements counted (owner["replaced"]: name -> count),
    for a provider whose replacement keeps the node's name and place (local, netns, ssh)."""
    replaced = dict(cluster.owner.get("replaced", {}))
    for node in nodes:
        replaced[node.name] = int(replaced.get(node.name, 0)) + 1
    return {**cluster.owner, "replaced": replaced}


@dataclass(frozen=True)
class ClusterRecord:
    """What list_clusters reports: enough for the sweeper to decide whether the cluster is orphaned."""

    name: str
    provider: str
    run_id: str
    created_at: float
    nodes: int
    owner_alive: bool
    processes: int


@dataclass(frozen=True)
class PreemptionNotice:
    node: str
    deadline: float
    reason: str


class Provider(ABC):
    name: str
    # Where a node's watcher (infra.node watch) looks for preemption notices: the cloud's metadata service, or
    # the notice file the chaos injector raises on local and ssh nodes.
    notice_source: str = "none"
    # The metadata service's base URL the watchers poll; None: the cloud's own.
    notice_url: str | None = None
    # What a node's lease watchdog (infra.node watch --on-expire) does once its orchestrator has been silent for the
    # lease TTL: end every process of the node, or power the machine off (a cloud then ends the instance for good);
    # allocation: nothing, the scheduler's allocation judges the lease and its end ends the node's processes.
    lease_expiry: str = "kill-node"
    # Where a provider that installs the agent on its nodes (ssh, the clouds) puts the agent's wheels for them to
    # fetch (infra.compute.access.agent_store): the run's store prefix; None, or a store that cannot presign: the
    # wheels are copied from the orchestrator.
    agent_store: str | None = None

    def with_agent_store(self, url: str | None) -> Provider:
        """This provider, its nodes' agent wheels going through url (agent_store.agent_store_url of the run's
        prefix)."""
        self.agent_store = url
        return self

    @abstractmethod
    def launch(self, cluster_name: str, spec: ClusterSpec, run_id: str) -> Cluster:
        """Start every node or none: a partial launch is rolled back before raising LaunchError."""

    def check_site(self, spec: ClusterSpec) -> None:  # noqa: B027 - most providers have nothing to ask
        """Asked at plan, before anything is paid for: raise ValueError naming what the site has when it can never
        hold the cluster as asked (a scheduler's partitions, nodes, features, GPUs). A provider that launches
        machines on demand has nothing to ask: the catalog and the launch's failover judge those."""

    @abstractmethod
    def describe(self, cluster_name: str) -> Cluster | None: ...

    @abstractmethod
    def terminate(self, cluster_name: str) -> bool:
        """Idempotent; True when something was running or left behind and is now gone."""

    def terminate_keeping_data(self, cluster_name: str) -> bool:
        """Terminate, except that a relaunch on the same machines finds their staged data again: a recovery's
        teardown. A provider whose machines never come back (cloud instances) simply terminates."""
        return self.terminate(cluster_name)

    def replace_nodes(self, cluster: Cluster, lost: Sequence[str]) -> Cluster:
        """Replace only the lost nodes (by name) of a running cluster; the survivors are not touched.

        What is left of each lost node is ended first. Each replacement takes the lost node's rank, name and paths,
        in the cluster's own placement (the AWS placement group and zone, the GCP compact policy and zone, the same
        host and dir on local, netns and ssh); it starts empty, reachable and bootstrapped like a launched node. The
        returned cluster is the same cluster (name, run, created_at, price) with the new nodes in place and the
        provider's own state updated; the cluster record, the lease and heartbeat tags and list_clusters follow the
        new membership, so teardown and the sweeper find the replacement too, even if the caller dies half way.

        Raises ReplacementUnavailable when the placement cannot take a new node now (the caller then relaunches the
        whole cluster elsewhere), ValueError for a name the cluster does not have (lost_nodes); a replacement that
        fails half way leaves no new instance behind. The caller (tasks/replace.py) starts the new nodes' lease
        watchdogs; the survivors' keep running."""
        raise ReplacementUnavailable(f"the {self.name} provider cannot replace single nodes")

    @abstractmethod
    def list_clusters(self) -> list[ClusterRecord]: ...

    @abstractmethod
    def runner(self, cluster: Cluster, node: Node) -> Runner: ...

    @abstractmethod
    def preemption_notices(self, cluster: Cluster) -> list[PreemptionNotice]: ...

    @abstractmethod
    def nodes_alive(self, cluster: Cluster) -> dict[str, bool]:
        """Per node, whether it is still there (a vanished node counts as preempted)."""

    def heartbeat(self, cluster: Cluster) -> None:  # noqa: B027 - deliberately empty for most providers
        """Stamp the cluster alive now, where a sweeper on any machine reads it (ClusterRecord.owner_alive). Nothing
        to do where the owner is a process on the machine that keeps the cluster's record (local, netns, ssh)."""
