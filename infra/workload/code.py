"""The job's code: packed once from a local dir (or given as a .tar.gz URL), shipped to every node, unpacked there.

A local dir is packed deterministically (sorted names, zeroed times and owners), so its archive, and so the code's
content hash, depend on the files alone: the same code gives the same hash on every machine and every run. The
archive travels through the run's own store prefix like every other bulk byte: the nodes fetch it themselves.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
# Never part of the shipped code: version control, caches, virtualenvs, and what the packer writes itself.
SKIPPED = (".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache", "*.pyc",
           ".ipynb_checkpoints", ".DS_Store")
IGNORE_FILE = ".trainpipeignore"  # more glob patterns, one a line, relative names or basenames
WARN_BYTES = 256 << 20


class CodeError(ValueError):
    """Code that cannot be shipped; the message is one line naming the path and the fix."""


@dataclass(frozen=True)
class PackedCode:
    archive: Path
    sha256: str  # of the archive: the code's content hash
    files: int
    bytes: int  # before compression


def _ignored_patterns(root: Path) -> tuple[str, ...]:
    path = root / IGNORE_FILE
    if not path.is_file():
        return SKIPPED
    extra = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return (*SKIPPED, *extra)


def _skipped(rel: str, patterns: tuple[str, ...]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(rel, p) for p in patterns)


def code_files(root: Path) -> list[str]:
    """The files that ship, relative to root, sorted."""
    patterns = _ignored_patterns(root)
    found: list[str] = []
    for directory, dirs, files in os.walk(root):
        rel_dir = Path(directory).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirs[:] = sorted(d for d in dirs if not _skipped(prefix + d, patterns))
        found += [prefix + f for f in files if not _skipped(prefix + f, patterns)]
    return sorted(found)


def pack(root: Path, dest_dir: Path) -> PackedCode:
    """A deterministic .tar.gz of the code dir in dest_dir, named by its content hash."""
    if not root.is_dir():
        raise CodeError(f"training.code {root}: no such directory: point it at your training code")
    files = code_files(root)
    if not files:
        raise CodeError(f"training.code {root}: holds no files to ship: point it at your training code")
    buffer = io.BytesIO()
    size = 0
    # mtime=0 in the gzip header too: the archive's bytes must depend on the files alone.
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for rel in files:
            path = root / rel
            info = archive.gettarinfo(str(path), arcname=rel)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if info.isreg():
                size += info.size
                with open(path, "rb") as handle:
                    archive.addfile(info, handle)
            elif info.issym():
                archive.addfile(info)
    data = buffer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    dest_dir.mkdir(parents=True, exist_ok=True)
    archive_path = dest_dir / f"code-{digest[:16]}.tar.gz"
    archive_path.write_bytes(data)
    return PackedCode(archive_path, digest, len(files), size)


def _checked(members: list[tarfile.TarInfo], dest: Path) -> list[tarfile.TarInfo]:
    """The members, refused as the 'data' filter refuses them, for a node agent on a Python without extraction filters
    (before 3.11.4: Debian 12's python3 is 3.11.2)."""
    root = dest.resolve()
    for member in members:
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            raise tarfile.TarError(f"{member.name} is a special file")
        target = (root / member.name).resolve()
        if os.path.isabs(member.name) or not target.is_relative_to(root):
            raise tarfile.TarError(f"{member.name} is outside the destination")
        if member.issym() or member.islnk():
            link = (target.parent if member.issym() else root) / member.linkname
            if os.path.isabs(member.linkname) or not link.resolve().is_relative_to(root):
                raise tarfile.TarError(f"{member.name} links outside the destination ({member.linkname})")
    return members


def unpack(archive: Path, dest: Path) -> int:
    """Extract into a fresh dest (what was there goes); members escaping dest or special files are refused."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            members = tar.getmembers()
            # The 'data' filter refuses absolute paths, '..', links out of dest and device files.
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:
                tar.extractall(dest, members=_checked(members, dest))
    except (tarfile.TarError, OSError, EOFError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise CodeError(f"{archive}: not a usable .tar.gz ({type(exc).__name__}: {exc}): ship a gzipped tar of "
                        "your code") from None
    return sum(1 for m in members if m.isreg())
