"""What a new user meets first: the example configs (checked by `trainpipe plan`, the installed command, with no cloud
account: the examples' buckets live in the real S3 server and GCS emulator of the test fixtures, and plan asks no
cloud API), YAML's readings of words like off, and the checkpoint URL `trainpipe run` prints handed back to
`trainpipe ckpt`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TRAINPIPE, run_trainpipe
from google.api_core.exceptions import Conflict
from servers import GcsServer, S3Server, create_gcs_bucket
from test_cli import checkpoint_url, invoke  # noqa: F401 - checkpoint_url is a fixture used below

from infra.dataset.synth import synthesize
from infra.job.spec import ConfigError, load_job
from infra.storage import open_store


def bucket_of(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


def plan(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_trainpipe("plan", str(config), env=env, timeout=180)


def make_bucket(cloud: str, url: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's bucket in the session's S3 server or GCS emulator, with the environment pointing at it."""
    server: S3Server | GcsServer = request.getfixturevalue("s3_server" if cloud == "aws" else "gcs_server")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    if isinstance(server, S3Server):
        if not (server.root / bucket_of(url)).is_dir():
            server.make_bucket(bucket_of(url))
    else:
        with contextlib.suppress(Conflict):  # the session's emulator has it from an earlier run of this test
            create_gcs_bucket(server, bucket_of(url))


@pytest.mark.parametrize(("cloud", "cheapest"), [("aws", "p4d.24xlarge"), ("gcp", "a2-highgpu-8g")])
def test_cloud_example_plans_against_its_bucket(cloud: str, cheapest: str, workspace: Path, tmp_path: Path,
                                                request: pytest.FixtureRequest,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    example = REPO / "examples" / f"{cloud}.yaml"
    job = load_job(example)
    assert (job.cluster.provider, job.cluster.spot, job.cluster.local_nvme) == (cloud, "prefer", True)
    assert job.cluster.min_network_gbps >= 100 and job.cluster.max_price_per_hour is not None
    make_bucket(cloud, job.dataset.url, request, monkeypatch)
    # The example's own dataset, the CSV files its make_data.py writes: the plan checks its expectations on them.
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(REPO / "examples" / "own-script" / "make_data.py"), str(data)], check=True)
    store = open_store(job.dataset.url)
    store.delete_prefix("")  # a shared server: another test's files there are not the example's
    for part in sorted(data.iterdir()):
        store.put_file(part, part.name)

    result = plan(example, dict(os.environ))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"on {cloud}: 2 nodes × 8 processes" in result.stdout
    assert f"checkpoints: {job.checkpoints.url}/" in result.stdout and "start at step 0" in result.stdout
    assert f"cheapest {cheapest}" in result.stdout and "spot" in result.stdout, result.stdout
    assert not any(workspace.glob("*clusters")), "plan launched something"


def test_the_preemption_example_plans_with_its_chaos(tmp_path: Path, workspace: Path) -> None:
    """examples/preemption.yaml as its header says to run it: after `make run` wrote the dataset (synthesized here
    under the directory plan runs in, where the example's relative URLs point)."""
    synthesize(open_store(f"file://{tmp_path}/.trainpipe/datasets/markov-v256"), 200_000, vocab_size=256,
               shard_tokens=100_000, seed=5)
    result = subprocess.run([TRAINPIPE, "plan", str(REPO / "examples" / "preemption.yaml")], cwd=tmp_path,
                            env=dict(os.environ), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "on local: 2 nodes" in result.stdout and "start at step 0" in result.stdout, result.stdout
    assert load_job(REPO / "examples" / "preemption.yaml").chaos.preempt[0].notice_s > 0
    assert not any(workspace.glob("*clusters")), "plan launched something"


# -- YAML's booleans ------------------------------------------------------------------------------------------------

REST = "dataset: {url: file:///data/ds}\ncheckpoints: {url: s3://b/ckpt}\ntraining: {command: [-m, trainer.train]}\n"


@pytest.mark.parametrize("word", ["off", "no", "false", "Off", "'off'"])
def test_bench_off_as_yaml_reads_it(word: str, tmp_path: Path) -> None:
    """`bench: off` is what the example's comment `# off | warn | fail` invites; YAML 1.1 reads it as false."""
    config = tmp_path / "job.yaml"
    config.write_text(f"cluster:\n  verify:\n    bench: {word}\n  spot: no\n{REST}")
    assert yaml.safe_load(config.read_text())["cluster"]["verify"]["bench"] in (False, "off")
    job = load_job(config)
    assert job.cluster.verify.bench == "off" and job.cluster.spot == "never"


def test_bench_on_names_the_words_that_work(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("cluster:\n  verify: {bench: on}\n" + REST)
    with pytest.raises(ConfigError) as caught:
        load_job(config)
    message = str(caught.value)
    assert "\n" not in message and "cluster.verify.bench" in message and "use warn or fail" in message


def test_the_local_example_with_bench_off(tmp_path: Path) -> None:
    """As a new user follows the comment `# off | warn | fail` in examples/local.yaml."""
    text = (REPO / "examples" / "local.yaml").read_text()
    assert "bench: warn                              # off | warn | fail" in text
    edited = tmp_path / "local.yaml"
    edited.write_text(text.replace("bench: warn", "bench: off", 1))
    assert load_job(edited).cluster.verify.bench == "off"


# -- the URL `trainpipe run` prints ---------------------------------------------------------------------------------


def test_ckpt_verify_and_ls_take_the_step_url_run_prints(checkpoint_url: str) -> None:  # noqa: F811 - the fixture
    printed = f"{checkpoint_url}/step-{20:08d}"  # as tasks.report.record_training writes it into the summary
    verify = invoke("ckpt", "verify", printed)
    assert verify.exit_code == 0, verify.output
    assert json.loads(verify.stdout)["step"] == 20
    older = invoke("ckpt", "verify", f"{checkpoint_url}/step-{10:08d}/")
    assert older.exit_code == 0, older.output
    assert json.loads(older.stdout)["step"] == 10

    listing = invoke("ckpt", "ls", printed)
    assert listing.exit_code == 0, listing.output
    assert [line.split()[1] for line in listing.stdout.splitlines()] == ["10", "20", "30"]

    both = invoke("ckpt", "verify", printed, "10")
    assert both.exit_code == 2
    assert "names step 20 but STEP is 10" in both.stderr
    uncommitted = invoke("ckpt", "verify", f"{checkpoint_url}/step-{30:08d}")
    assert uncommitted.exit_code == 2 and "30" in uncommitted.stderr
