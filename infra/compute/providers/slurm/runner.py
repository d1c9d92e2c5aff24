"""A node of a Slurm allocation, reached through job steps: every command is `srun --overlap` in the job, on that
node, one task, so Slurm's accounting, limits and cleanup cover it and it ends with the allocation.

The command's environment never goes on a command line: it is in the srun process's own environment, which srun
hands to the task (--export=ALL). The node's tags (its cluster and node name, which the node's watcher and syncer find
the node's processes by) go to the task alone, named in --export: the srun client runs on the login node and is no
process of the node. Where the login node is a node's own machine (trainpipe on a compute node, or a test site on one
host), a watcher that took a tagged srun for the trainer would SIGTERM it, and srun answers SIGTERM by cancelling the
step (SIGKILL): the trainer would never make its last save. The step's output comes back through srun;
with a log_path it is also appended to that file on the node (the node's disk is not the login node's). Small files
are read and written by steps too: what a step prints is framed and base64-encoded, so srun's own messages cannot
be mistaken for a file's bytes.
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
from collections.abc import Mapping, Sequence

from infra.compute.access.remote import CommandTimedOut, LineSink, Process, RemoteError, Runner
from infra.compute.providers.slurm import cli
from infra.compute.providers.slurm.login import Login

log = logging.getLogger(__name__)

FILE_TIMEOUT_S = 60.0
# What srun says when no step can start in the job any more (it is ending, or gone).
_JOB_ENDING = ("already completing or completed", "invalid job id", "has expired", "does not exist")
BEGIN, END, MISSING = "@@trainpipe-file-begin@@", "@@trainpipe-file-end@@", "@@trainpipe-file-missing@@"
# The step's own wrapper: its output also appended to the log on the node, then the command exec'd (so srun's
# signals reach it and its exit status is the step's). Slurm signals every process of a step: the tee ignores SIGTERM
# and SIGINT, so a command that saves on SIGTERM keeps its output until it exits (its end closes the tee).
_STEP = ('log=$1; shift; if [ -n "$log" ]; then mkdir -p "$(dirname "$log")" && '
         'exec > >(trap "" TERM INT; exec tee -a "$log") 2>&1; fi; exec "$@"')
_READ = (f'if [ ! -e "$1" ]; then echo {MISSING}; exit 0; fi; echo {BEGIN}; tail -c +$(( $2 + 1 )) "$1" | base64 -w0; '
         f'echo; echo {END}')
_WRITE = ('mkdir -p "$(dirname "$1")" && printf "%s" "$TRAINPIPE_FILE_TEXT" > "$1.tmp.$$" && mv -f "$1.tmp.$$" "$1"')


_STEP_NUMBERS = itertools.count(1)


class SlurmStep(Process):
    """A job step, seen through its srun client on the login node. terminate() signals the step's task through
    slurmctld (scancel --signal=TERM JOB.STEP), as Slurm itself does at an allocation's end, so a trainer finishes
    its last save: srun answers a SIGTERM of its own by cancelling the step, which SIGKILLs the task moments later.
    What is still running after grace_s gets the client's own terminate (the step cancelled)."""

    def __init__(self, client: Process, login: Login, job_id: str, step_name: str) -> None:
        self._client, self._login, self._job_id, self.step_name = client, login, job_id, step_name

    def poll(self) -> int | None:
        return self._client.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._client.wait(timeout)

    def tail(self, lines: int = 20) -> str:
        return self._client.tail(lines)

    def terminate(self, grace_s: float = 10.0) -> int | None:
        if self.poll() is None:
            try:
                step_id = cli.step_id(self._login, self._job_id, self.step_name)
                if step_id is not None:
                    try:
                        cli.signal_step(self._login, step_id, "TERM")
                    except cli.SlurmError as exc:
                        # Slurm 22.05's scancel answers "Invalid job id" for a step on one node of a job of several
                        # once it signalled it (the other nodes have no such step): the signal went out.
                        if "invalid job id" not in str(exc).lower():
                            raise
                    return self.wait(grace_s)
            except TimeoutError:
                log.warning("slurm step %s still running %.0fs after SIGTERM: cancelling it", self.step_name, grace_s)
            except cli.SlurmError as exc:
                log.warning("slurm step %s: cannot signal it through slurmctld (%s): cancelling it", self.step_name,
                            exc)
        return self._client.terminate(grace_s)


class StepUnavailable(RemoteError, ConnectionError):
    """No job step can start on the node: its allocation is ending or gone (a preemption, the lease, a teardown). A
    ConnectionError, as an SSH node that stops answering is: whoever watches the nodes judges whether it is lost."""


class StepUnanswered(RemoteError, ConnectionError):
    """A file step that did not come back: srun could not reach slurmctld, which starts every step (a controller
    restarting, reconfigured, failing over), or the step did not end within its bound. A ConnectionError too: the
    node is unknown, not failed, and whoever watches the nodes judges it."""


def step_argv(job_id: str, host: str, workdir: str, argv: Sequence[str], log_path: str | None = None,
              tags: Mapping[str, str] | None = None, step_name: str = "trainpipe-step") -> list[str]:
    """srun of argv as one task on host in the job, overlapping the holder and the other steps; tags are set in the
    task's environment only (srun's --export takes no comma inside a value); step_name finds the step in squeue."""
    for name, value in (tags or {}).items():
        if "," in value or "=" in name:
            raise RemoteError(f"tag {name}={value}: srun --export cannot pass a value with a comma: use a scratch "
                              "path without commas")
    exported = ",".join(["ALL", *(f"{name}={value}" for name, value in (tags or {}).items())])
    return ["srun", "--overlap", f"--jobid={job_id}", f"--nodelist={host}", "--nodes=1", "--ntasks=1",
            f"--job-name={step_name}", f"--export={exported}", f"--chdir={workdir}", "--quiet", "bash", "-c", _STEP,
            "trainpipe-step", log_path or "", *argv]


class SlurmRunner(Runner):
    """One node of a running allocation (job_id), its Slurm name host; commands start on the login node (this
    machine, or one over SSH) as srun processes."""

    def __init__(self, node_name: str, job_id: str, host: str, workdir: str, tags: Mapping[str, str],
                 login: Login) -> None:
        self.node_name = node_name
        self.job_id = job_id
        self.host = host
        self.workdir = workdir
        self.tags = dict(tags)
        # srun itself runs on the login node (this machine or one over SSH): --chdir is where the task runs.
        self.login = login
        self._login = login.runner(node_name)

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, on_line: LineSink | None = None,
              log_path: str | None = None, cwd: str | None = None) -> Process:
        name = f"trainpipe-step-{os.getpid()}-{next(_STEP_NUMBERS)}"
        step = step_argv(self.job_id, self.host, cwd or self.workdir, argv, log_path, self.tags, name)
        return SlurmStep(self._login.start(step, env=env, on_line=on_line), self.login, self.job_id, name)

    def _file_step(self, script: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> str:
        try:
            result = self.run(["bash", "-c", script, "trainpipe-file", *args], env=env, timeout=FILE_TIMEOUT_S,
                              check=False)
        except CommandTimedOut as exc:  # srun still waiting at the bound, most often on slurmctld
            raise StepUnanswered(f"{exc} (slurm job {self.job_id}: is slurmctld answering?)") from None
        if result.returncode != 0 and any(said in result.output.lower() for said in _JOB_ENDING):
            raise StepUnavailable(f"{self.node_name}: no step can start in slurm job {self.job_id} any more: "
                                  f"{result.output.strip()[-300:]}")
        if result.returncode != 0 and any(said in result.output.lower() for said in cli.UNREACHABLE):
            raise StepUnanswered(f"{self.node_name}: srun could not reach slurmctld to start a file step in job "
                                 f"{self.job_id}: {result.output.strip()[-300:]}")
        if result.returncode != 0:
            raise RemoteError(f"{self.node_name}: file step '{args[0]}' exited {result.returncode}: "
                              f"{result.output.strip()[-300:] or '(no output)'}")
        return result.output

    def write_text(self, path: str, text: str) -> None:
        self._file_step(_WRITE, [path], env={"TRAINPIPE_FILE_TEXT": text})

    def read_text(self, path: str) -> str | None:
        data = self.read_from(path, 0)
        return None if data is None else data.decode()

    def read_from(self, path: str, offset: int) -> bytes | None:
        lines = [line.strip() for line in self._file_step(_READ, [path, str(offset)]).splitlines()]
        if MISSING in lines:
            return None
        if BEGIN not in lines or END not in lines:
            raise RemoteError(f"{self.node_name}: reading {path} printed no framed contents: {' '.join(lines)[-300:]}")
        body = lines[lines.index(BEGIN) + 1:lines.index(END)]
        return base64.b64decode("".join(body))

