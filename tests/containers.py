"""Real container engines for tests, and the test image: a training environment with its own Python and torch.

- A Docker Engine of the test session's own: Debian's dockerd (with the containerd it manages) on a unix socket in a
  session dir, its own data and exec roots, and no iptables, bridge or ip_forward changes (a dockerd that sets up its
  bridge turns the FORWARD policy to DROP, which breaks the netns clusters). Code under test finds it through
  DOCKER_HOST, as it would find a node's default engine.
- Rootful podman with its own containers.conf and storage root (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF), so tests
  never touch the machine's images.
- The test image: Debian bookworm (mmdebstrap) with a venv at /opt/venv holding torch (CPU) and numpy, first on
  PATH. Not trainpipe: a user's image. Built once and kept as a `docker save` tar under a content-keyed cache dir
  outside the clone, so later sessions load it in seconds; podman loads the same tar.
- An OCI bundle (rootfs exported from the image and a `runc spec` config.json) for Slurm's OCI containers.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import pytest
from conftest import cannot_run_here

DOCKERD = Path("/usr/sbin/dockerd")
# The docker CLI on PATH is the one code under test runs (here a newer one than the daemon: it negotiates the API down).
DOCKER = "docker"
PODMAN = "podman"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
CLI_TIMEOUT_S = 300.0
BUILD_TIMEOUT_S = 900.0

CACHE_ENV = "TRAINPIPE_TEST_CACHE"  # where built images and downloaded wheels are kept across sessions
DEFAULT_CACHE = Path("/var/cache/trainpipe-tests")
WHEELS_ENV = "TRAINPIPE_TEST_WHEELS"  # a dir with the torch CPU wheel (pip's own index otherwise)
DEFAULT_WHEELS = Path("/opt/wheels")

# The whole recipe of the test image: any change here is a new cache key, so a stale tar is never reused.
SUITE = "bookworm"
DEBIAN_PACKAGES = ("python3", "python3-venv", "bash", "procps")
PYTHON_TAG = "3.11"  # bookworm's python3: the wheels are downloaded for it
PLATFORM = "manylinux_2_28_x86_64"
REQUIREMENTS = ("torch==2.13.0", "numpy")
VENV = "/opt/venv"
IMAGE_PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_REPOSITORY = "trainpipe-test/train"
INSTALL = (f"python3 -m venv {VENV} && {VENV}/bin/pip install -q --no-cache-dir --no-index --find-links /wheels "
           f"{' '.join(REQUIREMENTS)} && {VENV}/bin/python -c 'import torch, numpy'")
RECIPE_VERSION = "1"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, str(DEFAULT_CACHE)))


def require_root_tool(*tools: str) -> None:
    """Skip (fail in CI) where container engines cannot run: they need root and their binaries."""
    if os.geteuid() != 0:
        cannot_run_here("container engines run rootful here, which needs root")
    for tool in tools:
        if shutil.which(tool) is None and not Path(tool).is_file():
            cannot_run_here(f"{tool} is missing: install it (scripts/install-system-packages)")


def _run(argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = CLI_TIMEOUT_S,
         check: bool = True, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """A command with its output kept; a failure raises with what it printed."""
    result = subprocess.run(list(argv), env={**os.environ, **(env or {})}, capture_output=True, text=True,
                            timeout=timeout, **kwargs)  # type: ignore[call-overload]
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{(result.stdout + result.stderr)[-4000:]}")
    return result


class Engine(Protocol):
    name: str  # what training.engine names: docker or podman

    def env(self) -> dict[str, str]: ...

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S, check: bool = True,
            **kwargs: object) -> subprocess.CompletedProcess[str]: ...


# -- Docker Engine -------------------------------------------------------------------------------------------------


@dataclass
class DockerEngine:
    root: Path
    process: subprocess.Popen[bytes] | None = None
    name: str = "docker"

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def env(self) -> dict[str, str]:
        """What a docker client (the nodes' agents, the tests) needs in its environment to reach this engine."""
        return {"DOCKER_HOST": self.host}

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S, check: bool = True,
            **kwargs: object) -> subprocess.CompletedProcess[str]:
        return _run([DOCKER, *args], self.env(), timeout, check, **kwargs)

    def log(self) -> str:
        path = self.root / "dockerd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def answers(self) -> bool:
        return self.cli("info", "--format", "{{.ServerVersion}}", timeout=10, check=False).returncode == 0

    @property
    def _namespace(self) -> str:
        """The engine's containerd namespace, from its root: a hash, since a temp dir's name can hold what containerd
        refuses in a namespace (two separators in a row: `tp-dockerd-i4n__4yg` failed every container in CI)."""
        return hashlib.sha256(str(self.root).encode()).hexdigest()[:12]

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        argv = [str(DOCKERD), "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
                "--pidfile", str(self.root / "docker.pid"), "--host", self.host,
                # No bridge, NAT or forwarding: containers use the host's network (--network host), and the host's
                # FORWARD policy and ip_forward stay as they were.
                "--iptables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none",
                "--userland-proxy=false",
                # A namespace of its own, should dockerd use a containerd the machine already runs.
                "--containerd-namespace", f"trainpipe-test-{self._namespace}",
                "--containerd-plugins-namespace", f"trainpipe-test-{self._namespace}-plugins"]
        with (self.root / "dockerd.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self.socket.exists() and self.answers()):
            if self.process.poll() is not None:
                raise RuntimeError(f"dockerd exited {self.process.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dockerd did not answer within {START_TIMEOUT_S:.0f} s:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop dockerd: it stops its containers and the containerd it started."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait(10)


def _unmount_under(root: Path) -> None:
    """Unmount what a stopped engine left mounted under root (dockerd keeps its exec root's netns/default)."""
    prefix = str(root.resolve()) + "/"
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        _run(["umount", "--lazy", mount], check=False)


@contextmanager
def docker_engine_at(root: Path) -> Iterator[DockerEngine]:
    require_root_tool(str(DOCKERD), DOCKER, "containerd", "runc")
    engine = DockerEngine(root)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()
        _unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)


# -- podman --------------------------------------------------------------------------------------------------------

# crun fails on this machine's hybrid cgroup hierarchy; runc works on both.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
"""


@dataclass
class PodmanEngine:
    root: Path
    name: str = "podman"

    @property
    def conf(self) -> Path:
        return self.root / "containers.conf"

    @property
    def storage_conf(self) -> Path:
        return self.root / "storage.conf"

    def env(self) -> dict[str, str]:
        """What podman (the nodes' agents, the tests) needs in its environment to use this engine's storage."""
        return {"CONTAINERS_CONF": str(self.conf), "CONTAINERS_STORAGE_CONF": str(self.storage_conf)}

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S, check: bool = True,
            **kwargs: object) -> subprocess.CompletedProcess[str]:
        return _run([PODMAN, *args], self.env(), timeout, check, **kwargs)

    def configure(self, image_stores: Sequence[Path] = ()) -> None:
        """Write its configuration; image_stores: read-only image stores (graphroots) whose images it uses as its
        own, without copying them."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.conf.write_text(CONTAINERS_CONF)
        self.storage_conf.write_text(storage_conf(self.root / "graph", self.root / "run", image_stores))


def storage_conf(graphroot: Path, runroot: Path, image_stores: Sequence[Path] = ()) -> str:
    stores = ", ".join(f'"{store}"' for store in image_stores)
    return (f'[storage]\ndriver = "overlay"\ngraphroot = "{graphroot}"\nrunroot = "{runroot}"\n\n'
            f'[storage.options]\nadditionalimagestores = [{stores}]\n')


@contextmanager
def podman_engine_at(root: Path) -> Iterator[PodmanEngine]:
    require_root_tool(PODMAN, "runc")
    engine = PodmanEngine(root)
    engine.configure()
    info = engine.cli("info", "--format", "{{.Store.GraphRoot}} {{.Host.OCIRuntime.Name}}", timeout=60).stdout.split()
    assert info == [str(root / "graph"), "runc"], f"podman ignored its test configuration: {info}"
    try:
        yield engine
    finally:
        # Not `podman system reset`: it would reach into the shared read-only image stores.
        engine.cli("rm", "--all", "--force", "--time", "0", timeout=60, check=False)
        _unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)


# -- the test image ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainImage:
    reference: str  # what training.image names
    id: str  # sha256:... of its config, the same in docker and podman
    tar: Path  # `docker save` archive in the cache
    build_seconds: float  # 0.0 where the cache had it
    timings: dict[str, float] = field(default_factory=dict)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on path, so two test sessions on one machine build a cache entry once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _wheels() -> Path:
    """Every wheel the image's venv installs, for bookworm's Python, downloaded once into the cache (keyed by the
    requirements, so a rebuild installs the very same files)."""
    key = hashlib.sha256(json.dumps([REQUIREMENTS, PYTHON_TAG, PLATFORM]).encode()).hexdigest()[:16]
    wheels = cache_root() / "wheels" / key
    with _locked(wheels.with_suffix(".lock")):
        if not (wheels / ".ready").exists():
            shutil.rmtree(wheels, ignore_errors=True)
            local = Path(os.environ.get(WHEELS_ENV, str(DEFAULT_WHEELS)))
            find_links = ["--find-links", str(local)] if local.is_dir() else []
            _run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version",
                  PYTHON_TAG, "--implementation", "cp", "--platform", PLATFORM, *find_links, "--dest", str(wheels),
                  *REQUIREMENTS], timeout=BUILD_TIMEOUT_S)
            (wheels / ".ready").write_text("")
    return wheels


def image_key(wheels: Path) -> str:
    recipe = [RECIPE_VERSION, SUITE, DEBIAN_PACKAGES, INSTALL, IMAGE_PATH,
              sorted(p.name for p in wheels.glob("*.whl"))]
    return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]


def _build(engine: DockerEngine, wheels: Path, reference: str, tar: Path) -> dict[str, float]:
    """mmdebstrap a root filesystem, import it, install the venv in a container from it, commit, save to tar."""
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=tar.parent, prefix="build-") as scratch:
        started = time.monotonic()
        rootfs = Path(scratch) / "rootfs.tar"
        _run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}", SUITE,
              str(rootfs)], timeout=BUILD_TIMEOUT_S)
        timings["mmdebstrap_s"] = time.monotonic() - started
        base = f"{IMAGE_REPOSITORY}-base:{tar.stem}"
        engine.cli("import", str(rootfs), base, timeout=BUILD_TIMEOUT_S)
        container = f"trainpipe-test-build-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        try:
            engine.cli("run", "--name", container, "--network", "none", "-v", f"{wheels}:/wheels:ro", base,
                       "sh", "-c", INSTALL, timeout=BUILD_TIMEOUT_S)
            timings["venv_s"] = time.monotonic() - started
            engine.cli("commit", "--change", f"ENV PATH={IMAGE_PATH}", container, reference, timeout=BUILD_TIMEOUT_S)
        finally:
            engine.cli("rm", "--force", container, check=False)
            engine.cli("rmi", base, check=False)
        started = time.monotonic()
        partial = Path(scratch) / "image.tar"
        engine.cli("save", "--output", str(partial), reference, timeout=BUILD_TIMEOUT_S)
        partial.chmod(0o644)
        os.replace(partial, tar)  # whole or absent: a reader never loads a half-written tar
        timings["save_s"] = time.monotonic() - started
    return timings


def cached_train_image(build_engine: Callable[[], DockerEngine]) -> TrainImage:
    """The test image as a tar in the cache: there already, or built (once, under a lock) in build_engine, which is
    asked for only then."""
    require_root_tool("mmdebstrap")
    wheels = _wheels()
    key = image_key(wheels)
    tar = cache_root() / "images" / f"{key}.tar"
    reference = f"{IMAGE_REPOSITORY}:{key}"
    started = time.monotonic()
    timings: dict[str, float] = {}
    build_seconds = 0.0
    with _locked(tar.with_suffix(".lock")):
        if not tar.exists():
            timings = _build(build_engine(), wheels, reference, tar)
            build_seconds = time.monotonic() - started
    return TrainImage(reference, _image_id(tar), tar, build_seconds, timings)


def _image_id(tar: Path) -> str:
    """The image's id (the digest of its config) from a `docker save` archive's manifest."""
    with tarfile.open(tar) as archive:
        member = archive.extractfile("manifest.json")
        assert member is not None, f"{tar}: no manifest.json"
        [entry] = json.load(member)
    return f"sha256:{Path(entry['Config']).stem}"


def load_into_docker(engine: DockerEngine, image: TrainImage) -> TrainImage:
    """The image in engine: loaded from its tar unless the engine built it; timings gain load_s."""
    if engine.cli("image", "inspect", image.reference, check=False).returncode == 0:
        return image
    started = time.monotonic()
    engine.cli("load", "--input", str(image.tar), timeout=BUILD_TIMEOUT_S)
    loaded = engine.cli("image", "inspect", "--format", "{{.Id}}", image.reference).stdout.strip()
    assert loaded == image.id, f"docker loaded {loaded} from {image.tar}, its manifest names {image.id}"
    return replace(image, timings={**image.timings, "load_s": time.monotonic() - started})


def podman_image_store(image: TrainImage) -> Path:
    """A podman image store (a graphroot) holding the image, made once per image from its tar and kept in the cache:
    every session's podman uses it read-only (additionalimagestores) instead of loading 1 GB again."""
    store = cache_root() / "podman" / image.tar.stem
    with _locked(store.with_suffix(".lock")):
        if not (store / ".ready").exists():
            shutil.rmtree(store, ignore_errors=True)
            with tempfile.TemporaryDirectory(prefix="tp-podman-load-") as scratch:
                loader = PodmanEngine(Path(scratch))
                loader.configure()
                loader.storage_conf.write_text(storage_conf(store, Path(scratch) / "run"))
                loader.cli("load", "--input", str(image.tar), timeout=BUILD_TIMEOUT_S)
            (store / ".ready").write_text("")
    return store


def load_into(engine: PodmanEngine, image: TrainImage) -> float:
    """Give podman the cached image under the same reference (its read-only store); returns the seconds it took."""
    started = time.monotonic()
    engine.configure(image_stores=[podman_image_store(image)])
    loaded = engine.cli("image", "inspect", "--format", "{{.Id}}", image.reference).stdout.strip()
    assert f"sha256:{loaded.removeprefix('sha256:')}" == image.id, f"podman loaded {loaded}, docker has {image.id}"
    return time.monotonic() - started


def oci_bundle_from_image(holding: Callable[[], DockerEngine], image: TrainImage) -> Path:
    """An OCI bundle of the test image, what Slurm's OCI containers (oci.conf running runc) take as --container: rootfs/
    (the image's filesystem, read-only) and the config.json of `runc spec` with the image's PATH, no terminal, the
    host's network (as the engines' containers run with --network host) and a tmpfs on /tmp. Made once per image and
    kept in the cache: shared by every session, so nothing may write into it (slurmstepd writes the step's own
    config.json in its spool dir). holding: a docker engine holding the image, asked for only to make the bundle."""
    require_root_tool("runc")
    bundle = cache_root() / "oci" / image.tar.stem
    with _locked(bundle.with_suffix(".lock")):
        if not (bundle / ".ready").exists():
            shutil.rmtree(bundle, ignore_errors=True)
            _export_rootfs(holding(), image, bundle / "rootfs")
            _run(["runc", "spec", "--bundle", str(bundle)])
            config = json.loads((bundle / "config.json").read_text())
            process = config["process"]
            process["terminal"] = False
            process["env"] = [f"PATH={IMAGE_PATH}"] + [v for v in process["env"] if not v.startswith("PATH=")]
            config["root"]["readonly"] = True
            config["mounts"].append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                                     "options": ["nosuid", "nodev", "mode=1777"]})
            config["linux"]["namespaces"] = [ns for ns in config["linux"]["namespaces"] if ns["type"] != "network"]
            (bundle / "config.json").write_text(json.dumps(config, indent=2))
            (bundle / ".ready").write_text("")
    return bundle


def _export_rootfs(engine: DockerEngine, image: TrainImage, rootfs: Path) -> None:
    rootfs.mkdir(parents=True)
    container = engine.cli("create", image.reference, "true").stdout.strip()
    try:
        with subprocess.Popen([DOCKER, "export", container], stdout=subprocess.PIPE,
                              env={**os.environ, **engine.env()}) as export:
            _run(["tar", "-x", "-C", str(rootfs)], stdin=export.stdout, timeout=BUILD_TIMEOUT_S)
        assert export.returncode == 0, f"docker export {container} exited {export.returncode}"
    finally:
        engine.cli("rm", "--force", container, check=False)


# -- fixtures (registered in conftest.py) --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[DockerEngine]:
    """This session's Docker Engine; its environment (DOCKER_HOST) is the tests' to pass on (docker_env)."""
    # Short: the socket path must fit a sockaddr_un (108 bytes).
    with docker_engine_at(Path(tempfile.mkdtemp(prefix="tp-dockerd-"))) as engine:
        yield engine


@pytest.fixture(scope="session")
def podman_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodmanEngine]:
    with podman_engine_at(tmp_path_factory.mktemp("podman")) as engine:
        yield engine


@pytest.fixture(scope="session")
def train_image_tar(request: pytest.FixtureRequest) -> TrainImage:
    """The test image (own Python 3.11, torch CPU, numpy; no trainpipe) as a tar in the cache; docker_engine is
    started for it only where the cache lacks it."""
    return cached_train_image(lambda: request.getfixturevalue("docker_engine"))


@pytest.fixture(scope="session")
def train_image(docker_engine: DockerEngine, train_image_tar: TrainImage) -> TrainImage:
    """The test image, present in docker_engine."""
    return load_into_docker(docker_engine, train_image_tar)


@pytest.fixture(scope="session")
def podman_train_image(podman_engine: PodmanEngine, train_image_tar: TrainImage) -> TrainImage:
    """The same image, in podman_engine (from a read-only store in the cache)."""
    seconds = load_into(podman_engine, train_image_tar)
    return replace(train_image_tar, timings={**train_image_tar.timings, "podman_load_s": seconds})


@pytest.fixture(scope="session")
def oci_bundle(train_image_tar: TrainImage, request: pytest.FixtureRequest) -> Path:
    """An OCI bundle dir of the test image, for Slurm's OCI containers (`srun --container=<dir>`); read-only, shared.
    docker_engine is started for it only where the cache lacks the bundle."""
    def holding() -> DockerEngine:
        request.getfixturevalue("train_image")
        return request.getfixturevalue("docker_engine")

    return oci_bundle_from_image(holding, train_image_tar)


def engine_env(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point this process (and so local nodes' agents, which inherit it) at the engine; returns the variables, for
    SSH test servers' session_env (sshd passes its own environment to no session)."""
    env = engine.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def forward_policy() -> str:
    """The host's FORWARD chain policy and rules (iptables), which no engine here may change."""
    return _run(["iptables", "-S", "FORWARD"]).stdout


# -- a venv with torch and nothing of trainpipe: `training.python` on a host ----------------------------------------


def base_python() -> str:
    """The interpreter this session's venv was made from: the venvs made here are its siblings, not its children."""
    return str(Path(sys.base_prefix) / "bin" / "python3")


@pytest.fixture(scope="session")
def torch_venv() -> Path:
    """A venv with torch and numpy and nothing of trainpipe, made once and kept under a content-keyed dir."""
    local = Path(os.environ.get(WHEELS_ENV, str(DEFAULT_WHEELS)))
    wheels = sorted(p.name for p in local.glob("*.whl")) if local.is_dir() else []
    key = hashlib.sha256(json.dumps([sys.version, base_python(), REQUIREMENTS, wheels]).encode()).hexdigest()[:16]
    venv = cache_root() / "venvs" / f"torch-{key}"
    with _locked(venv.with_name(f"{venv.name}.lock")):
        if not (venv / ".ready").exists():
            shutil.rmtree(venv, ignore_errors=True)
            _run([base_python(), "-m", "venv", str(venv)], timeout=BUILD_TIMEOUT_S)
            find_links = ["--find-links", str(local)] if local.is_dir() else []
            _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *find_links, *REQUIREMENTS],
                 timeout=BUILD_TIMEOUT_S)
            _run([str(venv / "bin" / "python"), "-c", "import torch, numpy"])
            (venv / ".ready").write_text("")
    return venv / "bin" / "python"
