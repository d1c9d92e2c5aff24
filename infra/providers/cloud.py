"""What every cloud provider shares: failover over the optimizer's candidates, the node mount, the owner stamp.

A cloud provider implements `launch_candidate` (every node on one candidate, or none) and gets `launch`: the
candidates that meet the job's floors, tried in order by `infra.failover`, each attempt kept for the summary.
"""

from __future__ import annotations

import getpass
import socket
from abc import abstractmethod

import psutil

from infra.catalog import Catalog, load_catalog
from infra.failover import launch_with_failover
from infra.optimizer import Candidate, NoCandidateError, candidates
from infra.providers.base import Attempt, Cluster, InvalidRequestError, LaunchError, Provider
from infra.spec import ClusterSpec

# Where a node's local NVMe (RAID0 over every instance-store / local-SSD device) is mounted by its boot script.
MOUNT = "/mnt/trainpipe"


def owner_stamp() -> str:
    """Who launched a cluster: user@host:pid:start-time, enough to tell later whether that process still runs."""
    me = psutil.Process()
    return f"{getpass.getuser()}@{socket.gethostname()}:{me.pid}:{me.create_time():.0f}"


def owner_alive(owner: str) -> bool:
    """Alive when the launching process still runs here; a launch from another machine cannot be checked: alive."""
    try:
        _, host_pid_time = owner.split("@", 1)
        host, pid, created = host_pid_time.rsplit(":", 2)
        if host != socket.gethostname():
            return True
        return abs(psutil.Process(int(pid)).create_time() - float(created)) < 1.0
    except (ValueError, psutil.NoSuchProcess):
        return False


class CloudProvider(Provider):
    """A provider that launches on catalog candidates; subclasses say how one candidate is launched."""

    def __init__(self, catalog: Catalog | None) -> None:
        # Nothing here touches the cloud: a provider is built for `plan` and `status` on machines without credentials.
        self._catalog = catalog
        self.last_attempts: list[Attempt] = []  # of the latest launch, for the run summary

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = load_catalog()
        return self._catalog

    @abstractmethod
    def launch_candidate(self, cluster_name: str, spec: ClusterSpec, run_id: str, candidate: Candidate) -> Cluster:
        """Every node on this candidate or none: on any failure what this call started is rolled back."""

    def launch(self, cluster_name: str, spec: ClusterSpec, run_id: str) -> Cluster:
        try:
            # The order of candidates does not depend on the job's length; one hour prices them.
            found = candidates(spec, self.catalog, hours=1.0)
        except NoCandidateError as exc:
            raise InvalidRequestError(str(exc)) from None
        try:
            launched = launch_with_failover(found, lambda c: self.launch_candidate(cluster_name, spec, run_id, c))
        except LaunchError as exc:
            self.last_attempts = list(getattr(exc, "attempts", []))
            raise
        self.last_attempts = launched.attempts
        return launched.recorded_cluster()
