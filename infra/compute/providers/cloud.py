"""What every cloud provider shares: failover over the optimizer's candidates, the nodes' boot script, reaching the
nodes over SSH with pinned host keys, node bootstrap, the owner stamp.

A cloud provider implements `launch_candidate` (every node on one candidate, or none, each booted with the script
`boot_script` builds) and gets `launch`: the candidates that meet the job's floors, tried in order by
`infra.compute.failover`, each attempt kept for the summary; then every node is reached over SSH and bootstrapped
(infra.compute.access.bootstrap: the node agent's environment made from the image's python3 under
TRAINPIPE_AGENT_DIR, default ~/.trainpipe/agent; its wheels copied from here to the head only, which serves them to
the other nodes over the cluster network: infra.compute.access.agent_fanout), and its report goes into the cluster
record for the run summary. A node's python is the agent's (agent_env.agent_python: through a link in its workdir, so
a node described from the cloud's API names it too), its node_python the image's python3.

Nodes are reached as TRAINPIPE_SSH_USER (default ubuntu) with the private key TRAINPIPE_SSH_KEY_FILE. A new instance
makes up its own host key at boot, which nobody can know in advance, and an unknown key is never accepted: so launch
generates a host key for the cluster (infra.compute.access.hostkeys), the boot script installs
it before anything else, and the instance is tagged with its fingerprint. The record keeps only fingerprints, per node
(a node adopted from an earlier try of the same launch booted with that try's key), and every runner pins its node's.

`replace_nodes` (a preemption of some nodes) is shared too: a subclass ends what is left of the lost instances
(`end_nodes`) and starts one instance per lost node in the cluster's own placement (`start_replacements`); each
replacement boots with a host key of its own (only its fingerprint is pinned, as at launch), is reached and
bootstrapped like a launched node, and is ended again if anything of that fails.
"""

from __future__ import annotations

import logging
import os
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from infra.cancel import CANCEL
from infra.compute.access.agent_env import DEFAULT_AGENT_DIR, INSTALL_TIMEOUT_S, PROBE_TIMEOUT_S, BundleSource
from infra.compute.access.agent_fanout import PendingSource, Stocked, head_source
from infra.compute.access.agent_fetch import FETCH_TIMEOUT_S
from infra.compute.access.agent_store import StoreSource
from infra.compute.access.bootstrap import NodeReport, bootstrap_node
from infra.compute.access.hostkeys import SSH_DIR, HostKey, generate_host_key, install_script
from infra.compute.access.remote import RemoteError
from infra.compute.access.ssh.connection import HostKeyError, SshConnectError, wait_for_ssh
from infra.compute.access.ssh.runner import SshRunner
from infra.compute.catalog import Catalog, load_catalog
from infra.compute.failover import launch_with_failover
from infra.compute.optimizer import Candidate, NoCandidateError, candidates
from infra.compute.providers.base import (
    Attempt,
    CapacityError,
    Cluster,
    InvalidRequestError,
    LaunchError,
    Node,
    Provider,
    QuotaError,
    ReplacementUnavailable,
    lost_nodes,
)

# The ssh provider's helpers: run every node at once, and turn an SSH failure into the LaunchError saying whether
# trying again can help.
from infra.compute.providers.hosts import in_parallel, launch_error
from infra.compute.renewal import RENEWALS_PER_TTL, Renewal
from infra.compute.spec import ClusterSpec
from infra.node.processes import CLUSTER_TAG, NODE_TAG

log = logging.getLogger(__name__)

# Where a node's local NVMe (RAID0 over every instance-store / local-SSD device) is mounted by its boot script.
MOUNT = "/mnt/trainpipe"
SSH_PORT = 22
SSH_USER_ENV = "TRAINPIPE_SSH_USER"
SSH_KEY_ENV = "TRAINPIPE_SSH_KEY_FILE"
AGENT_DIR_ENV = "TRAINPIPE_AGENT_DIR"  # where on the nodes the agent's environments live
DEFAULT_SSH_USER = "ubuntu"  # the login user of the Ubuntu images both providers boot by default
HOST_KEYS = "host_keys"  # Cluster.owner[HOST_KEYS]: {node name: pinned SHA256 fingerprint}
LEASE_TTL = "lease_ttl_s"  # Cluster.owner[LEASE_TTL]: the lease TTL its nodes are tagged with (as text)
# The boot script's exit status, written when it ends; /run is emptied at every boot, so it is this boot's.
BOOT_STATUS = "/run/trainpipe-boot-status"
BOOT_TIMEOUT_S = 900.0  # from running to booted: sshd serving our key and the boot script (mdadm, mkfs) done
BOOT_POLL_S = 5.0
# How long a node waits for the head to hold the agent's wheels it serves: the head's boot, its probe and status, and
# the copy from here (bounded as an install is). Past it the node copies its own from here.
HEAD_WAIT_S = BOOT_TIMEOUT_S + 2 * PROBE_TIMEOUT_S + INSTALL_TIMEOUT_S
# The head's file server's own bound, should the orchestrator never stop it: the last node's wait, probe and fetch.
SERVE_S = HEAD_WAIT_S + 2 * PROBE_TIMEOUT_S + FETCH_TIMEOUT_S
DEFAULT_LEASE_TTL_S = ClusterSpec.model_fields["lease_ttl_s"].default


def lease_alive(heartbeats: Iterable[str | None], ttl_s: str | None, created_at: float,
                now: float | None = None) -> bool:
    """Whether the run that launched a cluster still lives, judged alike from every machine (no host or pid in it):
    its orchestrator stamps the cluster's heartbeat several times per lease TTL (while launch waits for the nodes,
    then infra.lifecycle.lease.LeaseKeeper), so when the newest stamp any node carries is older than the TTL,
    nobody renews it. The same TTL after which the nodes' own watchdogs power them off. A cluster stamped before
    heartbeats existed counts from its creation."""
    beats = [_number(beat) for beat in heartbeats]
    newest = max((beat for beat in beats if beat is not None), default=created_at)
    ttl = _number(ttl_s) or DEFAULT_LEASE_TTL_S
    return (time.time() if now is None else now) - newest <= ttl


def rolled_back(cluster_name: str, where: str, failure: LaunchError, undo: Callable[[], object]) -> LaunchError:
    """`failure`, once undo() has ended what a failed launch started. An undo that fails (a LaunchError) is logged:
    what is left carries the cluster's tags, so the sweeper finds it, and the launch failure stays what the caller
    must act on."""
    log.warning("rolling back partial launch of %s in %s: %s", cluster_name, where, failure)
    try:
        undo()
    except LaunchError as left:
        log.error("rollback of %s in %s failed, resources left for `trainpipe sweep`: %s", cluster_name, where, left)
    return failure


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def boot_script(host_key: HostKey, body: str, status_file: str = BOOT_STATUS, ssh_dir: str = SSH_DIR) -> str:
    """A node's boot script: the host key first, so sshd serves the pinned key as early as possible and nothing that
    follows can delay or break that; then body (the provider's NVMe mount). Its exit status lands in status_file,
    which bootstrap waits for, so no job starts on a node whose mount is not ready. (status_file and ssh_dir are
    parameters so that tests can run the script outside a real node.)

    The script carries the host's private key, and EC2 user-data / GCE metadata are readable by anyone allowed to
    describe instances in the account or project: the key proves only "a node this account launched", the same trust
    boundary as the account's SSH key pair (which such a principal can usually replace anyway)."""
    if '"' in status_file or "'" in status_file:
        raise ValueError(f"status file {status_file!r} would break the trap's quoting")
    tmp = f"{status_file}.tmp"
    trap = f"""trap 'code=$?; printf "%s\\n" "$code" > "{tmp}" && mv -f "{tmp}" "{status_file}"' EXIT"""
    return f"#!/bin/bash\nset -euo pipefail\n{trap}\n{install_script(host_key, ssh_dir)}{body}"


class CloudProvider(Provider):
    """A provider that launches on catalog candidates; subclasses say how one candidate is launched."""

    key_hint = "the private key whose public key the nodes accept"  # what TRAINPIPE_SSH_KEY_FILE must name
    # Nodes are launched so that powering off ends them for good (EC2: instance-initiated shutdown terminates;
    # GCE, and Azure VMs with a user-assigned identity: a unit the boot script installs deletes the instance as it
    # powers off): an expired lease ends the billing.
    lease_expiry = "shutdown"
    boot_log = "the boot log"  # where a node's boot script output goes, for error messages

    def __init__(self, catalog: Catalog | None, bootstrap: bool = True) -> None:
        """bootstrap: reach and bootstrap every node after a launch (False only where there are no machines, as
        against a simulated cloud API)."""
        # Nothing here touches the cloud: a provider is built for `plan` and `status` on machines without credentials.
        self._catalog = catalog
        self._bootstrap = bootstrap
        # On the nodes: where the agent's environments are kept, across runs on an image that keeps its disk.
        self.agent_dir = os.environ.get(AGENT_DIR_ENV, "").strip() or DEFAULT_AGENT_DIR
        self.last_attempts: list[Attempt] = []  # of the latest launch, for the run summary
        self.last_reports: dict[str, NodeReport] = {}  # of the latest launch's bootstrap
        # Where nodes' sshd listens and where their boot script leaves its status; tests point them at a local sshd.
        self.ssh_port = SSH_PORT
        self.boot_status = BOOT_STATUS

    @property
    def notice_source(self) -> str:  # type: ignore[override]
        """A cloud's nodes read preemption notices from that cloud's metadata service, named as the cloud."""
        return self.name

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = load_catalog()
        return self._catalog

    @abstractmethod
    def launch_candidate(self, cluster_name: str, spec: ClusterSpec, run_id: str, candidate: Candidate,
                         host_key: HostKey) -> Cluster:
        """Every node on this candidate or none: on any failure what this call started is rolled back. Each node boots
        with boot_script(host_key, ...) and is tagged with host_key.fingerprint, which _cluster records per node."""

    def launch(self, cluster_name: str, spec: ClusterSpec, run_id: str) -> Cluster:
        self.ssh_access(check_file=True)  # before anything is paid for: nodes nobody can reach are no use
        try:
            # The order of candidates does not depend on the job's length; one hour prices them.
            found = candidates(spec, self.catalog, hours=1.0)
        except NoCandidateError as exc:
            raise InvalidRequestError(str(exc)) from None
        host_key = generate_host_key()  # one per cluster; only its fingerprint is ever recorded
        # Booting can take longer than the lease TTL: the heartbeat is kept from the first instance on, so a sweeper
        # elsewhere never takes a cluster that is still being launched.
        beating = Renewal(f"heartbeat of {cluster_name} while it launches", lambda: self._heartbeat_named(cluster_name),
                          spec.lease_ttl_s / RENEWALS_PER_TTL).start()
        try:
            return self._launch_and_bootstrap(cluster_name, spec, run_id, found, host_key)
        finally:
            beating.stop()

    # -- replacing lost nodes -------------------------------------------------------------------------------------

    @abstractmethod
    def placement(self, cluster: Cluster) -> str:
        """Where the cluster's nodes are placed, in words (errors name it)."""

    @abstractmethod
    def end_nodes(self, cluster: Cluster, names: Sequence[str]) -> None:
        """End every instance of the cluster that carries one of these node names, and wait until each has ended."""

    @abstractmethod
    def start_replacements(self, cluster: Cluster, lost: Sequence[Node], host_keys: dict[str, HostKey]) -> Cluster:
        """One instance per lost node, in the cluster's placement and shape (copied from the instances it has),
        tagged like a launched node and booting with host_keys[node.name]; once all are running, the cluster as the
        control plane describes it now (nodes and owner state). May leave started instances behind when it raises:
        the caller ends them (end_nodes)."""

    def replace_nodes(self, cluster: Cluster, lost: Sequence[str]) -> Cluster:
        gone = lost_nodes(cluster, lost)
        names = [node.name for node in gone]
        self.ssh_access(check_file=True)  # before anything is paid for, as at launch
        ttl = _number(cluster.owner.get(LEASE_TTL)) or DEFAULT_LEASE_TTL_S
        # Booting a replacement can outlast the lease TTL: the heartbeat is kept (on every instance of the cluster,
        # the new ones included) so that no sweeper takes the cluster meanwhile, and stops with this process.
        beating = Renewal(f"heartbeat of {cluster.name} while {', '.join(names)} are replaced",
                          lambda: self._heartbeat_named(cluster.name), ttl / RENEWALS_PER_TTL).start()
        try:
            return self._replace_and_bootstrap(cluster, gone)
        finally:
            beating.stop()

    def _replace_and_bootstrap(self, cluster: Cluster, lost: list[Node]) -> Cluster:
        names = [node.name for node in lost]
        where = self.placement(cluster)
        log.info("%s: replacing %s in %s", cluster.name, ", ".join(names), where)
        self.end_nodes(cluster, names)  # what is left of them (a reclaimed instance still shutting down, say)
        host_keys = {name: generate_host_key() for name in names}  # each pinned by its fingerprint only
        try:
            now = self.start_replacements(cluster, lost, host_keys)
            missing = sorted(set(names) - {node.name for node in now.nodes})
            if missing:
                raise LaunchError(f"{self.name}: {', '.join(missing)} of {cluster.name} ended while replacing: "
                                  "relaunch the cluster")
            # The same cluster (run, price, attempts, the survivors' reports) with its new membership.
            replaced = replace(cluster, nodes=now.nodes, owner={**cluster.owner, **now.owner})
            if self._bootstrap:
                replaced = self.bootstrap_nodes(replaced, only=names)
        except Exception as exc:
            # Never a half-started node: whatever this replacement started is ended before the failure is raised.
            log.warning("%s: ending the replacements of %s: %s", cluster.name, ", ".join(names), exc)
            try:
                with CANCEL.shield():  # a cancel may be what stopped it: the cleanup must still run
                    self.end_nodes(cluster, names)
            except LaunchError as left:
                log.error("%s: ending the replacements failed, instances left for `trainpipe sweep`: %s",
                          cluster.name, left)
            if isinstance(exc, CapacityError | QuotaError):
                raise ReplacementUnavailable(f"{self.name}: cannot replace {', '.join(names)} of {cluster.name} in "
                                             f"{where}: {exc}") from exc
            raise
        log.info("%s: %s replaced in %s", cluster.name, ", ".join(names), where)
        return replaced

    def _heartbeat_named(self, cluster_name: str) -> None:
        cluster = self.describe(cluster_name)
        if cluster is not None:
            self.heartbeat(cluster)

    def _launch_and_bootstrap(self, cluster_name: str, spec: ClusterSpec, run_id: str, found: list[Candidate],
                              host_key: HostKey) -> Cluster:
        try:
            launched = launch_with_failover(
                found, lambda c: self.launch_candidate(cluster_name, spec, run_id, c, host_key))
        except LaunchError as exc:
            self.last_attempts = list(getattr(exc, "attempts", []))
            raise
        self.last_attempts = launched.attempts
        cluster = launched.recorded_cluster()
        if not self._bootstrap:
            return cluster
        try:
            return self.bootstrap_nodes(cluster)
        except Exception as exc:
            # Every node or none: instances that cannot run the job are not left running (and billed).
            log.warning("tearing down %s: it launched, but its nodes could not be bootstrapped: %s", cluster_name, exc)
            try:
                with CANCEL.shield():  # a cancel is what may have stopped the bootstrap: the teardown must still run
                    self.terminate(cluster_name)
            except LaunchError as left:
                log.error("teardown of %s failed, resources left for `trainpipe sweep`: %s", cluster_name, left)
            if isinstance(exc, LaunchError):
                exc.attempts = launched.attempts  # type: ignore[attr-defined] - the run summary lists them on failure
            raise

    # -- reaching nodes -------------------------------------------------------------------------------------------

    def ssh_access(self, check_file: bool = False) -> tuple[str, str]:
        """(user, key file) nodes are reached with, from TRAINPIPE_SSH_USER and TRAINPIPE_SSH_KEY_FILE; check_file
        also checks that the key file can be read (at launch: runners load it only when they connect)."""
        key_file = os.environ.get(SSH_KEY_ENV, "").strip()
        if not key_file:
            raise InvalidRequestError(f"{self.name}: {SSH_KEY_ENV} is not set: nodes are reached over SSH with that "
                                      f"private key; set it to {self.key_hint} (e.g. export "
                                      f"{SSH_KEY_ENV}=~/.ssh/trainpipe_ed25519)")
        path = Path(key_file).expanduser()
        if check_file and not (path.is_file() and os.access(path, os.R_OK)):
            raise InvalidRequestError(f"{self.name}: {SSH_KEY_ENV}={key_file} is not a readable file: point it at "
                                      f"{self.key_hint}")
        return os.environ.get(SSH_USER_ENV, "").strip() or DEFAULT_SSH_USER, str(path)

    def runner(self, cluster: Cluster, node: Node) -> SshRunner:
        """The node over SSH, pinned to the host key its boot script installed. Its commands run in the node's
        workdir, tagged with the cluster (one cloud instance runs one cluster, so its workdir names it) and the
        node, which teardown and the node watchdog find processes by, as on every provider."""
        user, key_file = self.ssh_access()
        host_key = cluster.owner.get(HOST_KEYS, {}).get(node.name)
        if not host_key:
            raise InvalidRequestError(f"{self.name}: {node.name} of cluster {cluster.name} has no pinned host key "
                                      "in its record (launched by a trainpipe without host key pinning): tear it "
                                      f"down (trainpipe down {cluster.name}) and launch it again")
        return SshRunner(node_name=node.name, host=node.address, port=self.ssh_port, user=user, key_file=key_file,
                         host_key=host_key, workdir=node.workdir, tags={CLUSTER_TAG: node.workdir, NODE_TAG: node.name})

    # -- bootstrap ------------------------------------------------------------------------------------------------

    def bootstrap_nodes(self, cluster: Cluster, only: Sequence[str] | None = None) -> Cluster:
        """Every node (of only, when given: the others keep their reports) reached over SSH once booted (pinned host
        key, boot script done) and bootstrapped: the cluster with the reports in its bootstrap field, as the ssh
        provider records them. A failure on any node raises the LaunchError that says whether trying again can help,
        naming every node that failed.

        The agent's wheels cross the orchestrator's uplink once at most: the head gets them from the run's store
        prefix (agent_store), or from here where the store cannot serve them, then serves them to the other nodes
        over the cluster network (infra.compute.access.agent_fanout)."""
        nodes = [node for node in cluster.nodes if only is None or node.name in only]
        store = StoreSource(self.agent_store) if self.agent_store else None
        pending = self._head_source(cluster, nodes, store)
        try:
            outcomes = in_parallel(nodes, lambda node: self._bootstrap_node(cluster, node, pending, store))
        finally:
            if pending is not None:
                pending.stop()
        failures = [(node, error) for node, _, error in outcomes if error is not None]
        if failures:
            unexpected = [error for _, error in failures if not isinstance(error, LaunchError | RemoteError | OSError)]
            if unexpected:
                raise unexpected[0]  # a bug, not a node problem: keep its type and traceback
            errors = [launch_error(error) for _, error in failures]
            raise type(errors[0])("; ".join(str(e) for e in errors)) from failures[0][1]
        self.last_reports = {node.name: report for node, report, _ in outcomes}
        head = self.last_reports.get(cluster.head.name)
        if head is not None and pending is not None:
            # Got before the head's own bootstrap, which then found them there.
            stocked = pending.stocked
            self.last_reports[head.node] = replace(
                head, agent_copied_bytes=head.agent_copied_bytes + stocked.copied,
                agent_store_bytes=head.agent_store_bytes + stocked.store_bytes)
        reports = {name: report.to_dict() for name, report in self.last_reports.items()}
        kept = {} if only is None else {name: r for name, r in cluster.bootstrap.items() if name not in only}
        return replace(cluster, bootstrap={**kept, **reports})

    def _head_source(self, cluster: Cluster, nodes: list[Node], store: StoreSource | None) -> PendingSource | None:
        """The head as the source of the agent's wheels for the other nodes bootstrapped; None when there are none.
        A head bootstrapped too is stocked by its own bootstrap (_bootstrap_node); a surviving head (beside
        replacements) serves the wheels when it holds them all, and any problem with it leaves the new nodes getting
        theirs from the store or from here, as without it."""
        head = cluster.head
        if not any(node.name != head.name for node in nodes):
            return None
        pending = PendingSource(head.name, HEAD_WAIT_S)
        if all(node.name != head.name for node in nodes):
            try:
                with pending.publishing():
                    pending.publish(self._stock_head(self.runner(cluster, head), head, stock=False, store=store))
            except (LaunchError, RemoteError, OSError) as exc:
                log.warning("%s: the surviving head %s cannot serve the agent's wheels (%s): the new nodes get "
                            "theirs from elsewhere", cluster.name, head.name, exc)
        return pending

    def _stock_head(self, runner: SshRunner, head: Node, stock: bool, store: StoreSource | None) -> Stocked:
        return head_source(runner, head.node_python, self.agent_dir, head.cluster_address, SERVE_S, stock=stock,
                           store=store)

    def _bootstrap_node(self, cluster: Cluster, node: Node, pending: PendingSource | None,
                        store: StoreSource | None) -> NodeReport:
        sources: list[BundleSource] = []
        if pending is not None and node.name == cluster.head.name:
            with pending.publishing():  # the others wait for it
                runner = self._reached(cluster, node)
                pending.publish(self._stock_head(runner, node, stock=True, store=store))
        else:
            runner = self._reached(cluster, node)
            head = pending.wait(node.name) if pending is not None else None
            sources = [head] if head is not None else []
        # What the head could not give (or, alone, everything) from the store, before anything is copied from here.
        sources += [store] if store is not None else []
        return bootstrap_node(runner, node.node_python, self.agent_dir, workdir=node.workdir, sources=sources)

    def _reached(self, cluster: Cluster, node: Node) -> SshRunner:
        """The node's runner, once it is booted: sshd answers with the pinned key and the boot script is done."""
        runner = self.runner(cluster, node)
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        try:
            waited = wait_for_ssh(node.address, self.ssh_port, BOOT_TIMEOUT_S)
        except SshConnectError as exc:
            raise SshConnectError(f"{node.name}: {exc}") from None  # the address alone does not say which node
        log.info("%s: sshd answers at %s after %.0fs", node.name, node.address, waited)
        self._await_host_key(runner, deadline)
        self._await_boot_script(runner, deadline)
        return runner

    def _await_host_key(self, runner: SshRunner, deadline: float) -> None:
        """Connect once sshd serves the pinned key. Until the boot script has installed it, sshd serves the key the
        image made up at first boot: that is refused like any unknown key, and asked again while ours is on its
        way. Nothing other than the pinned key is ever accepted, so waiting costs time, never trust."""
        while True:
            try:
                runner.connect()
                return
            except HostKeyError as exc:
                if time.monotonic() >= deadline:
                    raise HostKeyError(f"{exc}. It did not serve the pinned key within {BOOT_TIMEOUT_S:.0f}s: the "
                                       f"boot script did not install it (see {self.boot_log} on the node)") from None
                log.info("%s: not serving the pinned host key %s yet (boot script still to run): asking again in "
                         "%.0fs", runner.node_name, runner.endpoint.host_key, BOOT_POLL_S)
            CANCEL.wait(min(BOOT_POLL_S, deadline - time.monotonic()))

    def _await_boot_script(self, runner: SshRunner, deadline: float) -> None:
        """Wait for the boot script's exit status: the mount the job writes to is ready once it is 0."""
        while True:
            status = (runner.read_text(self.boot_status) or "").strip()
            if status == "0":
                return
            if status:
                raise LaunchError(f"{runner.node_name}: the boot script failed (exit {status}): see {self.boot_log} "
                                  "on the node; the image may lack what it needs (mdadm, mkfs.xfs, systemd's sshd)")
            if time.monotonic() >= deadline:
                raise LaunchError(f"{runner.node_name}: the boot script had not finished {BOOT_TIMEOUT_S:.0f}s after "
                                  f"launch: see {self.boot_log} on the node")
            CANCEL.wait(min(BOOT_POLL_S, deadline - time.monotonic()))

