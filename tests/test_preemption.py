"""Spot preemption survived unattended.

End to end on the local provider with the chaos injector (the cloud is not reachable here, so a node is taken away
on purpose: once with a spot-style notice, once killed without one). The AWS path is driven by a local fake of the
IMDSv2 endpoint and the GCP path by a fake metadata server: the real metadata services exist only on cloud VMs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from jobs import GPT_DEFAULTS, job_config, make_dataset
from test_pipeline_e2e import tagged_processes

from infra.compute.catalog import shipped_catalog
from infra.compute.providers.local import NODE_TAG
from infra.compute.spec import ClusterSpec
from infra.job.recovery_spec import RecoverySpec
from infra.job.spec import ConfigError, parse_job
from infra.lifecycle.recovery import Recoveries, RecoveryExhausted, narrowed
from infra.node.events import NodeEvent, parse
from infra.node.preemption_notice import NOTICE_FILE, aws_notice, gcp_notice, read_notice
from infra.node.protocol import TorchrunRequest, TrainingEnvironment, WatchRequest

# -- fake metadata services -------------------------------------------------------------------------------------


class FakeMetadata:
    """IMDSv2 (token PUT, instance-action 404 until `interrupt()`) and GCE's instance/preempted, on loopback."""

    def __init__(self) -> None:
        self.action: dict[str, str] | None = None
        self.preempted = False
        self.rebalance = False
        self.tokens_issued = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                return

            def _reply(self, status: int, body: str = "") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def do_PUT(self) -> None:
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    fake.tokens_issued += 1
                    self._reply(200, "token-123")
                else:
                    self._reply(400)

            def do_GET(self) -> None:
                if self.path.startswith("/latest/"):
                    if self.headers.get("X-aws-ec2-metadata-token") != "token-123":
                        self._reply(401)  # IMDSv2 refuses requests without the session token
                    elif self.path == "/latest/meta-data/spot/instance-action":
                        self._reply(200, json.dumps(fake.action)) if fake.action else self._reply(404)
                    elif self.path == "/latest/meta-data/events/recommendations/rebalance":
                        self._reply(200, '{"noticeTime": "x"}') if fake.rebalance else self._reply(404)
                    else:
                        self._reply(404)
                elif self.path == "/computeMetadata/v1/instance/preempted":
                    ok = self.headers.get("Metadata-Flavor") == "Google"
                    self._reply(200, "TRUE" if fake.preempted else "FALSE") if ok else self._reply(403)
                else:
                    self._reply(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def interrupt(self, in_s: float) -> None:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + in_s))
        self.action = {"action": "terminate", "time": when}


@pytest.fixture
def metadata() -> Iterator[FakeMetadata]:
    fake = FakeMetadata()
    yield fake
    fake.server.shutdown()


def test_aws_notice_needs_the_token_and_turns_200_into_a_deadline(metadata: FakeMetadata) -> None:
    assert aws_notice(metadata.url) == (None, False)
    metadata.rebalance = True
    metadata.interrupt(in_s=120)
    notice, rebalance = aws_notice(metadata.url)
    assert rebalance and notice is not None and notice.source == "aws"
    assert 100 < notice.deadline - time.time() <= 121
    assert metadata.tokens_issued == 2, "every check starts an IMDSv2 session"


def test_gcp_notice_reads_instance_preempted(metadata: FakeMetadata) -> None:
    assert gcp_notice(metadata.url) is None
    metadata.preempted = True
    notice = gcp_notice(metadata.url)
    assert notice is not None and notice.source == "gcp" and notice.deadline > time.time()


# A stand-in trainer: its command line carries the torchrun command's, which is how the watcher finds trainers.
FAKE_TRAINER = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *_: (print('saving', flush=True), sys.exit(143)))\n"
                "time.sleep(120)\n")


def test_the_watcher_stops_the_trainer_on_an_aws_notice_then_asks_the_syncer_to_flush(
    metadata: FakeMetadata, tmp_path: Path
) -> None:
    env = {**os.environ, NODE_TAG: f"node-{tmp_path.name}"}
    torchrun = TorchrunRequest(training_env=TrainingEnvironment(), nnodes=1, nproc_per_node=1, node_rank=0,
                               master_addr="127.0.0.1", master_port=29500, script=("train.py",))
    trainer = subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, *torchrun.command_line(sys.executable)[1:]],
                               env=env, stdout=subprocess.PIPE, text=True)
    stop_sync = tmp_path / "stop-sync"
    watch = WatchRequest(lease=str(tmp_path / "lease"), ttl_s=600, poll_s=0.2, notice_source="aws",
                         notice_url=metadata.url, notice_poll_s=0.3, workdir=str(tmp_path),
                         stop_sync_file=str(stop_sync))
    watcher = subprocess.Popen(watch.command_line(sys.executable), env=watch.environment(env), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        # Two full checks found no notice (each starts an IMDSv2 session): the first one's answer was acted on.
        deadline = time.monotonic() + 30
        while metadata.tokens_issued < 2:
            assert watcher.poll() is None and time.monotonic() < deadline, "the watcher never checked for a notice"
            time.sleep(0.05)
        assert trainer.poll() is None, "no notice yet: the trainer must keep running"
        metadata.interrupt(in_s=30)
        assert trainer.wait(timeout=20) == 143
        assert trainer.stdout is not None and "saving" in trainer.stdout.read()
        deadline = time.monotonic() + 10
        while not stop_sync.exists():
            assert time.monotonic() < deadline, "the syncer was never asked to flush"
            time.sleep(0.1)
        notice = read_notice(tmp_path / NOTICE_FILE)
        assert notice is not None and notice.source == "aws" and "instance-action" in notice.reason
    finally:
        for process in (watcher, trainer):
            process.kill()
            process.wait()
    assert watcher.stdout is not None
    events = [e for e in map(parse, watcher.stdout.read().splitlines()) if e is not None]
    assert [e.kind for e in events if e.kind is not NodeEvent.WATCHING][:2] == [NodeEvent.PREEMPTION_NOTICE,
                                                                                NodeEvent.TRAINER_STOPPED]


# -- failover policy -------------------------------------------------------------------------------------------


def test_eager_next_region_blocks_the_region_same_zone_first_only_a_zone_hit_twice() -> None:
    spec = ClusterSpec(provider="aws", nodes=2, instance_type="p5.48xlarge", spot="only")
    catalog = shipped_catalog()
    assert narrowed(spec, catalog, []) == spec, "nothing blocked: the spec is left as it was"

    eager = Recoveries(RecoverySpec(failover="eager_next_region"))
    eager.block("us-east-1", "us-east-1a")
    assert "us-east-1" not in narrowed(spec, catalog, eager.blocked).regions

    patient = Recoveries(RecoverySpec(failover="same_zone_first"))
    patient.block("us-east-1", "us-east-1a")
    assert patient.blocked == [], "the first preemption retries the same zone"
    patient.block("us-east-1", "us-east-1a")
    after = narrowed(spec, catalog, patient.blocked)
    assert "us-east-1a" not in after.zones and "us-east-1" in after.regions


def test_recoveries_stop_at_max_and_at_the_deadline() -> None:
    recoveries = Recoveries(RecoverySpec(max_recoveries=1))
    recoveries.begin(["n1"], "spot", True, 50, time.time())
    with pytest.raises(RecoveryExhausted, match="max_recoveries"):
        recoveries.begin(["n1"], "spot", True, 90, time.time())
    late = Recoveries(RecoverySpec(deadline_s=0.01))
    late.started -= 1.0  # the run began a second ago: past its 0.01 s deadline, with no clock to wait on
    with pytest.raises(RecoveryExhausted, match="deadline_s"):
        late.begin(["n0"], "vanished without notice", False, 10, time.time())


def test_chaos_on_a_cloud_provider_or_a_missing_node_is_refused(tmp_path: Path) -> None:
    config = job_config(tmp_path, "file:///tmp/x")
    config["chaos"] = {"preempt": [{"node": 5, "at_step": 10}]}
    with pytest.raises(ConfigError, match=r"chaos\.preempt node 5"):
        parse_job(config)
    config["chaos"] = {"preempt": [{"node": 0, "at_step": 10, "after_s": 3}]}
    with pytest.raises(ConfigError, match="exactly one of at_step and after_s"):
        parse_job(config)


# -- end to end --------------------------------------------------------------------------------------------------


def test_a_job_preempted_twice_finishes_like_an_uninterrupted_one(prefect_server: None, workspace: Path,
                                                                  tmp_path: Path) -> None:
    from flows.retrain import retrain

    dataset = make_dataset(tmp_path / "dataset")
    # Steps of ~50 ms (not the ~13 ms a batch of 64 takes here), so a checkpoint interval of 40 steps is ~2 s and a
    # commit (~0.5-1 s from the save) lands well within it, as it does for any real model.
    training = {"steps": 300, "batch_size": 256}
    plain = retrain(parse_job(job_config(tmp_path / "plain", dataset, **training)), "plain-run")

    config = job_config(tmp_path / "chaos", dataset, **training)
    # The whole-cluster relaunch (test_replace_nodes has the replace-one path end to end).
    config["recovery"] = {"max_recoveries": 3, "confirm_s": 3, "replace": "cluster"}
    config["chaos"] = {"preempt": [
        {"node": 1, "attempt": 0, "at_step": 60, "notice_s": 4},  # a spot notice: the trainer saves first
        {"node": 0, "attempt": 1, "at_step": 220, "notice_s": 0},  # the head node killed without notice
    ]}
    summary = retrain(parse_job(config), "chaos-run")

    assert summary["status"] == "completed" and summary["steps"] == 300, summary.get("error")
    first, second = summary["recoveries"]
    assert (first["with_notice"], first["reason"]) == (True, "chaos: spot notice")
    assert (second["with_notice"], second["reason"]) == (False, "vanished without notice")
    every = GPT_DEFAULTS["ckpt_every"]
    for recovery in (first, second):
        assert (recovery["path"], recovery["replaced"], recovery["fallback"]) == ("relaunched-cluster", [], None)
        assert recovery["steps_lost"] <= every, recovery
        assert set(recovery["seconds"]) == {"teardown", "provision", "verify", "stage", "restore"}, recovery
        assert recovery["notice_to_resume_s"] > 0 and recovery["extra_cost_usd"] == 0.0
    assert first["resumed_from_step"] >= 60, "the notice let the trainer save the step it stopped at"
    # One node of two survived each preemption: its staged shards were reused, the replaced node's fetched again.
    assert first["reused_bytes"] > 0 and second["reused_bytes"] > 0
    assert first["step_reached"] < 200 and second["step_reached"] < 300, "a preemption came too late to test"
    assert summary["final_loss"] == pytest.approx(plain["final_loss"], rel=0.05)
    assert [a["outcome"] for a in summary["attempts"]] == ["launched"] * 3
    assert summary["nodes_left"] == 0
    assert not tagged_processes(workspace), "node processes outlived the run"
    assert not any((workspace / "clusters").iterdir()), "node directories outlived the run"
    print("whole relaunch: detection to resumed", [r["notice_to_resume_s"] for r in summary["recoveries"]], "s")
