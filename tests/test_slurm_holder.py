"""The allocation holder's script on its own, outside Slurm: `srun` runs its command here, `scontrol` is a stand-in
for a controller that stopped answering. The real allocation's holder is exercised in tests/test_slurm_provider.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

from infra.compute.providers.slurm.config import NODE_PLACEHOLDER
from infra.compute.providers.slurm.holder import ASK_S, HOLDER_LOG, LEASE_FILE, POLL_S, READY_FILE, holder_script

TTL_S = 3
# A step's options end where its command begins: the command runs here, as on the only node.
SRUN = '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
HUNG_SCONTROL = "#!/bin/bash\nexec sleep 3600\n"


def test_a_controller_that_stops_answering_does_not_keep_the_holder_past_its_lease(tmp_path: Path) -> None:
    """The holder of a site without an early signal asks slurmctld every poll; an `scontrol` that never returned kept
    the loop from ever reading the lease again, so the allocation of a dead orchestrator was held for good."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", HUNG_SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    template = str(tmp_path / NODE_PLACEHOLDER / "trainpipe")
    script = tmp_path / "holder.sh"
    script.write_text(holder_script("tp-c", "run-1", template, TTL_S, signal_lead_s=60, ask_preemption=True))
    own = Path(template.replace(NODE_PLACEHOLDER, "gpu0"))
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "gpu0",
           "SLURM_JOB_NODELIST": "gpu0", "SLURM_JOB_NUM_NODES": "1"}
    started = time.monotonic()
    holder = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True)
    bound = POLL_S + ASK_S + TTL_S + 30  # a poll, one bounded ask, the lease, and a loaded machine's slack
    try:
        code = holder.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, 9)
            holder.wait()
    log = (own / "logs" / HOLDER_LOG).read_text()
    assert code == 0, f"the holder still ran {bound}s after its lease (ttl {TTL_S}s) ran out:\n{log}"
    assert (own / READY_FILE).read_text().strip() == "42"
    assert f"(ttl {TTL_S} s): ending the allocation" in log
    assert time.monotonic() - started < bound


def test_a_lease_older_than_the_holder_is_the_last_allocations_and_never_ends_this_one(tmp_path: Path) -> None:
    """A relaunch on the same node after more than the TTL found the last allocation's lease and ended itself at its
    first poll ("lease not renewed for 100 s"): the recovery's new allocation, and a rerun's, were gone in seconds."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text(SRUN)
    (stubs / "srun").chmod(0o755)
    template = str(tmp_path / NODE_PLACEHOLDER / "trainpipe")
    own = Path(template.replace(NODE_PLACEHOLDER, "gpu0"))
    own.mkdir(parents=True)
    (own / LEASE_FILE).write_text(f"{time.time() - 100:.3f}\n")  # the last allocation's, long lapsed
    ttl_s = POLL_S * 3 + 4
    script = tmp_path / "holder.sh"
    script.write_text(holder_script("tp-c", "run-1", template, ttl_s, signal_lead_s=60, ask_preemption=False))
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "43", "SLURMD_NODENAME": "gpu0",
           "SLURM_JOB_NODELIST": "gpu0", "SLURM_JOB_NUM_NODES": "1"}
    holder = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):  # two polls or more: the old holder ended at the first
            holder.wait(timeout=POLL_S * 2 + 1)
        log = (own / "logs" / HOLDER_LOG).read_text() if (own / "logs" / HOLDER_LOG).exists() else ""
        assert holder.poll() is None, f"the holder ended on the last allocation's lease:\n{log}"
        # Nobody renews this allocation's lease: it ends a TTL after its own start, as a dead orchestrator's does.
        code = holder.wait(timeout=ttl_s + POLL_S + 30)
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, 9)
            holder.wait()
    log = (own / "logs" / HOLDER_LOG).read_text()
    assert code == 0 and f"(ttl {int(ttl_s)} s): ending the allocation" in log, log
    assert "not renewed for 100 s" not in log and "not renewed for 99 s" not in log, log
