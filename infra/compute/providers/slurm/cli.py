"""The Slurm commands the provider runs on the login node (this machine, or one over SSH: login.Login), their answers
parsed and failures typed.

Only the documented, stable outputs are read: `sbatch --parsable`, `squeue -h -o` with an explicit format,
`scontrol show hostnames` and the Key=Value lines of `scontrol show node -o`. A command that cannot reach slurmctld
is SlurmUnreachable (transient: the controller may be restarting); an sbatch refusal is typed by what it says, so
failover knows whether another try can help.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from infra.compute.providers.base import CapacityError, InvalidRequestError, LaunchError, QuotaError
from infra.compute.providers.slurm.login import Login, LoginUnreachable, Result

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 60.0
FIELD_SEP = "|"
# squeue's states of a job that still holds, or may yet hold, nodes (everything but the ended ones).
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
                         "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"})

# What sbatch says when the request can never run as written, and when a policy (quota) forbids it now.
_INVALID = ("invalid partition", "invalid account", "invalid qos", "invalid feature", "invalid generic resource",
            "requested node configuration is not available", "node count specification invalid",
            "requested reservation is invalid", "invalid reservation", "access denied", "invalid gres",
            "invalid time limit", "not available in partition", "invalid job credential")
_QUOTA = ("violates accounting/qos policy", "qosmax", "assocmax", "job limit", "would exceed")
UNREACHABLE = ("unable to contact slurm controller", "socket timed out", "connection refused",
               "slurm_load_jobs error: unable to contact", "zero bytes were transmitted")


class SlurmError(LaunchError):
    """A Slurm command failed; the message names it and what it said."""


class SlurmUnreachable(SlurmError):
    """slurmctld did not answer: it may be restarting."""

    transient = True


@dataclass(frozen=True)
class JobState:
    job_id: str
    name: str
    state: str  # PENDING, RUNNING, ... (squeue %T)
    reason: str  # why pending (squeue %r): Resources, Priority, ReqNodeNotAvail, ...; None when running
    nodes: str  # the node list, compressed (gpu[1-3]); empty while pending
    node_count: int
    comment: str
    submitted: str  # squeue %V, the submit time (ISO, local time)
    partition: str


def slurm_env() -> dict[str, str]:
    """This process's environment for a Slurm command, without the SLURM_* job variables a shell inside an
    allocation carries (they would make srun and sbatch act on that job): SLURM_CONF stays."""
    return {name: value for name, value in os.environ.items()
            if not name.startswith("SLURM_") or name == "SLURM_CONF"}


# Where Slurm's commands find the site's configuration when SLURM_CONF does not say: the default path, and the copy
# a configless site's slurmd or sackd keeps.
CONFIG_PATHS = ("/etc/slurm/slurm.conf", "/run/slurm/conf/slurm.conf")


def configured(login: Login) -> bool:
    """Whether the Slurm commands have a configuration to read. Without one, each retries for a minute before it
    fails: callers that only look (status, the sweeper) ask this first. A login node over SSH is the site's own: its
    configuration is taken as there (a command that cannot reach slurmctld says so)."""
    if login.remote:
        return True
    if shutil.which("squeue") is None:
        return False
    named = os.environ.get("SLURM_CONF")
    return os.path.isfile(named) if named else any(os.path.isfile(path) for path in CONFIG_PATHS)


def run(login: Login, argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S, check: bool = True,
        stdin: str | None = None) -> Result:
    """A Slurm command on the login node, its stdout and stderr apart; SlurmUnreachable / SlurmError when it fails
    and check is set."""
    try:
        done = login.run(argv, timeout=timeout, env=slurm_env(), stdin=stdin)
    except FileNotFoundError:
        raise InvalidRequestError(f"{argv[0]} is not installed on {login.label}: provider slurm runs its commands on "
                                  "a login node of the site (with the Slurm client commands on PATH)") from None
    except TimeoutError:
        raise SlurmUnreachable(f"{' '.join(argv[:2])} did not answer within {timeout:.0f}s on {login.label}: is "
                               "slurmctld overloaded or down?") from None
    except LoginUnreachable as exc:
        raise SlurmUnreachable(f"{argv[0]}: {exc}") from None
    if check and done.returncode != 0:
        raise error_of(argv, done.stderr.strip() or done.stdout.strip())
    return done


def error_of(argv: Sequence[str], said: str) -> SlurmError | LaunchError:
    what = f"{argv[0]}: {said or '(no output)'}"
    lowered = said.lower()
    if any(text in lowered for text in UNREACHABLE):
        return SlurmUnreachable(what)
    if argv[0] == "sbatch":
        if any(text in lowered for text in _INVALID):
            return InvalidRequestError(f"{what}: fix cluster.slurm (partition, account, qos, reservation, "
                                       "constraint, gpus_per_node, time_limit) or cluster.nodes")
        if any(text in lowered for text in _QUOTA):
            return QuotaError(f"{what}: ask the site for a larger limit or ask for fewer nodes or less time")
        if "resources" in lowered or "busy" in lowered:
            return CapacityError(what)
    return SlurmError(what)


def submit(login: Login, options: Sequence[str], script: str) -> str:
    """sbatch the script (its text, on sbatch's stdin: a login node over SSH has no copy of a local file) with these
    options; the job id."""
    done = run(login, ["sbatch", "--parsable", *options], stdin=script)
    ids = [line.split(";")[0] for line in done.stdout.splitlines() if re.fullmatch(r"\d+(;\S+)?", line.strip())]
    if not ids:
        raise SlurmError(f"sbatch answered no job id: {done.stdout.strip()} {done.stderr.strip()}")
    return ids[-1].strip()


_FORMAT = FIELD_SEP.join(("%i", "%j", "%T", "%r", "%N", "%D", "%k", "%V", "%P"))


def _parse(out: str) -> list[JobState]:
    jobs = []
    for line in out.splitlines():
        fields = line.split(FIELD_SEP)
        if len(fields) != 9:
            continue
        job_id, name, state, reason, nodes, count, comment, submitted, partition = fields
        jobs.append(JobState(job_id=job_id, name=name, state=state, reason=reason, nodes=nodes,
                             node_count=int(count) if count.isdigit() else 0, comment=comment,
                             submitted=submitted, partition=partition))
    return jobs


def job(login: Login, job_id: str) -> JobState | None:
    """The job as squeue shows it, or None once it has ended (squeue forgets it MinJobAge after the end)."""
    done = run(login, ["squeue", "-h", "-j", job_id, "-o", _FORMAT], check=False)
    if done.returncode != 0:
        if "invalid job id" in done.stderr.lower():
            return None
        raise error_of(["squeue"], done.stderr.strip())
    found = [state for state in _parse(done.stdout) if state.job_id == job_id]
    return found[0] if found else None


def jobs_named(login: Login, prefix: str) -> list[JobState]:
    """This user's jobs whose name starts with prefix, in every live state."""
    done = run(login, ["squeue", "-h", "--me", "-o", _FORMAT])
    return [state for state in _parse(done.stdout) if state.name.startswith(prefix) and state.state in LIVE_STATES]


def cancel(login: Login, job_ids: Sequence[str]) -> None:
    if job_ids:
        run(login, ["scancel", *job_ids])


def step_id(login: Login, job_id: str, step_name: str) -> str | None:
    """The id (JOB.STEP) of the job's running step of that name, None when none runs."""
    done = run(login, ["squeue", "-h", "-s", "-j", job_id, "-o", f"%i{FIELD_SEP}%j"], check=False)
    for line in done.stdout.splitlines():
        step, _, name = line.strip().partition(FIELD_SEP)
        if name == step_name:
            return step
    return None


def signal_step(login: Login, step: str, signal_name: str) -> None:
    """Signal a step's tasks (not the step's srun, not the job's batch script)."""
    run(login, ["scancel", f"--signal={signal_name}", step])


def hostnames(login: Login, node_list: str) -> list[str]:
    """A compressed node list (gpu[1-3]) expanded, in Slurm's order."""
    done = run(login, ["scontrol", "show", "hostnames", node_list])
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def _show_nodes(login: Login, names: Sequence[str]) -> dict[str, dict[str, str]]:
    """Each node's Key=Value fields from `scontrol show node -o`."""
    if not names:
        return {}
    done = run(login, ["scontrol", "show", "node", "-o", ",".join(names)])
    shown = {}
    for line in done.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" in fields:
            shown[fields["NodeName"]] = fields
    return shown


def node_addresses(login: Login, names: Sequence[str]) -> dict[str, str]:
    """Each node's NodeAddr: where the other nodes reach it (the cluster address)."""
    return {name: fields.get("NodeAddr") or name for name, fields in _show_nodes(login, names).items()}


def node_states(login: Login, names: Sequence[str]) -> dict[str, str]:
    """Each node's State, its flags joined by '+' (ALLOCATED, MIXED+DRAIN, DOWN+NOT_RESPONDING, ...)."""
    return {name: fields.get("State", "") for name, fields in _show_nodes(login, names).items()}
