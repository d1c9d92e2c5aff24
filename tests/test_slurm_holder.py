"""The allocation holder's script on its own, outside Slurm: `srun` runs its command here, `scontrol` is a stand-in
for a controller that stopped answering. The real allocation's holder is exercised in tests/test_slurm_provider.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cloud_env import wait_for

from infra.compute.providers.slurm.config import NODE_PLACEHOLDER
from infra.compute.providers.slurm.holder import (
    ASK_S,
    CONTROLLER_OUTAGE_S,
    HOLDER_LOG,
    LEASE_FILE,
    POLL_S,
    READY_FILE,
    holder_script,
)

TTL_S = 3
# A step's options end where its command begins: the command runs here, as on the only node.
SRUN = '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
HUNG_SCONTROL = "#!/bin/bash\nexec sleep 3600\n"
# A controller paused (SIGSTOP) while the file named by $TP_FROZEN exists: an ask waits for it (the holder's own bound
# ends the wait); otherwise it shows the job running.
PAUSABLE_SCONTROL = ('#!/bin/bash\nwhile [ -e "$TP_FROZEN" ]; do sleep 0.2; done\n'
                     'echo "JobId=$SLURM_JOB_ID JobState=RUNNING"\n')


def start_holder(tmp_path: Path, job_id: str, ttl_s: float, scontrol: str, ask_preemption: bool,
                 controller_outage_s: int = CONTROLLER_OUTAGE_S) -> tuple[subprocess.Popen[bytes], Path]:
    """The holder script of a one-node job gpu0 running here with stub srun (and scontrol), and its node's workdir."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", scontrol)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    template = str(tmp_path / NODE_PLACEHOLDER / "trainpipe")
    path = tmp_path / "holder.sh"
    path.write_text(holder_script("tp-c", "run-1", template, ttl_s, signal_lead_s=60, ask_preemption=ask_preemption,
                                  controller_outage_s=controller_outage_s))
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": job_id, "SLURMD_NODENAME": "gpu0",
           "SLURM_JOB_NODELIST": "gpu0", "SLURM_JOB_NUM_NODES": "1", "TP_FROZEN": str(tmp_path / "frozen")}
    return subprocess.Popen(["bash", str(path)], env=env, start_new_session=True), Path(
        template.replace(NODE_PLACEHOLDER, "gpu0"))


@contextlib.contextmanager
def ended(holder: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """The holder, killed (its whole session) if it still runs when the block ends."""
    try:
        yield holder
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, 9)
            holder.wait()


def test_a_controller_that_stops_answering_does_not_keep_the_holder_past_its_lease(tmp_path: Path) -> None:
    """The holder of a site without an early signal asks slurmctld every poll; an `scontrol` that never returned kept
    the loop from ever reading the lease again, so the allocation of a dead orchestrator was held for good. A silent
    controller excuses a lapsed lease only up to controller_outage_s."""
    outage_s = 4
    started = time.monotonic()
    holder, own = start_holder(tmp_path, "42", TTL_S, HUNG_SCONTROL, ask_preemption=True,
                               controller_outage_s=outage_s)
    # Two rounds of two bounded asks (the preemption's and the lease's), the lease, the outage, a loaded machine.
    bound = 2 * (POLL_S + 2 * ASK_S) + TTL_S + outage_s + 30
    with ended(holder):
        try:
            code = holder.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            code = None
    log = (own / "logs" / HOLDER_LOG).read_text()
    assert code == 0, f"the holder still ran {bound}s after its lease (ttl {TTL_S}s) ran out:\n{log}"
    assert (own / READY_FILE).read_text().strip() == "42"
    assert "while slurmctld does not answer" in log, log
    assert f"(ttl {TTL_S} s): ending the allocation" in log
    assert time.monotonic() - started < bound


@pytest.mark.parametrize("pause_s", [ASK_S + 2 * TTL_S, ASK_S - 3], ids=["asks-time-out", "an-ask-spans-the-return"])
def test_a_lease_that_lapses_while_the_controller_is_silent_counts_again_from_its_return(tmp_path: Path,
                                                                                        pause_s: int) -> None:
    """The orchestrator's renewals are job steps, which slurmctld starts: a controller paused for longer than the TTL
    ended the allocation of a live run (the holder saw the lease lapse). Now the lease counts from the controller's
    return: the holder outlives the pause, and, the lease still not renewed, ends the allocation a TTL after it. Also
    where no ask timed out: the pause was shorter than an ask's bound, and the one ask answered only at the return."""
    frozen = tmp_path / "frozen"
    frozen.touch()
    holder, own = start_holder(tmp_path, "44", TTL_S, PAUSABLE_SCONTROL, ask_preemption=False)
    log_path = own / "logs" / HOLDER_LOG
    with ended(holder):
        wait_for(lambda: (own / READY_FILE).exists(), 30, "the holder's workdir step")
        time.sleep(pause_s)  # the pause under test, past the TTL
        assert holder.poll() is None, f"the holder ended during the controller's pause:\n{log_path.read_text()}"
        frozen.unlink()
        returned = time.monotonic()
        code = holder.wait(timeout=TTL_S + 2 * POLL_S + 30)
        ended_after_s = time.monotonic() - returned
    log = log_path.read_text()
    assert code == 0 and f"(ttl {TTL_S} s): ending the allocation" in log, log
    assert "while slurmctld does not answer" in log and "slurmctld answers again" in log, log
    assert ended_after_s >= TTL_S - 1, f"ended {ended_after_s:.1f}s after the controller's return:\n{log}"


def test_a_lease_older_than_the_holder_is_the_last_allocations_and_never_ends_this_one(tmp_path: Path) -> None:
    """A relaunch on the same node after more than the TTL found the last allocation's lease and ended itself at its
    first poll ("lease not renewed for 100 s"): the recovery's new allocation, and a rerun's, were gone in seconds."""
    own = tmp_path / "gpu0" / "trainpipe"
    own.mkdir(parents=True)
    (own / LEASE_FILE).write_text(f"{time.time() - 100:.3f}\n")  # the last allocation's, long lapsed
    ttl_s = POLL_S * 3 + 4
    holder, _ = start_holder(tmp_path, "43", ttl_s, PAUSABLE_SCONTROL, ask_preemption=False)
    with ended(holder):
        with contextlib.suppress(subprocess.TimeoutExpired):  # two polls or more: the old holder ended at the first
            holder.wait(timeout=POLL_S * 2 + 1)
        log = (own / "logs" / HOLDER_LOG).read_text() if (own / "logs" / HOLDER_LOG).exists() else ""
        assert holder.poll() is None, f"the holder ended on the last allocation's lease:\n{log}"
        # Nobody renews this allocation's lease: it ends a TTL after its own start, as a dead orchestrator's does.
        code = holder.wait(timeout=ttl_s + POLL_S + 30)
    log = (own / "logs" / HOLDER_LOG).read_text()
    assert code == 0 and f"(ttl {int(ttl_s)} s): ending the allocation" in log, log
    assert "not renewed for 100 s" not in log and "not renewed for 99 s" not in log, log
