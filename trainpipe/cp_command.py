"""`trainpipe cp SRC DST [--recursive]`: copy between local paths, file://, s3://, gs:// and az:// with the engine.

Like `aws s3 cp`: a DST ending in '/' (or an existing local directory) receives SRC under its own name;
with --recursive every object under SRC lands under DST at the same relative key, and DST then holds exactly
those files (what was verified is remembered in the user's cache dir, not in DST). Between two object stores the
bytes pass through a temporary directory on this machine.

It is timed start to exit against s5cmd (`trainpipe bench transfer`), so it starts on the storage engine's imports
alone: its arguments are read with argparse (typer brings pydantic: ~0.2 s), rich's bar is imported only for a
terminal, and an s3:// copy lists and moves its bytes through the CRT without botocore (infra.storage.s3).
`trainpipe.cli` gives the same command, with the same options, to `trainpipe --help`.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from infra.storage import ObjectStore, StorageError, open_store
from infra.storage.records import ENGINES
from infra.storage.transfer import (
    DEFAULT_CONFIG,
    FileSpec,
    Progress,
    TransferConfig,
    TransferResult,
    call_with_retries,
    download,
    upload,
)


@dataclass(frozen=True)
class Location:
    """One side of a copy: a local path, or a URL of an object store."""

    text: str

    @property
    def is_local(self) -> bool:
        return "://" not in self.text or self.text.startswith("file://")

    @property
    def path(self) -> Path:
        return Path(self.text.removeprefix("file://")).expanduser()

    @property
    def names_a_directory(self) -> bool:
        return self.text.endswith("/") or (self.is_local and self.path.is_dir())

    def url(self) -> str:
        return self.text.rstrip("/") if not self.is_local else str(self.path.resolve())

    def split(self) -> tuple[str, str]:
        """(parent URL, last name) of a single object or file."""
        parent, _, name = self.url().rpartition("/")
        if not name or parent.endswith(":/"):
            raise StorageError(f"{self.text}: names no object: give s3://bucket/key, gs://bucket/key or az://container/key")
        return parent, name


@dataclass(frozen=True)
class Files:
    """What to copy: files under a local directory (rel paths), or objects under a store (keys)."""

    rels: list[str]
    sizes: list[int]
    etags: list[str | None] | None = None  # objects' versions, from a listing


# What each option means, for argparse here and typer in trainpipe.cli.
HELP = {
    "src": "local path, file://, s3://bucket/key, gs://bucket/key or az://container/key",
    "dst": "where to copy to; ending in '/' means 'into this directory/prefix'",
    "recursive": "copy every object under SRC",
    "workers": "parts in flight (python engine)",
    "part_size_mb": "bytes per ranged GET / multipart part, in MiB",
    "engine": f"{' or '.join(ENGINES)}: the store's own engine (awscrt, transfer_manager) or ranged parts through "
              "Python",
}
DOC = "Copy files and objects (like `aws s3 cp`), parallel, ranged, verified; prints bytes, seconds and MB/s."


class Bar:
    """A rich progress bar on stderr, fed by the engine's progress callback."""

    def __init__(self, label: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
        from rich.progress import Progress as ProgressBar

        self._bar = ProgressBar(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[files]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._task = self._bar.add_task(label, total=None, files="")

    def __call__(self, progress: Progress) -> None:
        self._bar.update(self._task, completed=progress.bytes_done, total=progress.bytes_total or None,
                         files=f"{progress.files_done}/{progress.files_total} files")

    @contextmanager
    def shown(self) -> Iterator[Callable[[Progress], None]]:
        with self._bar:
            yield self


@contextmanager
def _progress(label: str) -> Iterator[Callable[[Progress], None]]:
    """The bar on a terminal; elsewhere (logs, pipes) only the final line says what happened (and rich, ~0.07 s of
    imports, is not loaded)."""
    if not sys.stderr.isatty():
        yield lambda progress: None
        return
    with Bar(label).shown() as bar:
        yield bar


def _list(store: ObjectStore) -> Files:
    objects = call_with_retries(lambda: list(store.list()), f"list {store.url}")
    return Files([info.key for info in objects], [info.size for info in objects], [info.etag for info in objects])


def _walk(root: Path) -> Files:
    if not root.is_dir():
        raise StorageError(f"{root}: no such local directory: check the path (or drop --recursive for one file)")
    rels = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return Files(rels, [(root / rel).stat().st_size for rel in rels])


def _sources(src: Location, recursive: bool) -> tuple[str, Files]:
    """The root URL or path the copy reads from, and what under it to copy."""
    if recursive:
        if src.is_local:
            return str(src.path.resolve()), _walk(src.path)
        return src.url(), _list(open_store(src.url()))
    parent, name = src.split()
    if src.is_local:
        if not src.path.is_file():
            raise StorageError(f"{src.text}: no such local file: check the path (add --recursive for a directory)")
        return parent, Files([name], [src.path.stat().st_size])
    info = call_with_retries(lambda: open_store(parent).head(name), f"HEAD {src.url()}")
    if info is None:
        if any(True for _ in open_store(src.url()).list()):
            raise StorageError(f"{src.text}: is a prefix, not an object: add --recursive to copy everything under it")
        raise StorageError(f"{src.text}: no such object: check the URL")
    return parent, Files([name], [info.size])


def _targets(dst: Location, recursive: bool, files: Files) -> tuple[str, list[str]]:
    """The root URL or path the copy writes under, and the key of each file below it."""
    if recursive or dst.names_a_directory:
        return dst.url(), list(files.rels)
    parent, name = dst.split()
    return parent, [name]


def _fetch(root: str, files: Files, dest: Path, config: TransferConfig, progress: Callable[[Progress], None],
           state_dir: Path | None = None) -> TransferResult:
    etags = files.etags or [None] * len(files.rels)
    specs = [FileSpec(rel, size, etag=etag) for rel, size, etag in zip(files.rels, files.sizes, etags, strict=True)]
    return download(open_store(root), specs, dest, config, progress=progress, state_dir=state_dir)


def _copy(
    root: str, files: Files, dst_root: str, dst_keys: list[str], local_dst: bool, config: TransferConfig,
    progress: Callable[[Progress], None],
) -> TransferResult:
    if local_dst:
        if dst_keys == files.rels:
            return _fetch(root, files, Path(dst_root), config, progress)
        import tempfile  # only on these paths: the common ones start without it (and shutil, random, bz2, lzma)

        # One file under another name: fetched beside its target (same filesystem), then renamed over it.
        target = Path(dst_root) / dst_keys[0]
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".trainpipe-cp-", dir=target.parent) as scratch:
            result = _fetch(root, files, Path(scratch) / "data", config, progress, Path(scratch) / "state")
            os.replace(Path(scratch) / "data" / files.rels[0], target)
        return result
    if root.startswith("/"):
        return upload(Path(root), files.rels, open_store(dst_root), config, keys=dst_keys, progress=progress)
    # Store to store: through a local scratch directory, one engine pass each way.
    import tempfile
    with tempfile.TemporaryDirectory(prefix="trainpipe-cp-") as scratch:
        fetched = _fetch(root, files, Path(scratch) / "data", config, progress, Path(scratch) / "state")
        sent = upload(Path(scratch) / "data", files.rels, open_store(dst_root), config, keys=dst_keys,
                      progress=progress)
    return TransferResult(sent.files, fetched.seconds + sent.seconds, sent.engine)


def copy(src: str, dst: str, recursive: bool = False, workers: int = DEFAULT_CONFIG.workers,
         part_size_mb: int = DEFAULT_CONFIG.part_size >> 20, engine: str = DEFAULT_CONFIG.engine) -> None:
    """`trainpipe cp`: copy, then print one line of bytes, seconds and MB/s."""
    started = time.monotonic()
    if engine not in ENGINES:
        raise StorageError(f"--engine {engine!r}: use {' or '.join(ENGINES)}")
    config = DEFAULT_CONFIG.but(workers=workers, part_size=part_size_mb << 20, engine=engine)
    source, target = Location(src), Location(dst)
    root, files = _sources(source, recursive)
    dst_root, dst_keys = _targets(target, recursive, files)
    # What is loaded by now (the store's client among it) lives as long as the copy: keep the garbage collector from
    # walking it again and again while the transfer allocates (several percent of the client's CPU per GB).
    gc.freeze()
    with _progress(f"{src} → {dst}") as bar:
        result = _copy(root, files, dst_root, dst_keys, target.is_local, config, bar)
    seconds = time.monotonic() - started
    skipped = f" ({result.files_skipped} already there and valid)" if result.files_skipped else ""
    print(f"copied {len(result.files)} files{skipped}, {result.bytes_moved:,} bytes in {seconds:.2f} s: "
          f"{result.bytes_moved / 1e6 / seconds if seconds > 0 else 0.0:.1f} MB/s", flush=True)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than the minimum of 1")
    return value


def main(argv: list[str] | None = None, prog: str = "trainpipe cp") -> None:
    """`trainpipe cp SRC DST` (and `python -m trainpipe.cp_command SRC DST`): a mistake in what was given is one line
    on stderr and exit code 2."""
    parser = argparse.ArgumentParser(prog=prog, description=DOC)
    parser.add_argument("src", help=HELP["src"])
    parser.add_argument("dst", help=HELP["dst"])
    parser.add_argument("--recursive", "-r", action="store_true", help=HELP["recursive"])
    parser.add_argument("--workers", type=_positive, default=DEFAULT_CONFIG.workers, help=HELP["workers"])
    parser.add_argument("--part-size-mb", type=_positive, default=DEFAULT_CONFIG.part_size >> 20,
                        help=HELP["part_size_mb"])
    parser.add_argument("--engine", default=DEFAULT_CONFIG.engine, help=HELP["engine"])
    args = parser.parse_args(argv)
    try:
        copy(args.src, args.dst, args.recursive, args.workers, args.part_size_mb, args.engine)
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(prog="python -m trainpipe.cp_command")
