"""provider slurm: the allocation is the cluster.

launch submits one batch job (holder.py's script) asking for cluster.nodes nodes with the section's partition,
account, QOS, reservation, constraint, GRES, exclusivity and walltime; names it trainpipe-<cluster> and tags its
comment with the run and the launcher, so `squeue` finds it from any process (the sweeper). It waits, until
queue_timeout_s and cancellably, for the job to run, logging the pending reason as it changes; then reads the nodes
(`scontrol show hostnames`, each one's NodeAddr as its cluster address) and waits for the holder to have made every
node's workdir, then makes (or finds) the node agent's own environment on every node (agent.py): Node.python is
its interpreter, Node.node_python cluster.slurm.python. Any failure on the way cancels the job and waits until squeue
no longer shows it.

Every node command is a job step (runner.SlurmRunner). terminate is scancel plus a wait until squeue no longer shows
the job; the record (slurm-clusters/<name>.json in the workspace) only remembers the nodes' paths for describe.
The holder raises the preemption notices (USR1 / SIGTERM) on every node and ends the allocation when the lease
lapses, which ends every step; the nodes' own watchdogs (job steps) leave the lease to it: the renewals are job steps
too, and only the holder knows whether slurmctld's silence kept them from getting through.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from infra.cancel import CANCEL
from infra.compute.access.remote import RemoteError, Runner
from infra.compute.providers.base import (
    Attempt,
    Cluster,
    ClusterRecord,
    InvalidRequestError,
    LaunchError,
    Node,
    PreemptionNotice,
    Provider,
    ReplacementUnavailable,
    lost_nodes,
)
from infra.compute.providers.owner import launcher, launcher_alive, launcher_stamp
from infra.compute.providers.slurm import agent, cli, site, topology
from infra.compute.providers.slurm.config import NODE_PLACEHOLDER, SlurmClusterSpec
from infra.compute.providers.slurm.holder import READY_FILE, holder_script
from infra.compute.providers.slurm.login import Login, login_of
from infra.compute.providers.slurm.runner import SlurmRunner
from infra.compute.renewal import RENEWALS_PER_TTL, Renewal
from infra.compute.spec import ClusterSpec
from infra.node.preemption_notice import NOTICE_FILE, Notice, parse_notice
from infra.node.processes import CLUSTER_TAG, NODE_TAG
from infra.node.watchdog import LEASE_FILE
from infra.workspace import workspace_dir

log = logging.getLogger(__name__)

JOB_PREFIX = "trainpipe-"
POLL_S = 1.0
READY_TIMEOUT_S = 120.0  # from RUNNING to every node's workdir made by the holder's first step
REMOVE_TIMEOUT_S = 120.0  # a node's last step at teardown: its workdir removed
DOWN_STATES = frozenset({"DOWN", "FAIL"})  # a node's state flags (scontrol: DOWN+NOT_RESPONDING) that mean it is lost
REPLACE_QUEUE_S = 120.0  # the most a lost node's one-node allocation may stay pending before the cluster is relaunched
GONE_TIMEOUT_S = 180.0  # scancel to squeue no longer showing the job (KillWait, 30 s by default, and epilogs)
# Pending reasons that no wait can cure (the request exceeds what the partition, account or QOS allows, or asks for
# features no node has): sbatch accepts such a job unless the site enforces partition limits at submit.
NEVER_RUNS = frozenset({"PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints",
                        "InvalidAccount", "InvalidQOS"})


class QueueTimeout(cli.SlurmError):
    """The allocation stayed pending for cluster.slurm.queue_timeout_s and was cancelled. Not transient: the bound is
    the user's, and a retried launch would wait it out again."""


def job_name(cluster_name: str) -> str:
    return f"{JOB_PREFIX}{cluster_name}"


def slurm_clusters_dir() -> Path:
    return workspace_dir() / "slurm-clusters"


class SlurmProvider(Provider):
    name = "slurm"
    notice_source = "file"  # the holder writes each node's notice file
    lease_expiry = "allocation"  # the holder ends the allocation on the lease; the nodes' watchdogs watch notices

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or slurm_clusters_dir()
        self._relayed: set[tuple[str, str, float]] = set()  # (cluster, replacement node, notice deadline)

    def _record(self, cluster_name: str) -> Path:
        return self.root / f"{cluster_name}.json"

    def _script(self, cluster_name: str) -> Path:
        return self.root / f"{cluster_name}.holder.sh"

    # -- launching --------------------------------------------------------------------------------------------------

    def launch(self, cluster_name: str, spec: ClusterSpec, run_id: str) -> Cluster:
        config: SlurmClusterSpec = spec.slurm
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        login = login_of(config)
        script = self._script(cluster_name)
        early = site.signals_preemption_early(site.site_config(login))
        script.write_text(holder_script(cluster_name, run_id, config.node_workdir(NODE_PLACEHOLDER, cluster_name),
                                        spec.lease_ttl_s, config.signal_lead_s, ask_preemption=not early))
        options = sbatch_options(cluster_name, run_id, spec)
        try:
            job_id = cli.submit(login, options, script.read_text())
        except BaseException:
            script.unlink(missing_ok=True)
            raise
        log.info("slurm job %s submitted for cluster %s (%d nodes%s)", job_id, cluster_name, spec.nodes,
                 f", partition {config.partition}" if config.partition else "")
        # On record from here on: a launch killed while the job is pending leaves nothing teardown cannot find.
        pending = Cluster(name=cluster_name, provider=self.name, run_id=run_id, nodes=(), created_at=time.time(),
                          owner={**launcher(), "job_id": job_id, "hosts": {}, "login": login.to_dict(),
                                 # what a lost node's one-node replacement asks for (replace_nodes)
                                 "sbatch": options, "queue_timeout_s": config.queue_timeout_s,
                                 "lease_ttl_s": spec.lease_ttl_s,
                                 "workdir_template": config.node_workdir(NODE_PLACEHOLDER, cluster_name),
                                 # where and from what each node's agent environment is made (a replacement too)
                                 "agent": {"python": config.python, "agent_dir": config.agent_dir,
                                           "bundle_dir": config.agent_bundle_dir}})
        self._write_record(pending)
        try:
            state = self._wait_running(login, job_id, config.queue_timeout_s)
            cluster = self._cluster(pending, state, config, spec.nodes, started)
            self._write_record(cluster)
            self._wait_ready(cluster, cluster.head, job_id)
            with self._lease_renewed(cluster, cluster.head):
                cluster = self._with_agents(cluster, cluster.nodes)
            self._write_record(cluster)
        except BaseException:
            with CANCEL.shield():
                self._end(cluster_name, [job_id], login)
            raise
        log.info("slurm job %s running on %s", job_id, ", ".join(cluster.owner["hosts"].values()))
        return cluster

    def _wait_running(self, login: Login, job_id: str, queue_timeout_s: float) -> cli.JobState:
        deadline = time.monotonic() + queue_timeout_s
        reason = None
        while True:
            state = cli.job(login, job_id)
            if state is None or state.state not in cli.LIVE_STATES:
                raise LaunchError(f"slurm job {job_id} ended before it ran ({state.state if state else 'gone'}"
                                  f"{f', {state.reason}' if state else ''}): see `sacct -j {job_id}`")
            if state.state == "RUNNING":
                return state
            if state.reason in NEVER_RUNS:
                raise InvalidRequestError(f"slurm job {job_id} can never start as asked (pending reason "
                                          f"{state.reason}): cancelled; fix cluster.nodes or cluster.slurm "
                                          "(partition, time_limit, constraint, account, qos)")
            if state.reason != reason:
                reason = state.reason
                log.info("slurm job %s %s: %s", job_id, state.state.lower(), reason)
            if time.monotonic() > deadline:
                raise QueueTimeout(f"slurm job {job_id} still {state.state.lower()} after {queue_timeout_s:g}s "
                                    f"(reason: {state.reason}): cancelled; wait for the partition to free up, ask "
                                    "for fewer nodes, or raise cluster.slurm.queue_timeout_s")
            CANCEL.wait(POLL_S)

    def _cluster(self, pending: Cluster, state: cli.JobState, config: SlurmClusterSpec, count: int,
                 started: float) -> Cluster:
        login = _login(pending)
        hosts = cli.hostnames(login, state.nodes)
        if len(hosts) != count:
            raise LaunchError(f"slurm job {state.job_id} runs on {len(hosts)} nodes ({state.nodes}), not {count}")
        addresses = cli.node_addresses(login, hosts)
        nodes = []
        for rank, host in enumerate(hosts):
            workdir = config.node_workdir(host, pending.name)
            # NodeAddr is both: the address slurmctld and the job steps reach the node by, on the cluster network.
            address = addresses.get(host, host)
            nodes.append(Node(name=f"{pending.name}-{host}", rank=rank, address=address, cluster_address=address,
                              workdir=workdir, data_dir=f"{workdir}/data", ckpt_dir=f"{workdir}/ckpt",
                              python=config.python, node_python=config.python))
        # The zone is what the run summary says the cluster ran "in": the partition, the job and its nodes.
        attempt = Attempt(candidate=self.name, instance_type=f"slurm:{state.partition}", region=state.partition,
                          zone=f"{state.partition}, job {state.job_id} on {state.nodes}", market="on-demand",
                          outcome="launched", error=None,
                          seconds=round(time.monotonic() - started, 3))
        gpus = (config.gpus_per_node or 0) * count
        return Cluster(name=pending.name, provider=self.name, run_id=pending.run_id, nodes=tuple(nodes),
                       created_at=pending.created_at,
                       owner={**pending.owner, "hosts": {node.name: host for node, host in zip(nodes, hosts,
                                                                                                strict=True)},
                              "partition": state.partition, "node_list": state.nodes},
                       instance_type=f"slurm:{state.partition}", price_per_hour=config.price_per_gpu_hour * gpus,
                       attempts=(attempt.to_dict(),))

    def _wait_ready(self, cluster: Cluster, head: Node, job_id: str) -> None:
        """The holder's first step made every node's workdir; its marker, in the workdir of the job's first node
        (head), is the last thing it writes."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        runner = self.runner(cluster, head)
        while (runner.read_text(head.path(READY_FILE)) or "").strip() != job_id:
            state = cli.job(_login(cluster), job_id)
            if state is None or state.state != "RUNNING":
                raise LaunchError(f"slurm job {job_id} ended while making the nodes' workdirs "
                                  f"({state.state if state else 'gone'}): see {head.path('logs')} on "
                                  f"{cluster.owner['hosts'][head.name]}")
            if time.monotonic() > deadline:
                raise LaunchError(f"slurm job {job_id}: the nodes' workdirs were not made within "
                                  f"{READY_TIMEOUT_S:g}s: see the holder's log in {head.path('logs')}")
            CANCEL.wait(POLL_S)

    @contextlib.contextmanager
    def _lease_renewed(self, cluster: Cluster, holder_node: Node) -> Iterator[None]:
        """The lease of the holder on holder_node renewed while the launch goes on: making the agents' environment
        takes a minute or more on a node that has none, and the run's LeaseKeeper starts only once the launch has
        returned, while the holder counts the TTL from its own start (a launch longer than the TTL ended itself)."""
        ttl_s = cluster.owner.get("lease_ttl_s")
        if ttl_s is None:  # a record written before the TTL was kept in it
            yield
            return
        runner = self.runner(cluster, holder_node)

        def renew() -> None:
            runner.write_text(holder_node.path(LEASE_FILE), f"{time.time():.3f}\n")

        renew()
        renewal = Renewal(f"lease of {cluster.name}'s holder on {holder_node.name} while it launches", renew,
                          float(ttl_s) / RENEWALS_PER_TTL).start()
        try:
            yield
        finally:
            renewal.stop()

    def _with_agents(self, cluster: Cluster, nodes: Sequence[Node]) -> Cluster:
        """cluster with the agent's environment made (or found) on nodes: each one's python is the agent's, its
        node_python cluster.slurm.python; what it took goes into the record's bootstrap."""
        owner = cluster.owner["agent"]
        runners = [self.runner(cluster, node) for node in nodes]
        roots = [owner["agent_dir"].replace(NODE_PLACEHOLDER, cluster.owner["hosts"][node.name]) for node in nodes]
        envs = agent.ensure_agents(runners, owner["python"], roots, _login(cluster), owner["bundle_dir"])
        made = {node.name: replace(node, python=env.python, node_python=owner["python"])
                for node, env in zip(nodes, envs, strict=True)}
        reports = {node.name: {"agent_python": env.python, "agent_installed": env.installed,
                               "agent_seconds": env.seconds, "agent_install_seconds": env.install_seconds,
                               "agent_bytes": env.bytes, "agent_copied_bytes": env.copied_bytes,
                               "python": env.node_python, "python_version": env.node_python_version}
                   for node, env in zip(nodes, envs, strict=True)}
        return replace(cluster, nodes=tuple(made.get(node.name, node) for node in cluster.nodes),
                       bootstrap={**cluster.bootstrap, **reports})

    # -- replacing a lost node --------------------------------------------------------------------------------------

    def replace_nodes(self, cluster: Cluster, lost: Sequence[str]) -> Cluster:
        """One lost node, the allocation holding on without it (--no-kill), is replaced alone: a one-node job with
        the allocation's own sbatch options (partition, account, QOS, reservation, constraint, GRES, walltime), the
        lost host excluded (and, where the site has a switch topology, every node not under the survivors' leaf
        switch: topology.py), and the same holder script; it is a second job of the cluster's name, on record in the
        owner state (node_jobs), so teardown and the sweeper find it with the first. The replacement keeps the lost
        node's name and rank; its host, address and workdir are the new node's. More than one node lost, the head
        lost (its batch script held the allocation), the allocation ended, no node free under the survivors' switch,
        or no node within the bound: ReplacementUnavailable, and the caller relaunches the whole cluster."""
        gone = lost_nodes(cluster, lost)
        if self.describe(cluster.name) is None:
            raise ReplacementUnavailable(f"{cluster.name}: its record is gone: the cluster was torn down")
        if len(gone) > 1 or gone[0].name == cluster.head.name:
            raise ReplacementUnavailable(f"{', '.join(node.name for node in gone)} lost: a Slurm allocation replaces "
                                         "one node other than its first (the holder's) alone")
        login, node = _login(cluster), gone[0]
        main = cli.job(login, cluster.owner["job_id"])
        if main is None or main.state != "RUNNING" or "sbatch" not in cluster.owner:
            raise ReplacementUnavailable(f"slurm job {cluster.owner['job_id']} of {cluster.name} no longer runs: "
                                         "nothing to add a node to")
        previous = cluster.owner.get("node_jobs", {}).get(node.name)
        if previous is not None:  # the lost node was itself a replacement: what is left of its job ends first
            self._cancel_and_wait(cluster.name, [previous], login)
        lost_host = cluster.owner["hosts"][node.name]
        survivors = [cluster.owner["hosts"][n.name] for n in cluster.nodes if n.name != node.name]
        leaves = topology.leaf_switches(login)
        partition = topology.partition_hosts(login, cluster.owner["partition"]) if leaves else []
        # Raises ReplacementUnavailable at once when the survivors' switch has no node to spare (the caller relaunches).
        switch, excluded = topology.replacement_excludes(leaves, partition, survivors, lost_host)
        options = [option for option in cluster.owner["sbatch"] if not option.startswith("--nodes=")]
        job_id = cli.submit(login, [*options, "--nodes=1", f"--exclude={','.join(excluded)}"],
                            self._script(cluster.name).read_text())
        log.info("slurm job %s submitted to replace %s (lost %s)%s", job_id, node.name, lost_host,
                 f" under switch {switch}" if switch else "")
        pending = replace(cluster, owner={**cluster.owner,
                                          "node_jobs": {**cluster.owner.get("node_jobs", {}), node.name: job_id}})
        self._write_record(pending)  # on record before it runs: teardown finds it whatever happens next
        try:
            state = self._wait_running(login, job_id, min(float(cluster.owner["queue_timeout_s"]), REPLACE_QUEUE_S))
            [host] = cli.hostnames(login, state.nodes)
            address = cli.node_addresses(login, [host]).get(host, host)
            workdir = cluster.owner["workdir_template"].replace(NODE_PLACEHOLDER, host)
            new = replace(node, address=address, cluster_address=address, workdir=workdir,
                          data_dir=f"{workdir}/data", ckpt_dir=f"{workdir}/ckpt")
            updated = replace(pending, nodes=tuple(new if n.name == node.name else n for n in cluster.nodes),
                              owner={**pending.owner, "hosts": {**cluster.owner["hosts"], node.name: host}})
            self._write_record(updated)
            self._wait_ready(updated, new, job_id)
            with self._lease_renewed(updated, new):
                updated = self._with_agents(updated, [new])
            self._write_record(updated)
        except BaseException as exc:
            with CANCEL.shield():
                self._cancel_and_wait(cluster.name, [job_id], login)
                self._write_record(replace(cluster, owner={**cluster.owner, "node_jobs": {
                    name: job for name, job in cluster.owner.get("node_jobs", {}).items() if name != node.name}}))
            if isinstance(exc, QueueTimeout | LaunchError) and not isinstance(exc, InvalidRequestError):
                raise ReplacementUnavailable(f"{node.name}: no node for its one-node allocation: {exc}") from exc
            raise
        log.info("%s replaced alone: slurm job %s on %s", node.name, job_id, host)
        return updated

    # -- state ------------------------------------------------------------------------------------------------------

    def _write_record(self, cluster: Cluster) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self._record(cluster.name)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(cluster.to_json())
        tmp.replace(path)

    def check_site(self, spec: ClusterSpec) -> None:
        """The site (sinfo) must hold spec.nodes nodes as spec.slurm asks: SiteMismatch names the partition and what
        it has."""
        site.check_site(spec.slurm, spec.nodes)

    def describe(self, cluster_name: str) -> Cluster | None:
        path = self._record(cluster_name)
        return Cluster.from_json(path.read_text()) if path.is_file() else None

    def _site_jobs(self, login: Login) -> list[cli.JobState]:
        """trainpipe's live jobs as squeue shows them. Every `trainpipe status`, `down` and sweep asks every provider:
        where the login node has no Slurm (no squeue, no configuration, or no controller to ask) and no record of a
        slurm cluster names it, there is nothing of ours to find."""
        recorded = login in {_login(cluster) for cluster in self._records()}
        if not cli.configured(login) and not recorded:
            return []
        try:
            return cli.jobs_named(login, JOB_PREFIX)
        except LaunchError as exc:
            if recorded:
                raise
            log.debug("no Slurm to ask on %s (%s): no slurm clusters there", login.label, exc)
            return []

    def _records(self) -> list[Cluster]:
        paths = sorted(self.root.glob("*.json")) if self.root.is_dir() else []
        return [Cluster.from_json(path.read_text()) for path in paths]

    def _jobs(self, cluster_name: str, login: Login) -> list[str]:
        """The cluster's live jobs: squeue's by name (a launch from anywhere), and the record's."""
        found = [state.job_id for state in self._site_jobs(login) if state.name == job_name(cluster_name)]
        recorded = self.describe(cluster_name)
        for job_id in _job_ids(recorded) if recorded is not None else []:
            state = cli.job(login, job_id)
            if state is not None and state.state in cli.LIVE_STATES:
                found.append(state.job_id)
        return sorted(set(found))

    def terminate(self, cluster_name: str) -> bool:
        """The nodes' workdirs removed (by a last step on each, while the allocation still runs), then the job."""
        return self._terminate(cluster_name, keep_data=False)

    def terminate_keeping_data(self, cluster_name: str) -> bool:
        """The job ends, the nodes' workdirs stay: a relaunch that gets the same nodes finds its staged data there."""
        return self._terminate(cluster_name, keep_data=True)

    def _terminate(self, cluster_name: str, keep_data: bool) -> bool:
        recorded = self.describe(cluster_name)
        login = _login(recorded) if recorded is not None else Login()
        jobs = self._jobs(cluster_name, login)
        if not keep_data and recorded is not None and set(_job_ids(recorded)) & set(jobs):
            self._remove_workdirs(recorded)
        had_record = recorded is not None
        self._end(cluster_name, jobs, login)
        if jobs:
            log.info("slurm cluster %s: job %s cancelled and gone", cluster_name, ", ".join(jobs))
        return bool(jobs) or had_record

    def _remove_workdirs(self, cluster: Cluster) -> None:
        """Node-local scratch is gone for good once the allocation ends (no step can reach it): removed first. What a
        node cannot remove is logged; the job is cancelled all the same."""
        def remove(node: Node) -> None:
            self.runner(cluster, node).run(["rm", "-rf", "--", node.workdir], timeout=REMOVE_TIMEOUT_S)

        if not cluster.nodes:
            return
        with ThreadPoolExecutor(max_workers=min(16, len(cluster.nodes)), thread_name_prefix="slurm-node") as pool:
            removals = [(node, pool.submit(remove, node)) for node in cluster.nodes]
        for node, removal in removals:
            if (error := removal.exception()) is not None:
                log.warning("%s: its workdir %s was not removed: %s", node.name, node.workdir, error)

    def _end(self, cluster_name: str, jobs: list[str], login: Login) -> None:
        """scancel, then wait until squeue no longer shows any of the jobs; the record goes last."""
        self._cancel_and_wait(cluster_name, jobs, login)
        self._record(cluster_name).unlink(missing_ok=True)
        self._script(cluster_name).unlink(missing_ok=True)

    def _cancel_and_wait(self, cluster_name: str, jobs: list[str], login: Login) -> None:
        cli.cancel(login, jobs)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while left := [job for job in jobs
                       if (state := cli.job(login, job)) is not None and state.state in cli.LIVE_STATES]:
            if time.monotonic() > deadline:
                raise cli.SlurmError(f"slurm job {', '.join(left)} of cluster {cluster_name} still shown by squeue "
                                     f"{GONE_TIMEOUT_S:g}s after scancel: ask the site's admins (scontrol show job)")
            time.sleep(POLL_S)  # teardown: a cancel must not cut this wait short

    def list_clusters(self) -> list[ClusterRecord]:
        records = {}
        recorded = self._records()
        # This machine's Slurm, and every login node a recorded cluster was launched through.
        logins = dict.fromkeys([Login(), *(_login(cluster) for cluster in recorded)])
        for state in (state for login in logins for state in self._site_jobs(login)):
            name = state.name[len(JOB_PREFIX):]
            owner = _owner_of(state.comment)
            # A replaced node's one-node job has the cluster's name: its node counts with the allocation's.
            counted = records[name].nodes if name in records else 0
            records[name] = ClusterRecord(name=name, provider=self.name, run_id=_field(state.comment, "run") or "-",
                                          created_at=_epoch(state.submitted), nodes=counted + state.node_count,
                                          owner_alive=launcher_alive(owner, elsewhere=True), processes=0)
        # A record whose job is gone (a teardown that died half way) is listed too, so the sweeper removes it.
        for cluster in recorded:
            if cluster.name not in records:
                records[cluster.name] = ClusterRecord(
                    name=cluster.name, provider=self.name, run_id=cluster.run_id, created_at=cluster.created_at,
                    nodes=0, owner_alive=launcher_alive(cluster.owner, elsewhere=True), processes=0)
        return list(records.values())

    # -- running ----------------------------------------------------------------------------------------------------

    def runner(self, cluster: Cluster, node: Node) -> Runner:
        return SlurmRunner(node.name, _job_of(cluster, node), cluster.owner["hosts"][node.name], node.workdir,
                           {CLUSTER_TAG: node.workdir, NODE_TAG: node.name}, _login(cluster))

    def preemption_notices(self, cluster: Cluster) -> list[PreemptionNotice]:
        """The holder writes the same notice on every node of its allocation (which ends as a whole): the head's is
        read, and relayed to the replacements, whose one-node jobs the holder's steps cannot reach."""
        if not cluster.nodes:
            return []
        try:
            notice = parse_notice(self.runner(cluster, cluster.head).read_text(cluster.head.path(NOTICE_FILE)))
        except RemoteError as exc:
            log.warning("%s: cannot read its preemption notice: %s", cluster.head.name, exc)
            return []
        if notice is None:
            return []
        self._relay(cluster, notice)
        return [PreemptionNotice(node=node.name, deadline=notice.deadline, reason=notice.reason)
                for node in cluster.nodes]

    def _relay(self, cluster: Cluster, notice: Notice) -> None:
        """The allocation's notice into every replacement's workdir, once: its watcher then stops its ranks (a
        SIGTERM for the emergency save) as the allocation's nodes' watchers stop theirs."""
        for name in cluster.owner.get("node_jobs", {}):
            node = next((n for n in cluster.nodes if n.name == name), None)
            if node is None or (cluster.name, name, notice.deadline) in self._relayed:
                continue
            try:
                self.runner(cluster, node).write_text(node.path(NOTICE_FILE), notice.to_json())
            except RemoteError as exc:
                log.warning("%s: the allocation's preemption notice could not be relayed to it (asked again at the "
                            "next poll): %s", name, exc)
                continue
            self._relayed.add((cluster.name, name, notice.deadline))
            log.warning("%s: the allocation's preemption notice relayed to it (%s)", name, notice.reason)

    def nodes_alive(self, cluster: Cluster) -> dict[str, bool]:
        """A node is alive while its job (the allocation's, or a replacement's) runs on it and Slurm does not hold
        the node down (with --no-kill the allocation outlives a failed node); when slurmctld does not answer, what
        runs is unknown: alive."""
        login, hosts = _login(cluster), cluster.owner.get("hosts", {})
        jobs = {node.name: _job_of(cluster, node) for node in cluster.nodes}
        try:
            states = {job_id: cli.job(login, job_id) for job_id in sorted(set(jobs.values()))}
            running = {job_id: set(cli.hostnames(login, state.nodes)) if state is not None and state.state == "RUNNING"
                       else set() for job_id, state in states.items()}
            held = sorted({host for job_hosts in running.values() for host in job_hosts})
            down = {host for host, state in cli.node_states(login, held).items()
                    if DOWN_STATES & set(state.split("+"))}
        except cli.SlurmUnreachable as exc:
            log.warning("cluster %s: cannot ask slurmctld about its jobs: %s", cluster.name, exc)
            return {node.name: True for node in cluster.nodes}
        return {node.name: hosts.get(node.name) in running[jobs[node.name]] - down for node in cluster.nodes}


def sbatch_options(cluster_name: str, run_id: str, spec: ClusterSpec) -> list[str]:
    """What trainpipe asks sbatch for (config.OWNED_OPTIONS), then the section's extra options."""
    config: SlurmClusterSpec = spec.slurm
    options = [f"--job-name={job_name(cluster_name)}", f"--comment=trainpipe run={run_id} launcher={launcher_stamp()}",
               f"--nodes={spec.nodes}", "--ntasks-per-node=1", f"--signal=B:USR1@{config.signal_lead_s}",
               "--no-requeue", "--no-kill", f"--time={config.time_limit}", "--output=/dev/null",
               "--export=PATH,HOME,USER"]
    for flag, value in (("--partition", config.partition), ("--account", config.account), ("--qos", config.qos),
                        ("--reservation", config.reservation), ("--constraint", config.constraint)):
        if value:
            options.append(f"{flag}={value}")
    if config.gpus_per_node:
        options.append(f"--gres=gpu:{config.gpus_per_node}")
    if config.exclusive:
        options.append("--exclusive")
    return [*options, *config.sbatch_options]


def _job_of(cluster: Cluster, node: Node) -> str:
    """The job that holds the node: the allocation's, or a replacement's one-node job."""
    return str(cluster.owner.get("node_jobs", {}).get(node.name, cluster.owner["job_id"]))


def _job_ids(cluster: Cluster) -> list[str]:
    """Every job of the cluster on record: the allocation's and its replacements'."""
    return [cluster.owner["job_id"], *cluster.owner.get("node_jobs", {}).values()]


def _login(cluster: Cluster) -> Login:
    """The login node the cluster was launched through (this machine for a record without one)."""
    return Login.from_dict(cluster.owner.get("login"))


def _field(comment: str, key: str) -> str | None:
    for part in comment.split():
        name, _, value = part.partition("=")
        if name == key:
            return value
    return None


def _owner_of(comment: str) -> dict[str, object]:
    """launcher_stamp's user@host:pid:start back into the launcher record launcher_alive reads."""
    stamp = _field(comment, "launcher") or ""
    try:
        _, _, rest = stamp.partition("@")
        host, pid, created = rest.rsplit(":", 2)
        return {"host": host, "pid": int(pid), "create_time": float(created)}
    except ValueError:
        return {}


def _epoch(submitted: str) -> float:
    try:
        return datetime.fromisoformat(submitted).timestamp()
    except ValueError:
        return 0.0
