"""The workload seam without a cluster: the environment contract, placeholders, code packing, progress parsing and
the plan-time checks of a job's code and command."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from infra.node import code as code_agent
from infra.node.events import Event, NodeEvent, parse
from infra.node.protocol import CodeRequest
from infra.workload.code import CodeError, code_files, pack, unpack
from infra.workload.contract import NodeContext, check_command, render_command
from infra.workload.plan import WorkloadError, plan_workload
from infra.workload.progress import LogRecognizer, MetricsFile, point_from_record


def context(resume_from: str = "") -> NodeContext:
    return NodeContext(data_dir="/n/data", data_url="s3://b/ds", data_shards="/n/data-files.txt",
                       checkpoint_dir="/n/ckpt", resume_from=resume_from, metrics_file="/n/logs/metrics.jsonl",
                       run_id="run-7", attempt=2, node_rank=1, num_nodes=3, node_ips=("10.0.0.1", "10.0.0.2"),
                       sync_dir="/n/sync")


def test_the_environment_names_every_value_the_script_is_promised() -> None:
    env = context("/n/ckpt/checkpoint-40").environment()
    assert env == {
        "TRAINPIPE_DATA_DIR": "/n/data", "TRAINPIPE_DATA_URL": "s3://b/ds",
        "TRAINPIPE_DATA_SHARDS": "/n/data-files.txt", "TRAINPIPE_CHECKPOINT_DIR": "/n/ckpt",
        "TRAINPIPE_RESUME_FROM": "/n/ckpt/checkpoint-40", "TRAINPIPE_METRICS_FILE": "/n/logs/metrics.jsonl",
        "TRAINPIPE_RUN_ID": "run-7", "TRAINPIPE_ATTEMPT": "2", "TRAINPIPE_NODE_RANK": "1",
        "TRAINPIPE_NUM_NODES": "3", "TRAINPIPE_NODE_IPS": "10.0.0.1,10.0.0.2", "TRAINPIPE_SYNC_DIR": "/n/sync",
        "TRAINPIPE_INIT_FROM": "",
    }


def test_placeholders_are_filled_and_an_empty_resume_drops_its_option() -> None:
    command = ["train.py", "--output_dir", "{checkpoint_dir}", "--resume_from_checkpoint", "{resume_from}",
               "--lr", "-1e-3", "--tag={run_id}-{node_rank}", "{{literal}}"]
    fresh = render_command(command, context())
    assert fresh == ["train.py", "--output_dir", "/n/ckpt", "--lr", "-1e-3", "--tag=run-7-1", "{literal}"]
    resumed = render_command(command, context("/n/ckpt/checkpoint-40"))
    assert resumed[3:5] == ["--resume_from_checkpoint", "/n/ckpt/checkpoint-40"]
    # Only an option goes with it: a value (a negative number) before a positional resume stays.
    assert render_command(["t.py", "--lr", "-2", "{resume_from}"], context()) == ["t.py", "--lr", "-2"]
    with pytest.raises(ValueError, match=r"command\[1\] '\{data\}': unknown placeholder \{data\}"):
        check_command(["t.py", "{data}"])
    check_command(["t.py", "{{not a placeholder}}", "{data_dir}"])
    # A warm start's weights go the same way: no init_from, no --init-from; evaluate's own placeholders are extra.
    assert render_command(["t.py", "--init-from", "{init_from}"], context()) == ["t.py"]
    evaluate = render_command(["e.py", "{checkpoint}"], context(), extra={"checkpoint": "/n/eval/c"})
    assert evaluate == ["e.py", "/n/eval/c"]
    check_command(["e.py", "{checkpoint}"], extra=("checkpoint",))


def test_code_packs_to_the_same_bytes_every_time_and_unpacks_safely(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "pkg" / "__pycache__").mkdir(parents=True)
    (project / "train.py").write_text("print('hi')\n")
    (project / "pkg" / "__init__.py").write_text("")
    (project / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (project / "data.csv").write_text("a,b\n")
    (project / ".trainpipeignore").write_text("# outputs\n*.csv\n")
    assert code_files(project) == [".trainpipeignore", "pkg/__init__.py", "train.py"]
    first = pack(project, tmp_path / "a")
    (project / "train.py").touch()  # a newer mtime is not new code
    second = pack(project, tmp_path / "b")
    assert first.sha256 == second.sha256 and first.archive.read_bytes() == second.archive.read_bytes()
    (project / "train.py").write_text("print('changed')\n")
    assert pack(project, tmp_path / "c").sha256 != first.sha256

    dest = tmp_path / "node" / "code"
    dest.mkdir(parents=True)
    (dest / "stale.py").write_text("old")
    assert unpack(first.archive, dest) == 3
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        ".trainpipeignore", "pkg/__init__.py", "train.py"]

    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as archive:
        info = tarfile.TarInfo("../outside.py")
        archive.addfile(info)
    with pytest.raises(CodeError, match=r"not a usable \.tar\.gz"):
        unpack(evil, tmp_path / "x")
    assert not (tmp_path / "outside.py").exists()
    with pytest.raises(CodeError, match="no such directory"):
        pack(tmp_path / "missing", tmp_path / "d")


def test_the_node_fetches_verifies_and_reuses_its_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    packed = pack(project, tmp_path / "store")
    url = f"file://{packed.archive}"
    dest = tmp_path / "node" / "code"
    assert code_agent.main(CodeRequest(url=url, dest=str(dest), sha256=packed.sha256)) == 0
    first = parse(capsys.readouterr().out.splitlines()[-1])
    assert first == Event(NodeEvent.CODE, {"sha256": packed.sha256, "files": 1, "reused": False})
    assert (dest / "train.py").read_text() == "print('hi')\n"
    assert sorted(p.name for p in dest.iterdir()) == ["train.py"], "the code dir is exactly the archive's tree"
    assert code_agent.main(CodeRequest(url=url, dest=str(dest), sha256=packed.sha256)) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["reused"] is True
    assert code_agent.main(CodeRequest(url=url, dest=str(tmp_path / "other"), sha256="0" * 64)) == 1
    assert "sha256" in capsys.readouterr().err


def test_plan_checks_the_code_and_the_command_before_anything_launches(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "mypkg").mkdir(parents=True)
    (project / "train.py").write_text("")
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "cli.py").write_text("")
    plan = plan_workload(str(project), (), ("train.py", "--epochs", "1"))
    assert plan.code_sha256 is not None and plan.code_files == 4 - 1  # train.py, __init__.py, cli.py
    assert plan_workload(str(project), (), ("-m", "mypkg.cli")).config_hash != plan.config_hash
    assert plan_workload(None, (), ("-m", "trainer.train")).code_sha256 is None  # installed on the nodes
    assert plan_workload(str(project), ("pip install -e .",), ("-m", "notyet")).code == str(project)
    bad = [
        ((str(tmp_path / "nope"), (), ("train.py",)), "no such directory"),
        ((str(project), (), ("tran.py",)), "training.command[0] tran.py: no such file in training.code"),
        ((str(project), (), ("-m", "missingmod")), "module missingmod is not in training.code"),
        ((None, (), ("train.py",)), "a script needs training.code"),
        ((str(project), (), ("bash", "run.sh")), "torchrun starts a Python script"),
        ((f"file://{tmp_path}/none.tar.gz", (), ("train.py",)), "no such object"),
    ]
    for args, message in bad:
        with pytest.raises(WorkloadError) as caught:
            plan_workload(*args)
        assert message in str(caught.value) and "\n" not in str(caught.value)


def test_metrics_records_become_points_facts_and_partial_lines_wait() -> None:
    reader = MetricsFile()
    records = reader.feed(b'{"step": 1, "loss": 2.5, "total_steps": 10}\n{"eval_loss": 1.2}\nnot json\n{"step": 2')
    assert records == [{"step": 1, "loss": 2.5, "total_steps": 10}, {"eval_loss": 1.2}]
    assert reader.feed(b', "loss": 2.0}\n') == [{"step": 2, "loss": 2.0}]
    assert reader.offset == len(b'{"step": 1, "loss": 2.5, "total_steps": 10}\n{"eval_loss": 1.2}\nnot json\n'
                                b'{"step": 2, "loss": 2.0}\n')
    point = point_from_record(records[0])
    assert point is not None and (point.step, point.loss, point.total_steps) == (1, 2.5, 10)
    assert point_from_record({"eval_loss": 1.2}) is None and point_from_record({"step": True}) is None
    assert point_from_record({"step": 3, "loss": "nan"}).loss is None


def test_hugging_face_and_lightning_log_lines_are_recognised() -> None:
    hf = LogRecognizer()
    assert hf.feed(" 17%|█▋        | 5/30 [00:00<00:01, 12.61it/s]") is None
    assert hf.feed("Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 606.03it/s]") is None
    point = hf.feed("{'loss': '4.037', 'grad_norm': '0.6642', 'learning_rate': '4.333e-05', 'epoch': '0.04'}")
    assert point is not None and (point.step, point.loss, point.total_steps) == (5, 4.037, 30)
    assert point.values["learning_rate"] == pytest.approx(4.333e-05)
    assert hf.feed("{'train_runtime': '6.877', 'train_loss': '4.035', 'epoch': '0.24'}") is None

    lightning = LogRecognizer()
    line = "Epoch 2:  45%|████▌     | 45/100 [00:01<00:02, 30.10it/s, v_num=0, train_loss=2.340]"
    point = lightning.feed(line)
    assert point is not None and (point.step, point.loss) == (245, 2.34)
    assert lightning.feed("Epoch 0:  10%|█         | 10/100 [00:00<00:02, 30.1it/s, v_num=0]") is None
    rich = "Epoch 2/-2 ━━━━━━━━━━━━━━━━━ 12/12 0:00:00 •        215.85it/s train_loss: 0.040"
    point = LogRecognizer().feed(rich)
    assert point is not None and (point.step, point.loss) == (36, 0.04)
    assert LogRecognizer().feed("{'loss': 1.0}") is None, "no step seen yet"
