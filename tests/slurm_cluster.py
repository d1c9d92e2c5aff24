"""A real Slurm for tests: munged, slurmctld and three slurmd (gpu1..gpu3) on this one host, from Debian's packages.

Nothing is mocked: the provider talks to slurmctld through the same sbatch, srun, squeue, scontrol and scancel a
login node has. Each cluster writes its own slurm.conf (ports picked free at start, its own munge key and socket,
its own state, spool and log dirs) in a fresh dir, so it never touches /etc/slurm or a Slurm the machine may run.
Every node has NodeAddr=127.0.0.1 and its own Port; SlurmdSpoolDir and the pid and log files carry %n so the three
slurmd do not share them. Two partitions cover one set of nodes: `batch` (the default) and `urgent`, a higher
priority tier that preempts batch jobs (preempt/partition_prio, REQUEUE, a GraceTime, and, unless the Site says
otherwise, the job's --signal sent when preemption starts: preempt_send_user_signal). Each node has the features
ib,nvme and two GRES gpus whose device files are links to /dev/null (slurmd only checks that they are character
devices; nothing opens them).

A site with accounting (accounting=True) adds what a site that checks accounts runs: MariaDB (a fresh datadir made
by mariadb-install-db, its own port and socket), slurmdbd on its own DbdPort storing into it, and a slurmctld with
AccountingStorageType=accounting_storage/slurmdbd and AccountingStorageEnforce=associations. They start in the order
a site needs: MariaDB answering, slurmdbd answering sacctmgr, the cluster, the account `lab` and this user's
association in it registered, then slurmctld (which loads the associations it enforces from slurmdbd) and the nodes.

The daemons run as root in the foreground of their own sessions, started and stopped by their pids. Under CI=true a
Slurm that cannot start fails the test; elsewhere it skips with the reason (conftest.cannot_run_here).
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import cannot_run_here

DAEMONS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd"}  # program: Debian package
CLIENTS = ("sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
# What a site with accounting adds (program: Debian package); sacctmgr comes with slurm-client.
ACCOUNTING = {"slurmdbd": "slurmdbd", "mariadbd": "mariadb-server-core", "mariadb-install-db": "mariadb-server-core",
              "mariadb": "mariadb-client-core", "my_print_defaults": "mariadb-client-core", "sacctmgr": "slurm-client"}
CLUSTER_NAME = "trainpipe-test"
ACCOUNT = "lab"  # the one account a site with accounting registers, with this user's association in it
NODES = ("gpu1", "gpu2", "gpu3")
FEATURES = "ib,nvme"
GPUS_PER_NODE = 2
CPUS_PER_NODE = 2
PARTITION = "batch"
URGENT = "urgent"
GRACE_TIME_S = 10  # what a preempted batch job gets between the preemption's start and its SIGTERM
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
POLL_S = 0.2
COMMAND_TIMEOUT_S = 30.0
# The nodes' Python: Debian's, with neither trainpipe nor torch; the node agent runs from an environment made from it.
NODE_PYTHON = "/usr/bin/python3"
# The nodes' agent environments, kept by content across sessions as a site's nodes keep them on their disks: the first
# launch after a change of trainpipe's source makes them, the next finds them ready.
AGENT_DIR = Path(tempfile.gettempdir()) / "trainpipe-test-slurm-agent"


def agent_settings(python: str = NODE_PYTHON) -> dict[str, str]:
    """cluster.slurm's agent settings for the test sites: one node-local dir for every node (they share this host)
    and the bundle dir beside it (the login node and the nodes are this host)."""
    return {"python": python, "agent_dir": str(AGENT_DIR), "agent_bundle_dir": str(AGENT_DIR / "bundles")}


def require_slurm(accounting: bool = False) -> None:
    """Skip (fail in CI) when a test Slurm (with accounting: its slurmdbd and MariaDB too) cannot run here."""
    for program, package in {**DAEMONS, **(ACCOUNTING if accounting else {})}.items():
        if shutil.which(program, path=f"/usr/sbin:{os.environ.get('PATH', '')}") is None:
            cannot_run_here(f"{program} is missing: install {package} (scripts/install-system-packages)")
    for program in CLIENTS:
        if shutil.which(program) is None:
            cannot_run_here(f"{program} is missing: install slurm-client (scripts/install-system-packages)")
    if os.geteuid() != 0:
        cannot_run_here("a test Slurm runs slurmd, which starts job steps as their user: that needs root")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Site:
    """What one test Slurm's configuration differs in from another's."""

    nodes: tuple[str, ...] = NODES  # the node names, each with the same features and GPUs
    topology: str | None = None  # a topology.conf's text: a switch tree (TopologyPlugin=topology/tree)
    accounting: bool = False  # slurmdbd enforcing associations, the account ACCOUNT registered for this user
    # preempt_send_user_signal: a preempted job gets its --signal when the preemption starts; without it, as on many
    # sites, the job only gets SIGTERM when GraceTime ends (then SIGKILL after KillWait).
    early_signal: bool = True
    # Slurm's own OCI containers (oci.conf beside slurm.conf, runc run by slurmstepd): `srun --container <bundle>`
    # runs the step's task in that OCI bundle. Without it slurmstepd ignores --container.
    oci: bool = False


@dataclass
class SlurmCluster:
    root: Path
    ports: dict[str, int]  # slurmctld and each node; with accounting slurmdbd and mariadbd too
    site: Site = Site()
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    started_in_s: float = 0.0  # from the first daemon's start to every node idle

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment every Slurm command of this cluster needs (SLURM_CONF names its configuration)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip() or done.stdout}")
        return done

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %T", check=False).stdout
        return dict(line.split(maxsplit=1) for line in out.splitlines() if line.strip())

    def sql(self, statement: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A statement run by MariaDB's client as root, over TCP to this site's server (the way slurmdbd connects)."""
        return self.run("mariadb", "--no-defaults", "--protocol=tcp", "-h", "127.0.0.1", "-P",
                        str(self.ports["mariadbd"]), "-u", "root", "-e", statement, check=check)

    def job_ids(self) -> list[str]:
        """Every job slurmctld still shows (pending, running, completing)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def logs(self, lines: int = 30) -> str:
        """The last lines of every daemon's log, for a failure's message."""
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(f"== {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    # -- starting and stopping --------------------------------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        self._daemon("munged", ["munged", "-F", f"--key-file={self.root / 'munge' / 'munge.key'}",
                                f"--socket={self._munge_socket}", f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                                f"--log-file={self.root / 'log' / 'munged.log'}"])
        self._wait(lambda: self._munge_socket.exists(), "munged's socket")
        if self.site.accounting:
            self._start_accounting()
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, "slurmctld to answer")
        for node in self.site.nodes:
            self._daemon(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait(lambda: sorted(self.node_states().items()) == [(node, "idle") for node in sorted(self.site.nodes)],
                   "every node idle")
        self.started_in_s = time.monotonic() - started

    def _start_accounting(self) -> None:
        """MariaDB, then slurmdbd (it creates its tables on its first connection), then what slurmctld enforces: the
        cluster, the account and this user's association, registered before slurmctld loads them."""
        self._daemon("mariadbd", ["mariadbd", "--no-defaults", f"--datadir={self.root / 'db'}", "--user=root",
                                  f"--port={self.ports['mariadbd']}", "--bind-address=127.0.0.1", "--skip-name-resolve",
                                  f"--socket={self.root / 'run' / 'mariadbd.sock'}",
                                  f"--pid-file={self.root / 'run' / 'mariadbd.pid'}",
                                  f"--log-error={self.root / 'log' / 'mariadbd.log'}",
                                  "--innodb-buffer-pool-size=16M"])
        self._wait(lambda: self.sql("SELECT 1", check=False).returncode == 0, "MariaDB to answer")
        # slurmdbd reads the slurmdbd.conf beside SLURM_CONF's slurm.conf.
        self._daemon("slurmdbd", ["slurmdbd", "-D"])
        self._wait(lambda: self.run("sacctmgr", "-n", "show", "cluster", check=False).returncode == 0,
                   "slurmdbd to answer sacctmgr")
        self.run("sacctmgr", "-i", "add", "cluster", CLUSTER_NAME)
        self.run("sacctmgr", "-i", "add", "account", ACCOUNT, f"cluster={CLUSTER_NAME}")
        self.run("sacctmgr", "-i", "add", "user", getpass.getuser(), f"account={ACCOUNT}", f"cluster={CLUSTER_NAME}")

    def cancel_all(self, what: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """scancel every job slurmctld shows, and wait until squeue shows none."""
        jobs = self.job_ids()
        if jobs:
            self.run("scancel", *jobs, check=False)
            self._wait(lambda: not self.job_ids(), what, timeout_s)

    @contextmanager
    def for_test(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmCluster]:
        """This cluster as a test's Slurm (SLURM_CONF); every job the test leaves is cancelled after it."""
        monkeypatch.setenv("SLURM_CONF", str(self.conf))
        yield self
        self.cancel_all("the test's jobs gone", START_TIMEOUT_S)

    @contextmanager
    def controller_paused(self) -> Iterator[None]:
        """slurmctld stopped (SIGSTOP) for the block, as a controller that hangs (a restart, a reconfigure, a
        failover) while the jobs' steps run on; continued (SIGCONT) however the block ends: a controller left stopped
        would fail every later test of this site."""
        controller = self.processes["slurmctld"]
        os.kill(controller.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(controller.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Every job cancelled (and gone from squeue), then the daemons: slurmd, slurmctld, munged."""
        try:
            if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
                self.cancel_all("every job gone at teardown")
        finally:
            for name in [*self.site.nodes, "slurmctld", "slurmdbd", "mariadbd", "munged"]:
                process = self.processes.pop(name, None)
                if process is not None:
                    _stop(process)

    @property
    def _munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def _daemon(self, name: str, argv: list[str]) -> None:
        program = shutil.which(argv[0], path=f"/usr/sbin:{os.environ.get('PATH', '')}")
        with (self.root / "log" / f"{name}.out").open("ab") as out:
            self.processes[name] = subprocess.Popen([program or argv[0], *argv[1:]], env=self.env, stdout=out,
                                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    start_new_session=True)

    def _wait(self, done: object, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():  # type: ignore[operator]
            for name, process in self.processes.items():
                if process.poll() is not None:
                    out = (self.root / "log" / f"{name}.out").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"test Slurm: {name} exited {process.returncode} while waiting for {what}:\n"
                                       f"{out}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"test Slurm: no {what} within {timeout_s:.0f}s:\n{self.logs()}")
            time.sleep(POLL_S)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT_S)


def slurm_conf(root: Path, ports: dict[str, int], munge_socket: Path, site: Site) -> str:
    """With site.accounting the jobs' accounts go to slurmdbd (ports['slurmdbd']), which enforces the users'
    associations."""
    node_names = site.nodes
    nodes = "\n".join(
        f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname=localhost Port={ports[node]} CPUs={CPUS_PER_NODE} "
        f"RealMemory=1000 Gres=gpu:{GPUS_PER_NODE} Feature={FEATURES} State=UNKNOWN" for node in node_names)
    node_list = ",".join(node_names)
    storage = (f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
               f"AccountingStoragePort={ports['slurmdbd']}\nAccountingStorageEnforce=associations\n"
               # For slurmdbd AccountingStoragePass names the munge socket its connections authenticate with.
               f"AccountingStoragePass={munge_socket}"
               if site.accounting else "AccountingStorageType=accounting_storage/none")
    return f"""\
ClusterName={CLUSTER_NAME}
SlurmctldHost=localhost
SlurmctldPort={ports['slurmctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}/%n
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'run'}/slurmd-%n.pid
SlurmctldLogFile={root / 'log'}/slurmctld.log
SlurmdLogFile={root / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
{storage}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The configured CPUs and memory, not what this machine has: the nodes share it.
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
KillWait=5
MinJobAge=5
InactiveLimit=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{'SlurmctldParameters=preempt_send_user_signal' if site.early_signal else ''}
{'TopologyPlugin=topology/tree' if site.topology is not None else ''}
{nodes}
PartitionName={PARTITION} Nodes={node_list} Default=YES PriorityTier=1 GraceTime={GRACE_TIME_S} State=UP
PartitionName={URGENT} Nodes={node_list} PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP
"""


def slurmdbd_conf(root: Path, ports: dict[str, int], munge_socket: Path) -> str:
    """slurmdbd storing into this site's MariaDB as its root (passwordless over TCP: mariadb-install-db's
    normal root authentication)."""
    return f"""\
AuthType=auth/munge
AuthInfo=socket={munge_socket}
DbdHost=localhost
DbdPort={ports['slurmdbd']}
SlurmUser=root
PidFile={root / 'run' / 'slurmdbd.pid'}
LogFile={root / 'log' / 'slurmdbd.log'}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports['mariadbd']}
StorageUser=root
StorageLoc=slurm_acct_db
"""


def oci_conf(root: Path) -> str:
    """runc run by slurmstepd as the job's user (root here, so not rootless), its state under the site's own dir.
    RunTimeRun (not create/start): slurmstepd execs it as the task, so the step's signals reach runc, which passes
    them to the container's first process, and the step ends when the container does. A container's id carries the
    node, job, step and task: the test nodes share one host and one runc state dir."""
    runc = f"runc --root={root / 'runc'}"
    container = "%n.%u.%j.%s.%t"
    return f"""\
RunTimeQuery="{runc} state {container}"
RunTimeKill="{runc} kill -a {container}"
RunTimeDelete="{runc} delete --force {container}"
RunTimeRun="{runc} run {container} -b %b"
"""


def gres_conf(root: Path, node_names: tuple[str, ...]) -> str:
    lines = []
    for node in node_names:
        for index in range(GPUS_PER_NODE):
            device = root / "dev" / f"{node}-gpu{index}"
            device.symlink_to("/dev/null")
        lines.append(f"NodeName={node} Name=gpu File={root / 'dev'}/{node}-gpu[0-{GPUS_PER_NODE - 1}]")
    return "\n".join(lines) + "\n"


def _prepare(root: Path, site: Site) -> dict[str, int]:
    node_names = site.nodes
    for sub in ("munge", "state", "spool", "log", "run", "dev", "runc"):
        (root / sub).mkdir()
    # munged wants its socket's dir (and every dir above it) searchable by all, and its key readable by itself only.
    for directory in (root, root / "munge"):
        directory.chmod(0o755)
    subprocess.run(["mungekey", "-c", "-k", str(root / "munge" / "munge.key")], check=True, capture_output=True)
    ports = {"slurmctld": free_port(), **{node: free_port() for node in node_names}}
    munge_socket = root / "munge" / "munge.socket"
    if site.accounting:
        ports.update(slurmdbd=free_port(), mariadbd=free_port())
        dbd_conf = root / "slurmdbd.conf"
        dbd_conf.touch(mode=0o600)  # slurmdbd refuses a configuration others can read (it may hold a password)
        dbd_conf.write_text(slurmdbd_conf(root, ports, munge_socket))
        made = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={root / 'db'}", "--user=root",
                               "--auth-root-authentication-method=normal", "--skip-test-db"],
                              capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if made.returncode != 0:
            raise RuntimeError(f"test Slurm: mariadb-install-db exited {made.returncode}: {made.stdout}{made.stderr}")
    (root / "slurm.conf").write_text(slurm_conf(root, ports, munge_socket, site))
    if site.topology is not None:  # topology.conf beside slurm.conf, where slurmctld looks for it
        (root / "topology.conf").write_text(site.topology)
    (root / "gres.conf").write_text(gres_conf(root, node_names))
    if site.oci:  # slurmstepd reads oci.conf from the dir of the slurm.conf it was started with
        (root / "oci.conf").write_text(oci_conf(root))
    return ports


@contextmanager
def slurm_cluster(site: Site = Site(), attempts: int = 3) -> Iterator[SlurmCluster]:
    """A running test Slurm configured as site says; stopped (every job cancelled first) and its dir removed
    afterwards. A start that fails (a port taken between probe and bind) is retried with new ports."""
    require_slurm(site.accounting)
    for attempt in range(1, attempts + 1):
        # Not under pytest's tmp dir: munged refuses a socket below a dir others cannot search (pytest's is 0700), and
        # unix socket paths are short.
        root = Path(tempfile.mkdtemp(prefix="tp-slurm-", dir="/tmp"))
        cluster = SlurmCluster(root=root, ports=_prepare(root, site), site=site)
        try:
            cluster.start()
        except RuntimeError:
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)
            if attempt == attempts:
                raise
            continue
        try:
            yield cluster
        finally:
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)
        return
