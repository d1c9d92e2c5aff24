"""The training in the user's image on Slurm (infra/node/slurm_container.py), and the node agent's own environment on
Slurm nodes (infra/compute/providers/slurm/agent.py).

Slurm's OCI containers run for real: a test site with oci.conf (runc run by slurmstepd) and the test image's OCI bundle
(tests/containers.py) set up as a site would for trainpipe: its config bind-mounts the dir holding the nodes' scratch.
Pyxis cannot be installed here (it needs enroot and a Slurm built with its SPANK plugin): its srun arguments are
checked as built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cloud_env import wait_for
from conftest import REPO, prefect_home, run_trainpipe
from slurm_cluster import NODE_PYTHON, Site, SlurmCluster, agent_settings, slurm_cluster

from infra.node.protocol import EnvironmentKind, TrainingEnvironment
from infra.node.slurm_container import IN_CONTAINER, SlurmContainerError, container_prefix, derive_config

DEADLINE_S = 60.0
NODE_DIR = "/scratch/gpu1/tp-c"


def oci_environment(bundle: Path | str, node_dir: str = NODE_DIR) -> TrainingEnvironment:
    return TrainingEnvironment(kind=EnvironmentKind.OCI, image=str(bundle), mounts=(node_dir,), node_dir=node_dir)


def write_bundle(bundle: Path, config: dict[str, object]) -> Path:
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(config))
    return bundle


def runc_spec(tmp_path: Path) -> dict[str, object]:
    subprocess.run(["runc", "spec", "--bundle", str(tmp_path)], check=True, capture_output=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    return config


# -- the srun arguments, no Slurm needed ------------------------------------------------------------------------------


def test_pyxis_gets_the_image_the_node_dirs_at_the_same_paths_and_the_workdir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "417")
    environment = TrainingEnvironment(kind=EnvironmentKind.PYXIS, image="nvcr.io#nvidia/pytorch:25.01-py3",
                                      mounts=("/scratch/gpu1/tp-c", "/data/shared"), node_dir="/scratch/gpu1/tp-c")
    assert container_prefix(environment, "gpu1", "/scratch/gpu1/tp-c/code") == [
        "srun", "--overlap", "--jobid=417", "--nodes=1", "--ntasks=1", "--nodelist=gpu1", "--export=ALL", "--quiet",
        "--container-image=nvcr.io#nvidia/pytorch:25.01-py3",
        "--container-mounts=/scratch/gpu1/tp-c:/scratch/gpu1/tp-c,/data/shared:/data/shared",
        "--container-workdir=/scratch/gpu1/tp-c/code"]


def test_a_mount_pyxis_would_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "417")
    environment = TrainingEnvironment(kind=EnvironmentKind.PYXIS, image="img", mounts=("/scratch/a,b",),
                                      node_dir="/scratch/a,b")
    with pytest.raises(SlurmContainerError, match="comma or colon"):
        container_prefix(environment, "gpu1", None)


def test_outside_a_slurm_step_or_for_another_kind_there_is_no_prefix(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SlurmContainerError, match="SLURM_JOB_ID is not set"):
        container_prefix(oci_environment(tmp_path), "gpu1", None)
    monkeypatch.setenv("SLURM_JOB_ID", "417")
    host = TrainingEnvironment(kind=EnvironmentKind.HOST)
    with pytest.raises(SlurmContainerError, match="not a Slurm container"):
        container_prefix(host, "gpu1", None)


def test_an_oci_bundle_must_mount_the_node_dir_and_share_the_network(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "417")
    spec = runc_spec(tmp_path)
    with pytest.raises(SlurmContainerError, match=r"no config.json on this node"):
        container_prefix(oci_environment(tmp_path / "absent"), "gpu1", None)
    as_made = write_bundle(tmp_path / "as-made", spec)
    with pytest.raises(SlurmContainerError, match=r"mounts no dir holding the node's trainpipe dir /scratch/gpu1/tp-c"):
        container_prefix(oci_environment(as_made), "gpu1", None)
    mounted_only = derive_config(spec, ("/scratch",))
    mounted_only["linux"]["namespaces"].append({"type": "network"})  # type: ignore[index]
    with pytest.raises(SlurmContainerError, match=r'remove "network" from linux.namespaces'):
        container_prefix(oci_environment(write_bundle(tmp_path / "own-net", mounted_only)), "gpu1", None)
    fit = write_bundle(tmp_path / "fit", derive_config(spec, ("/scratch",)))
    assert container_prefix(oci_environment(fit), "gpu1", NODE_DIR) == [
        "srun", "--overlap", "--jobid=417", "--nodes=1", "--ntasks=1", "--nodelist=gpu1", "--export=ALL", "--quiet",
        f"--container={fit}", "/bin/sh", "-c", IN_CONTAINER, "trainpipe-oci",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", NODE_DIR]
    derived = json.loads((fit / "config.json").read_text())
    assert {space["type"] for space in derived["linux"]["namespaces"]} == {"pid", "mount"}
    assert {"destination": "/scratch", "type": "bind", "source": "/scratch", "options": ["rbind", "rw"]} in \
        derived["mounts"]
    assert any(mount["destination"] == "/tmp" and mount["type"] == "tmpfs" for mount in derived["mounts"])
    assert {"destination": "/etc/hosts", "type": "bind", "source": "/etc/hosts", "options": ["rbind", "ro"]} in \
        derived["mounts"]


# -- Slurm's OCI containers with runc on the real slurmd --------------------------------------------------------------


@pytest.fixture(scope="module")
def oci_site() -> Iterator[SlurmCluster]:
    with slurm_cluster(Site(nodes=("gpu1", "gpu2"), oci=True)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def site_bundle(oci_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test image's bundle set up as a site would for trainpipe: its config bind-mounts the dir that holds every
    test's scratch (pytest's base temp) at the same path. Its rootfs is the shared bundle's, bind-mounted (runc
    refuses a rootfs behind a symlink, and slurmstepd takes <bundle>/rootfs whatever the config says)."""
    base = tmp_path_factory.getbasetemp()
    bundle = write_bundle(tmp_path_factory.mktemp("site-bundle"),
                          derive_config(json.loads((oci_bundle / "config.json").read_text()), (str(base),)))
    (bundle / "rootfs").mkdir()
    subprocess.run(["mount", "--bind", str(oci_bundle / "rootfs"), str(bundle / "rootfs")], check=True)
    try:
        yield bundle
    finally:
        subprocess.run(["umount", str(bundle / "rootfs")], check=True)


def hold(site: SlurmCluster, tmp_path: Path) -> str:
    """A running two-node allocation's job id."""
    job = site.run("sbatch", "--parsable", "--nodes=2", "--no-kill", f"--output={tmp_path}/holder.out",
                   "--wrap", "sleep 600").stdout.strip()
    wait_for(lambda: site.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "RUNNING", DEADLINE_S,
             f"job {job} running")
    return job


def test_a_step_runs_in_the_oci_bundle_with_runc(oci_site: SlurmCluster, site_bundle: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The command runs in the image (its own Python and torch), in the node dir, with the step's environment, srun's
    stdin and the node's network and hostname (which resolves); its exit status is the step's; a SIGTERM through
    slurmctld reaches it."""
    with oci_site.for_test(monkeypatch) as site:
        job = hold(site, tmp_path)
        node_dir = tmp_path / "scratch" / "gpu1" / "tp-c"
        node_dir.mkdir(parents=True)
        monkeypatch.setenv("SLURM_JOB_ID", job)
        prefix = container_prefix(oci_environment(site_bundle, str(node_dir)), "gpu1", str(node_dir))
        monkeypatch.delenv("SLURM_JOB_ID")
        probe = ("import os, socket, sys, torch; print('IN', sys.executable, torch.__version__, os.getcwd(), "
                 "socket.gethostname(), os.environ['TP_VALUE'], sys.stdin.read()); open('written', 'w').write('x'); "
                 "socket.gethostbyname(socket.gethostname()); "
                 "sys.exit(3)")
        started = time.monotonic()
        done = subprocess.run([*prefix, "python3", "-c", probe], env={**site.env, "TP_VALUE": "a,b=c"},
                              input="from-stdin", capture_output=True, text=True, timeout=DEADLINE_S)
        print(f"a step in the OCI container: {time.monotonic() - started:.2f}s")
        line = next((line for line in done.stdout.splitlines() if line.startswith("IN ")), done.stdout + done.stderr)
        assert line.split() == ["IN", "/opt/venv/bin/python3", "2.13.0+cpu", str(node_dir),
                                subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip(),
                                "a,b=c", "from-stdin"], line
        assert done.returncode == 3
        assert (node_dir / "written").read_text() == "x"

        # The agent's lifeline: srun's stdin closing reaches the container's process as EOF.
        waits = ("import signal, sys; signal.signal(signal.SIGTERM, lambda *_: (print('TERM', flush=True), "
                 "sys.exit(7))); print('READY', flush=True); sys.stdin.read(); print('EOF', flush=True); sys.exit(5)")
        step = subprocess.Popen([*prefix[:1], "--job-name=tp-eof", *prefix[1:], "python3", "-c", waits],
                                env=site.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert step.stdout is not None and step.stdin is not None
        assert step.stdout.readline().strip() == "READY"
        step.stdin.close()
        assert step.stdout.read().split() == ["EOF"] and step.wait(DEADLINE_S) == 5

        # A step stopped through slurmctld (as SlurmStep.terminate does): the container's process gets SIGTERM.
        step = subprocess.Popen([*prefix[:1], "--job-name=tp-term", *prefix[1:], "python3", "-c", waits],
                                env=site.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert step.stdout is not None
        assert step.stdout.readline().strip() == "READY"
        steps = site.run("squeue", "-h", "-s", "-j", job, "-o", "%i %j").stdout.split("\n")
        [step_id] = [line.split()[0] for line in steps if line.endswith(" tp-term")]
        site.run("scancel", "--signal=TERM", step_id, check=False)
        said = step.stdout.read()
        # The signal reaches the container's process from slurmstepd (runc's process group is the step's) and, at
        # times, forwarded by runc as well: once or twice, never missed.
        assert "TERM" in said and said.replace("TERM", "").strip() == "", said
        # runc itself is a process of the step too: the step ends killed by the signal, not with the handler's 7.
        assert step.wait(DEADLINE_S) != 0
        wait_for(lambda: not any(line.endswith((" tp-term", " tp-eof")) for line in
                                 site.run("squeue", "-h", "-s", "-j", job, "-o", "%i %j").stdout.splitlines()),
                 DEADLINE_S, "the container steps gone")


def test_the_step_s_python_is_the_image_s_and_not_the_node_s(oci_site: SlurmCluster, site_bundle: Path,
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of the node's Python reaches the container: trainpipe is not importable there."""
    with oci_site.for_test(monkeypatch) as site:
        job = hold(site, tmp_path)
        node_dir = tmp_path / "node"
        node_dir.mkdir()
        monkeypatch.setenv("SLURM_JOB_ID", job)
        prefix = container_prefix(oci_environment(site_bundle, str(node_dir)), "gpu2", None)
        monkeypatch.delenv("SLURM_JOB_ID")
        check = "import importlib.util as u; print('FOUND', u.find_spec('infra'), u.find_spec('prefect'))"
        done = subprocess.run([*prefix, "python3", "-c", check], env=site.env, capture_output=True, text=True,
                              timeout=DEADLINE_S, stdin=subprocess.DEVNULL)
        assert "FOUND None None" in done.stdout, done.stdout + done.stderr
        assert sys.executable not in done.stdout


# -- a run in the image, through Slurm's OCI containers ---------------------------------------------------------------


def test_trainpipe_run_in_the_image_through_oci_and_runc(oci_site: SlurmCluster, site_bundle: Path, workspace: Path,
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/slurm.yaml with `containers: oci` and the test image's bundle as training.image, on nodes whose
    Python (/usr/bin/python3) has neither trainpipe nor torch: the agent runs from its own environment, made from that
    Python, and the script trains in the image; the run completes, its checkpoint committed, nothing installed into
    the nodes' Python."""
    node_python = NODE_PYTHON
    freeze = [node_python, "-c", "import importlib.metadata as m; print(sorted((d.name, d.version) for d in "
              "m.distributions()))"]
    before = subprocess.run(freeze, capture_output=True, text=True, check=True, cwd="/").stdout
    for module in ("torch", "infra", "prefect"):
        assert subprocess.run([node_python, "-c", f"import {module}"], capture_output=True, cwd="/").returncode != 0, \
            f"{node_python} imports {module}"
    with oci_site.for_test(monkeypatch) as site:
        env = {**os.environ, "TRAINPIPE_HOME": str(workspace), "PREFECT_HOME": prefect_home(tmp_path / "prefect"),
               "SLURM_CONF": str(site.conf)}
        job = yaml.safe_load((REPO / "examples" / "slurm.yaml").read_text())
        data = tmp_path / "data"
        subprocess.run([sys.executable, str(REPO / job["training"]["code"] / "make_data.py"), str(data)], check=True)
        job["dataset"]["url"] = str(data)
        job["checkpoints"]["url"] = str(tmp_path / "checkpoints")
        job["cluster"]["nodes"] = 2
        job["cluster"]["slurm"].update(scratch=f"{tmp_path}/scratch/{{node}}", containers="oci", **agent_settings())
        job["training"]["image"] = str(site_bundle)
        command = job["training"]["command"]
        command[command.index("--steps") + 1] = "10"
        command[command.index("--save-every") + 1] = "5"
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        started = time.monotonic()
        result = run_trainpipe("run", str(tmp_path / "job.yaml"), "--run-id", "slurm-oci", env=env)
        print(f"trainpipe run through OCI containers: {time.monotonic() - started:.1f}s")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        summary = json.loads((workspace / "runs" / "slurm-oci" / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert summary["checkpoint"].endswith("step-00000010")
        assert site.job_ids() == []
    assert subprocess.run(freeze, capture_output=True, text=True, check=True, cwd="/").stdout == before
