"""`exec`: one command in the training environment (the job's setup, evaluate, verify's check of the environment).

The command runs under the launcher (infra/workload/launcher.py) in the environment trainenv.py enters; this
process stays its supervisor on the host: it hands the child SIGTERM and SIGINT, holds the write end of the child's
stdin (the lifeline: this process gone, the launcher stops what it started), removes a container's env file once the
container started, and removes the container at the end, whatever happened.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from infra.node.events import fail
from infra.node.protocol import LAUNCHER_STOP_GRACE_S, ExecRequest, NodeRequest, TrainingEnvironment, as_request
from infra.node.trainenv import Invocation, TrainEnvError, container_record, install_launcher, invocation
from infra.workload.launcher import GRACE_ENV, TIMEOUT_ENV

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 60.0  # `<engine> rm -f`
ENV_FILE_WAIT_S = 3600.0  # an image pulled as the container starts can take this long to be read
ENV_FILE_POLL_S = 0.2


def _remove_env_file_once_started(inv: Invocation, child: subprocess.Popen[bytes]) -> None:
    """The env file holds the secrets: it goes as soon as the engine has read it (the container exists)."""
    assert inv.env_file is not None and inv.engine is not None and inv.container is not None
    deadline = time.monotonic() + ENV_FILE_WAIT_S
    while child.poll() is None and time.monotonic() < deadline:
        found = subprocess.run([inv.engine, "container", "inspect", inv.container], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=inv.env, check=False)
        if found.returncode == 0:
            break
        time.sleep(ENV_FILE_POLL_S)
    inv.env_file.unlink(missing_ok=True)


def _cleanup(inv: Invocation, record: Path | None) -> None:
    if inv.env_file is not None:
        inv.env_file.unlink(missing_ok=True)
    for argv in inv.cleanup:
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=inv.env, timeout=CLEANUP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("cleanup %s failed: %s", " ".join(argv), exc)
            return  # the record stays: the node's watchdog removes the container on a lease expiry
    if record is not None:
        record.unlink(missing_ok=True)


def supervise(inv: Invocation, cwd: str | None = None, record: Path | None = None) -> int:
    """Run inv to its end as described above; its exit status (OSError: it could not start)."""
    try:
        # A session of its own: a signal to the agent's process group reaches the child once, through here.
        child = subprocess.Popen(inv.argv, env=inv.env, cwd=cwd, stdin=subprocess.PIPE, start_new_session=True)
    except OSError:
        _cleanup(inv, record)
        raise
    handed = {sig: signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
              for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if inv.env_file is not None:
            threading.Thread(target=_remove_env_file_once_started, args=(inv, child), daemon=True).start()
        code = child.wait()
    finally:
        for sig, previous in handed.items():
            signal.signal(sig, previous)
        _cleanup(inv, record)
    return code if code >= 0 else 128 - code


def run_program(environment: TrainingEnvironment, mode: str, argv: list[str], *, command: str, cwd: str | None,
                env_names: tuple[str, ...], extra: Mapping[str, str] | None = None,
                stop_grace_s: float = LAUNCHER_STOP_GRACE_S) -> int:
    """The launcher in `mode` (torchrun or exec) with argv, in the environment, supervised; stop_grace_s is its
    SIGTERM-to-SIGKILL of everything it started."""
    try:
        launcher = install_launcher(environment)
        inv = invocation(environment, [launcher, mode, *argv], command=command, cwd=cwd, environ=dict(os.environ),
                         env_names=env_names, extra={GRACE_ENV: str(stop_grace_s), **(extra or {})})
    except (TrainEnvError, OSError) as exc:
        return fail(f"{command}: {exc}")
    try:
        record = container_record(environment, inv.container) if inv.container is not None else None
        return supervise(inv, cwd=cwd if inv.container is None else None, record=record)
    except OSError as exc:
        what = environment.label if inv.container is None and inv.argv[0] == environment.python else inv.argv[0]
        return fail(f"{command}: cannot start {what} on this node ({exc.strerror}): set training.python to an "
                    "interpreter with torch, or training.image", 127)


def main(request: NodeRequest) -> int:
    execing = as_request(request, ExecRequest)
    extra = {TIMEOUT_ENV: str(execing.timeout_s)} if execing.timeout_s is not None else {}
    return run_program(execing.training_env, "exec", list(execing.argv), command="exec", cwd=execing.cwd,
                       env_names=execing.env_names, extra=extra)
