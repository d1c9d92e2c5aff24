"""The transfer benchmark: trainpipe (each engine: native, python) against s5cmd, aws s3 cp and boto3 on a local
S3 server, against google-cloud-storage's transfer_manager on the GCS emulator, and against AzCopy on Azurite (the
Azure Storage emulator), in one run on this machine.

Every client runs as its own process, timed from start to exit, the way a user runs it (startup included),
over the same dataset: a few large files and many 8 MB ones. trainpipe verifies every byte it moves (the CRC the
store keeps, else one computed from the written file); the peers verify nothing beyond what their protocol does.
Runs of the clients alternate (A B C, A B C, ...), so a load that comes and goes on a shared machine falls on all
of them alike. The ceiling is the best any client reached; a local `cp` of the same bytes gives the disk's limit.
Runs from a checkout: it starts the test servers.

CPU seconds per GB are measured for the client (its process tree) and for the server during each run: on a
machine where both share a few cores, the client's CPU per byte decides its throughput as much as its design.
"""

from __future__ import annotations

import compileall
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil

from infra.storage.records import DEFAULT_CONFIG

BIG_FILE = 256 << 20
SMALL_FILE = 8 << 20
BIN = Path(sys.executable).parent
S3_CLIENTS = ("trainpipe", "s5cmd", "aws", "boto3")
ENGINES = ("native", "python")  # trainpipe's, each its own row
# `trainpipe cp` without the rest of the CLI's imports (pandas, prefect config): the same code, a faster start.
TRAINPIPE_CP = [sys.executable, "-m", "trainpipe.cp_command"]


def _test_servers() -> ModuleType:
    """tests/servers.py of this checkout: the very servers the test suite runs against."""
    return _test_module("servers")


def _test_module(name: str) -> ModuleType:
    """tests/<name>.py of this checkout, importable by the others under its own name (azurite imports servers)."""
    if name in sys.modules and getattr(sys.modules[name], "TRAINPIPE_TEST_MODULE", False):
        return sys.modules[name]
    path = Path(__file__).resolve().parent.parent / "tests" / f"{name}.py"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: run the benchmark from a trainpipe checkout")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.TRAINPIPE_TEST_MODULE = True  # type: ignore[attr-defined]
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class BenchConfig:
    size_gb: float = 2.0
    repeats: int = 3
    gcs_size_gb: float = 0.5
    clients: list[str] | None = None  # S3 clients to run (default: all); trainpipe always runs
    workdir: Path | None = None
    engines: tuple[str, ...] = ENGINES
    azure_size_gb: float = 0.5


@dataclass
class Row:
    store: str
    direction: str
    client: str
    engine: str = ""  # trainpipe's engine; "" for the peers
    mb_per_s: list[float] = field(default_factory=list)
    client_cpu_s_per_gb: list[float] = field(default_factory=list)
    server_cpu_s_per_gb: list[float] = field(default_factory=list)
    note: str = ""
    retries: int = 0  # retries the client logged over all its runs

    @property
    def median(self) -> float:
        return statistics.median(self.mb_per_s) if self.mb_per_s else 0.0

    @property
    def best(self) -> float:
        return max(self.mb_per_s, default=0.0)


@dataclass
class Report:
    dataset: dict[str, object]
    rows: list[Row]

    def _rows(self, store: str, direction: str) -> list[Row]:
        return [r for r in self.rows if r.store == store and r.direction == direction]

    def ceiling(self, row: Row) -> float:
        """The best any client reached on the same kind of copy (the disk's `cp` is its own row, not a client)."""
        one_object = row.note == ONE_OBJECT_NOTE
        return max((r.best for r in self._rows(row.store, row.direction)
                    if r.client != "local cp" and (r.note == ONE_OBJECT_NOTE) == one_object), default=0.0)

    def ratio(self, row: Row, against: str) -> float | None:
        """row's median over the peer's, the peer measured on the same objects (the same note)."""
        peer = next((r for r in self._rows(row.store, row.direction)
                     if r.client == against and r.note == row.note and r.mb_per_s), None)
        if row.note.startswith("failed"):
            return None
        return row.median / peer.median if peer is not None and peer.median > 0 else None

    def summary(self) -> list[dict[str, object]]:
        out = []
        for row in self.rows:
            ceiling = self.ceiling(row)
            out.append({
                **asdict(row), "median": round(row.median, 1), "best": round(row.best, 1),
                "vs_s5cmd": _round(self.ratio(row, "s5cmd")),
                "vs_transfer_manager": _round(self.ratio(row, "transfer_manager")),
                "vs_azcopy": _round(self.ratio(row, "azcopy")),
                "of_ceiling": _round(row.best / ceiling if ceiling and row.mb_per_s else None),
                "client_cpu_s_per_gb": _round(_median(row.client_cpu_s_per_gb)),
                "server_cpu_s_per_gb": _round(_median(row.server_cpu_s_per_gb)),
            })
        return out

    def table(self) -> str:
        lines = [f"dataset: {self.dataset}",
                 f"{'store':<5} {'dir':<9} {'client':<17} {'engine':<7} {'median MB/s':>11} {'best':>8} "
                 f"{'vs s5cmd':>8} {'vs tm':>6} {'vs az':>6} {'of ceil':>7} {'cpu-s/GB':>8} {'server':>6}  runs / note"]
        for item in self.summary():
            def show(value: object) -> str:
                return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)

            note = f" {item['note']}" if item["note"] else ""
            note += f" ({item['retries']} retries logged)" if item["retries"] else ""
            values: list[float] = item["mb_per_s"]  # type: ignore[assignment]
            runs = ", ".join(f"{v:.0f}" for v in values) if len(values) <= 8 else f"{len(values)} runs"
            lines.append(f"{item['store']:<5} {item['direction']:<9} {item['client']:<17} {item['engine'] or '-':<7} "
                         f"{item['median']:>11.1f} {item['best']:>8.1f} {show(item['vs_s5cmd']):>8} "
                         f"{show(item['vs_transfer_manager']):>6} {show(item['vs_azcopy']):>6} "
                         f"{show(item['of_ceiling']):>7} {show(item['client_cpu_s_per_gb']):>8} "
                         f"{show(item['server_cpu_s_per_gb']):>6}  {runs}{note}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"dataset": self.dataset, "rows": self.summary()}, indent=2)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


# -- the dataset ----------------------------------------------------------------------------------------


def dataset_sizes(total_bytes: int) -> dict[str, int]:
    """Half the bytes in large files (256 MB at full size), half in many 8 MB files; scaled down for small runs."""
    big = max(1 << 20, min(BIG_FILE, total_bytes // 8))
    small = max(64 << 10, min(SMALL_FILE, total_bytes // 64))
    sizes = {f"big/{i:03d}.bin": big for i in range(max(1, (total_bytes // 2) // big))}
    remaining = total_bytes - sum(sizes.values())
    sizes |= {f"small/{i:05d}.bin": small for i in range(max(1, remaining // small))}
    return sizes


def write_dataset(root: Path, sizes: dict[str, int]) -> None:
    block = os.urandom(SMALL_FILE)
    for index, (rel, size) in enumerate(sorted(sizes.items())):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as file:
            file.write(index.to_bytes(8, "little"))  # no two files alike
            written = 8
            while written < size:
                written += file.write(block[: size - written])


def _bytes_under(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


# -- clients: each returns the argv of one run --------------------------------------------------------

BOTO3_DOWNLOAD = """
import sys, boto3, os
s3 = boto3.client("s3")
bucket, prefix, dest = sys.argv[1:4]
for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
    for item in page.get("Contents", []):
        path = os.path.join(dest, item["Key"][len(prefix):])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        s3.download_file(bucket, item["Key"], path)
"""

BOTO3_UPLOAD = """
import sys, boto3, os
s3 = boto3.client("s3")
src, bucket, prefix = sys.argv[1:4]
for folder, _, names in os.walk(src):
    for name in sorted(names):
        path = os.path.join(folder, name)
        s3.upload_file(path, bucket, prefix + os.path.relpath(path, src))
"""

TM_DOWNLOAD = """
import sys
from google.cloud import storage
from google.cloud.storage import transfer_manager
from google.auth.credentials import AnonymousCredentials
bucket_name, prefix, dest = sys.argv[1:4]
client = storage.Client(project="bench", credentials=AnonymousCredentials())
bucket = client.bucket(bucket_name)
names = [b.name for b in client.list_blobs(bucket, prefix=prefix)]
results = transfer_manager.download_many_to_path(bucket, names, destination_directory=dest)
errors = [r for r in results if isinstance(r, Exception)]
sys.exit(f"{len(errors)} failed: {errors[:1]}" if errors else 0)
"""

TM_UPLOAD = """
import sys, os
from google.cloud import storage
from google.cloud.storage import transfer_manager
from google.auth.credentials import AnonymousCredentials
src, bucket_name, prefix = sys.argv[1:4]
client = storage.Client(project="bench", credentials=AnonymousCredentials())
names = sorted(os.path.relpath(os.path.join(d, n), src) for d, _, ns in os.walk(src) for n in ns)
results = transfer_manager.upload_many_from_filenames(client.bucket(bucket_name), names, source_directory=src,
                                                      blob_name_prefix=prefix)
errors = [r for r in results if isinstance(r, Exception)]
sys.exit(f"{len(errors)} failed: {errors[:1]}" if errors else 0)
"""


def trainpipe_cp(engine: str, *args: str) -> list[str]:
    return [*TRAINPIPE_CP, "--engine", engine, "--recursive", *args]


def download_argv(client: str, engine: str, bucket: str, prefix: str, dest: Path, endpoint: str) -> list[str]:
    url = f"s3://{bucket}/{prefix}"
    if client == "trainpipe":
        return trainpipe_cp(engine, url, str(dest))
    return {
        "s5cmd": [str(BIN / "s5cmd"), "--endpoint-url", endpoint, "cp", f"{url}*", f"{dest}/"],
        "aws": [str(BIN / "aws"), "--endpoint-url", endpoint, "s3", "cp", "--recursive", "--quiet", url, str(dest)],
        "boto3": [sys.executable, "-c", BOTO3_DOWNLOAD, bucket, prefix, str(dest)],
    }[client]


def upload_argv(client: str, engine: str, src: Path, bucket: str, prefix: str, endpoint: str) -> list[str]:
    url = f"s3://{bucket}/{prefix}"
    if client == "trainpipe":
        return trainpipe_cp(engine, str(src), url)
    return {
        "s5cmd": [str(BIN / "s5cmd"), "--endpoint-url", endpoint, "cp", f"{src}/*", url],
        "aws": [str(BIN / "aws"), "--endpoint-url", endpoint, "s3", "cp", "--recursive", "--quiet", str(src), url],
        "boto3": [sys.executable, "-c", BOTO3_UPLOAD, str(src), bucket, prefix],
    }[client]


@dataclass(frozen=True)
class Timing:
    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    retries: tuple[str, ...] = ()  # the lines in which the client said it retried something


def _retries(stderr: str) -> tuple[str, ...]:
    """The retries a client logged (trainpipe: a warning each; the peers say "retr" too): a run that retried is
    slower for it, and a false retry (a stall that was none) is a bug to see, not noise to average away."""
    return tuple(line for line in stderr.splitlines() if "retr" in line.lower())


class Meter:
    """Runs one client process at a time, timing it and counting its CPU and the server's."""

    def __init__(self, env: dict[str, str], endpoint: str | None) -> None:
        """endpoint: the server's URL (its process's CPU is counted too); None for a copy without a server."""
        self.env, self.endpoint = env, endpoint or ""
        self.server = _listening_child(_port(endpoint)) if endpoint is not None else None

    def _server_cpu(self) -> float:
        if self.server is None:
            return 0.0
        times = self.server.cpu_times()
        return times.user + times.system

    def run(self, argv: list[str], env: dict[str, str] | None = None) -> Timing:
        """env: variables of this run's own, beside the meter's."""
        client_before, server_before = resource.getrusage(resource.RUSAGE_CHILDREN), self._server_cpu()
        started = time.perf_counter()
        done = subprocess.run(argv, env={**self.env, **(env or {})}, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        client_after, server_after = resource.getrusage(resource.RUSAGE_CHILDREN), self._server_cpu()
        if done.returncode != 0:
            raise RuntimeError(f"{Path(argv[0]).name} exited {done.returncode}: {(done.stderr or done.stdout)[-800:]}")
        client_cpu = (client_after.ru_utime - client_before.ru_utime) + (client_after.ru_stime - client_before.ru_stime)
        return Timing(seconds, client_cpu, server_after - server_before, _retries(done.stderr))


def _listening_child(port: int) -> psutil.Process:
    """The server this process started that serves port (its command line names the port)."""
    for child in psutil.Process().children(recursive=True):
        try:
            if any(str(port) in part for part in child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError(f"no child process serves port {port}: the test server did not start")


def _port(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1])


# Said on the rows it concerns: the path users take on GCS itself is not the one the emulator allows.
EMULATOR_NOTE = "(emulator has no XML multipart: files over {mib} MiB go as resumable uploads, not in parallel parts)"


def _record(row: Row, index: int, runs: int, run_once: Callable[[int], Timing], nbytes: int,
            echo: Callable[[str], None]) -> None:
    """One run of a row's client (none once it has failed), its figures appended to the row."""
    if row.note.startswith("failed"):
        return
    try:
        timing = run_once(index)
    except (RuntimeError, OSError) as exc:
        row.note = f"failed: {' '.join(str(exc).split())[:200]}"
        echo(f"  {row.store} {row.direction} {row.client} {row.engine}: {row.note}")
        return
    row.mb_per_s.append(nbytes / 1e6 / timing.seconds)
    row.client_cpu_s_per_gb.append(timing.client_cpu_s / (nbytes / 1e9))
    row.server_cpu_s_per_gb.append(timing.server_cpu_s / (nbytes / 1e9))
    echo(f"  {row.store} {row.direction} {row.client} {row.engine} run {index + 1}/{runs}: "
         f"{row.mb_per_s[-1]:.0f} MB/s, client {row.client_cpu_s_per_gb[-1]:.2f} cpu-s/GB, "
         f"server {row.server_cpu_s_per_gb[-1]:.2f}")
    if timing.retries:
        row.retries += len(timing.retries)
        echo(f"    {len(timing.retries)} retries logged, the first: {timing.retries[0][:300]}")


def _alternating(rows: list[tuple[Row, Callable[[int], Timing]]], runs: int, nbytes: int,
                 echo: Callable[[str], None]) -> None:
    """Every row's client once per round, rounds repeated, each round starting one client later: a passing load
    (and whatever the previous run left to the disk) falls on all of them alike."""
    for index in range(runs):
        for offset in range(len(rows)):
            row, run_once = rows[(index + offset) % len(rows)]
            _record(row, index, runs, run_once, nbytes, echo)


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _warm(folder: Path) -> None:
    """Read every file of a bucket once before a timed download of it: where the buckets outgrow the page cache
    (6 GB: the dataset and its CRC-keeping copy), the first client to read a bucket after the other was read would
    find it on disk and the next one in memory, so the order of the runs, not the client, would decide."""
    buffer = bytearray(8 << 20)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb", buffering=0) as file:
                while file.readinto(buffer):
                    pass


def _checked_download(dest: Path, nbytes: int, run: Callable[[], Timing]) -> Timing:
    """One timed download into an empty dest, which must then hold every byte (and nothing else)."""
    _fresh(dest)
    timing = run()
    if (got := _bytes_under(dest)) != nbytes:
        raise RuntimeError(f"downloaded {got} of {nbytes} bytes")
    shutil.rmtree(dest)
    return timing


# -- the runs -------------------------------------------------------------------------------------------


def _s3_clients(config: BenchConfig) -> list[tuple[str, str]]:
    chosen = [c for c in S3_CLIENTS if c == "trainpipe" or config.clients is None or c in config.clients]
    return [(c, engine) for c in chosen for engine in (config.engines if c == "trainpipe" else ("",))]


def _download_rows(meter: Meter, sources: list[tuple[str, str, str, str]], prefix: str, dest: Path, root: Path,
                   nbytes: int) -> list[tuple[Row, Callable[[int], Timing]]]:
    """A download row per (client, engine, bucket, note): each run into an empty dest, checked for every byte."""
    rows = []
    for client, engine, bucket, note in sources:
        argv = download_argv(client, engine, bucket, prefix, dest, meter.endpoint)

        def download_once(_index: int, argv: list[str] = argv, bucket: str = bucket) -> Timing:
            _warm(root / bucket)
            return _checked_download(dest, nbytes, lambda: meter.run(argv))

        rows.append((Row("s3", "download", client, engine, note=note), download_once))
    return rows


def _upload_rows(meter: Meter, clients: list[tuple[str, str]], src: Path, root: Path, nbytes: int, note: str = ""
                 ) -> list[tuple[Row, Callable[[int], Timing]]]:
    """An upload row per client: each run to a prefix of its own, checked for every byte, then removed."""
    rows = []
    for client, engine in clients:
        def upload_once(index: int, client: str = client, engine: str = engine) -> Timing:
            prefix = f"{client}-{engine}-{index}/"
            timing = meter.run(upload_argv(client, engine, src, "upload", prefix, meter.endpoint))
            if (got := _bytes_under(root / "upload" / prefix)) != nbytes:
                raise RuntimeError(f"uploaded {got} of {nbytes} bytes")
            shutil.rmtree(root / "upload" / prefix)
            return timing

        rows.append((Row("s3", "upload", client, engine, note=note), upload_once))
    return rows


def _run_rows(rows: list[tuple[Row, Callable[[int], Timing]]], runs: int, nbytes: int,
              echo: Callable[[str], None]) -> list[Row]:
    _alternating(rows, runs, nbytes, echo)
    return [row for row, _run in rows]


# A copy of one small object is all start: the client's imports, its credentials, its first connection.
ONE_OBJECT = 1 << 20
ONE_OBJECT_NOTE = "(one 1 MiB object, start to exit: what a small copy costs)"
ONE_OBJECT_RUNS = 5  # per repeat: a run is a tenth of a second, and its figure moves with every passing load


def bench_s3(config: BenchConfig, scratch: Path, servers: ModuleType, echo: Callable[[str], None]) -> Report:
    clients = _s3_clients(config)
    sizes = dataset_sizes(int(config.size_gb * 1e9))
    nbytes = sum(sizes.values())
    root = scratch / "s3root"
    data = root / "bench" / "data"
    echo(f"writing {nbytes / 1e9:.2f} GB: {len(sizes)} files under {data}")
    write_dataset(data, sizes)
    one = root / "bench" / "one"
    write_dataset(one, {"one.bin": ONE_OBJECT})
    dataset = {"bytes": nbytes, "files": len(sizes), "big_files": sum(1 for k in sizes if k.startswith("big/")),
               "big_file_bytes": max(sizes.values()), "repeats": config.repeats, "load_before": _load()}
    rows: list[Row] = []
    with servers.rclone_s3(root, etag_hash="") as server:
        meter = Meter({**os.environ, **server.env()}, server.endpoint)
        server.make_bucket("upload")
        dest = scratch / "download"
        sources = [(client, engine, "bench", "") for client, engine in clients]
        if "native" in config.engines:
            # The server does more per GET of an object with a CRC (it reads the CRC back), so the peer downloads
            # these objects too and the native engine is compared with it there.
            _seed_with_crcs(meter, data, server)
            sources += [(client, engine, CRC_BUCKET, STORED_CRC_NOTE) for client, engine in clients
                        if (client, engine) in (("trainpipe", "native"), ("s5cmd", ""))]
        os.sync()  # the dataset and the seeded bucket on disk before any timing: no run pays another's writeback
        rows += _run_rows(_download_rows(meter, sources, "data/", dest, root, nbytes), config.repeats, nbytes, echo)
        rows += _run_rows(_upload_rows(meter, clients, data, root, nbytes), config.repeats, nbytes, echo)
        small_sources = [(client, engine, "bench", ONE_OBJECT_NOTE) for client, engine in clients]
        small_runs = config.repeats * ONE_OBJECT_RUNS
        rows += _run_rows(_download_rows(meter, small_sources, "one/", dest, root, ONE_OBJECT), small_runs,
                          ONE_OBJECT, echo)
        rows += _run_rows(_upload_rows(meter, clients, one, root, ONE_OBJECT, ONE_OBJECT_NOTE), small_runs,
                          ONE_OBJECT, echo)
    disk = Row("s3", "download", "local cp", note="(disk: cp -r of the same files)")
    rows.append(disk)
    local = Meter(dict(os.environ), None)
    _alternating([(disk, lambda _i: _checked_download(dest, nbytes, lambda: local.run(["cp", "-r", f"{data}/.",
                                                                                       str(dest)])))],
                 config.repeats, nbytes, echo)
    dataset["load_after"] = _load()
    return Report(dataset, rows)


# The same files in a second bucket, uploaded with their CRC64NVME in a header (one request each: rclone keeps the
# CRC of a single PUT, not of a multipart upload), as S3 keeps a full-object CRC for every object it stores: there the
# native engine checks the bytes as they arrive instead of reading each file back. The peers check nothing either way.
CRC_BUCKET = "bench-crc"
STORED_CRC_NOTE = "(objects keep a CRC64NVME, as on S3: trainpipe checks it as bytes arrive)"
SEED_WITH_CRCS = """
import sys
from pathlib import Path
from infra.storage import open_store
from infra.storage.transfer import DEFAULT_CONFIG, upload
src = Path(sys.argv[1])
rels = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
# Whole-object PUTs (rclone keeps no CRC for a multipart object); a 256 MB one is a single "part" whose response
# waits on the server's disk, which a loaded machine can hold past the default stall bound: not timed, so no hurry.
upload(src, rels, open_store(sys.argv[2]), DEFAULT_CONFIG.but(multipart_threshold=1 << 40, stall_timeout_s=300))
"""


def _seed_with_crcs(meter: Meter, data: Path, server: Any) -> None:
    server.make_bucket(CRC_BUCKET)
    meter.run([sys.executable, "-c", SEED_WITH_CRCS, str(data), f"s3://{CRC_BUCKET}/data"])


def _load() -> str:
    """The machine's load average (1, 5, 15 min): other work on a shared machine moves every figure."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def bench_gcs(config: BenchConfig, scratch: Path, servers: ModuleType, echo: Callable[[str], None]) -> list[Row]:
    sizes = dataset_sizes(int(config.gcs_size_gb * 1e9))
    nbytes = sum(sizes.values())
    src = scratch / "gcs-src"
    write_dataset(src, sizes)
    echo(f"GCS emulator: {nbytes / 1e9:.2f} GB in {len(sizes)} files")
    rows: dict[tuple[str, str, str], Row] = {}
    with servers.gcs_emulator(scratch / "gcs") as server:
        meter = Meter({**os.environ, **server.env()}, f"http://{server.host}")
        bucket = servers.create_gcs_bucket(server, "bench").removeprefix("gs://")
        uploads: list[tuple[Row, Callable[[int], Timing]]] = []
        for engine in config.engines:
            rows[("upload", "trainpipe", engine)] = row = Row("gcs", "upload", "trainpipe", engine)
            if engine == "native":
                row.note = EMULATOR_NOTE.format(mib=DEFAULT_CONFIG.multipart_threshold >> 20)
            uploads.append((row, lambda i, engine=engine: meter.run(trainpipe_cp(engine, str(src),
                                                                                  f"gs://{bucket}/tp-{engine}-{i}/"))))
        rows[("upload", "transfer_manager", "")] = row = Row("gcs", "upload", "transfer_manager")
        uploads.append((row, lambda i: meter.run([sys.executable, "-c", TM_UPLOAD, str(src), bucket, f"tm-{i}/"])))
        _alternating(uploads, config.repeats, nbytes, echo)
        dest = scratch / "gcs-download"
        source = f"tp-{config.engines[0]}-0/"
        downloads: list[tuple[Row, Callable[[int], Timing]]] = []
        for engine in config.engines:
            rows[("download", "trainpipe", engine)] = row = Row("gcs", "download", "trainpipe", engine)
            argv = trainpipe_cp(engine, f"gs://{bucket}/{source}", str(dest))
            downloads.append((row, lambda _i, argv=argv: _checked_download(dest, nbytes, lambda: meter.run(argv))))
        rows[("download", "transfer_manager", "")] = row = Row("gcs", "download", "transfer_manager")
        argv = [sys.executable, "-c", TM_DOWNLOAD, bucket, source, str(dest)]
        downloads.append((row, lambda _i: _checked_download(dest, nbytes, lambda: meter.run(argv))))
        _alternating(downloads, config.repeats, nbytes, echo)
    return list(rows.values())


# The az:// store has one engine: the python engine's parts (blocks staged in parallel, ranged GETs).
AZURE_ENGINE = "python"


def _azurite() -> ModuleType:
    """tests/azurite.py of this checkout (which imports tests/servers.py, loaded first)."""
    _test_servers()
    return _test_module("azurite")


def _azcopy(meter: Meter, scratch: Path, *args: str) -> Timing:
    azurite = _azurite()
    # AzCopy writes its logs and job plans under the user's home unless told otherwise.
    env = {"AZCOPY_LOG_LOCATION": str(scratch / "azcopy-logs"),
           "AZCOPY_JOB_PLAN_LOCATION": str(scratch / "azcopy-plans")}
    return meter.run([str(azurite.AZCOPY), "copy", *args, "--recursive", "--log-level", "ERROR"], env)


def bench_azure(config: BenchConfig, scratch: Path, echo: Callable[[str], None]) -> list[Row]:
    azurite = _azurite()
    sizes = dataset_sizes(int(config.azure_size_gb * 1e9))
    nbytes = sum(sizes.values())
    src = scratch / "azure-src"
    write_dataset(src, sizes)
    echo(f"Azurite: {nbytes / 1e9:.2f} GB in {len(sizes)} files")
    rows: dict[tuple[str, str], Row] = {}
    with azurite.azurite(scratch / "azurite" / "data") as server:
        meter = Meter({**os.environ, **server.env()}, server.endpoint.rsplit("/", 1)[0])
        container = server.make_container("bench").removeprefix("az://")
        rows[("upload", "trainpipe")] = row = Row("azure", "upload", "trainpipe", AZURE_ENGINE)
        uploads: list[tuple[Row, Callable[[int], Timing]]] = [
            (row, lambda i: meter.run(trainpipe_cp(AZURE_ENGINE, str(src), f"az://{container}/tp-{i}/")))]
        rows[("upload", "azcopy")] = row = Row("azure", "upload", "azcopy")
        uploads.append((row, lambda i: _azcopy(meter, scratch, f"{src}/*", server.container_sas_url(
            container, f"azcopy-{i}/"), "--from-to", "LocalBlob")))
        _alternating(uploads, config.repeats, nbytes, echo)
        dest = scratch / "azure-download"
        argv = trainpipe_cp(AZURE_ENGINE, f"az://{container}/tp-0/", str(dest))
        rows[("download", "trainpipe")] = row = Row("azure", "download", "trainpipe", AZURE_ENGINE)
        downloads: list[tuple[Row, Callable[[int], Timing]]] = [
            (row, lambda _i: _checked_download(dest, nbytes, lambda: meter.run(argv)))]
        rows[("download", "azcopy")] = row = Row("azure", "download", "azcopy")
        source = server.container_sas_url(container, "tp-0/*")
        downloads.append((row, lambda _i: _checked_download(dest, nbytes, lambda: _azcopy(
            meter, scratch, source, str(dest), "--from-to", "BlobLocal"))))
        _alternating(downloads, config.repeats, nbytes, echo)
    return list(rows.values())


def _compile_checkout() -> None:
    """Bytecode for the checkout's packages, as an install writes it: a checkout run with PYTHONDONTWRITEBYTECODE
    (or from a read-only tree) compiles every module of `trainpipe cp` again on each start (~25 ms of CPU), which
    no installed copy does."""
    root = Path(__file__).resolve().parent.parent
    for package in ("trainpipe", "infra"):
        if not compileall.compile_dir(root / package, quiet=1):
            raise RuntimeError(f"{root / package}: does not compile: fix the syntax error python reports above")


def run_benchmark(config: BenchConfig, echo: Callable[[str], None] = print) -> Report:
    servers = _test_servers()
    _compile_checkout()
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trainpipe-bench-", dir=config.workdir)))
        report = bench_s3(config, scratch, servers, echo)
        shutil.rmtree(scratch / "s3root", ignore_errors=True)
        if config.gcs_size_gb > 0:
            report.rows.extend(bench_gcs(config, scratch, servers, echo))
            report.dataset["gcs_bytes"] = sum(dataset_sizes(int(config.gcs_size_gb * 1e9)).values())
        if config.azure_size_gb > 0:
            report.rows.extend(bench_azure(config, scratch, echo))
            report.dataset["azure_bytes"] = sum(dataset_sizes(int(config.azure_size_gb * 1e9)).values())
    return report
