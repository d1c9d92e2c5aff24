"""What can be checked about a job's code and command before a node is launched, and the code's identity."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infra.storage import StorageError, open_store
from infra.workload.code import WARN_BYTES, CodeError, code_files, pack

CODE_PREFIX = "_code"  # under the run's checkpoint prefix: where a packed local dir travels to the nodes


class WorkloadError(ValueError):
    """A job whose code or command cannot run; one line naming the thing and the fix."""


@dataclass(frozen=True)
class WorkloadPlan:
    code: str | None  # the local dir or the archive URL, as configured
    code_sha256: str | None  # a local dir's content hash (an archive URL's is known once nodes fetch it)
    code_files: int
    command: tuple[str, ...]
    config_hash: str  # identifies the training setup a checkpoint came from (recorded in every manifest)
    warnings: tuple[str, ...] = ()

    @property
    def is_local_dir(self) -> bool:
        return self.code is not None and "://" not in self.code

    def render(self) -> str:
        code = "none (the command runs from the nodes' environment)" if self.code is None else self.code
        if self.code_sha256:
            code += f" ({self.code_files} files, sha256 {self.code_sha256[:12]}…)"
        return f"  code: {code}\n  command: torchrun … {' '.join(self.command)}"


def _module_in(code: Path, module: str) -> bool:
    base = code.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or (base / "__main__.py").is_file()


def _check_command(command: tuple[str, ...], code: str | None, has_setup: bool) -> None:
    first = command[0]
    code_dir = Path(code) if code is not None and "://" not in code else None
    if first == "-m":
        if len(command) < 2:
            raise WorkloadError("training.command [-m]: name the module to run: [-m, package.module, ...]")
        module = command[1]
        found = (code_dir is not None and _module_in(code_dir, module)) or importlib.util.find_spec(
            module.split(".")[0]) is not None
        if not found and not has_setup and (code is None or code_dir is not None):
            where = f"in training.code {code_dir}" if code_dir else "installed here (and training.code is not set)"
            raise WorkloadError(f"training.command: module {module} is not {where}: fix the module name, set "
                                "training.code to the dir holding it, or install it in training.setup")
        return
    if not first.endswith(".py"):
        raise WorkloadError(f"training.command[0] {first!r}: torchrun starts a Python script: give a .py of the "
                            "code (with its arguments) or [-m, module, ...]")
    if Path(first).is_absolute():
        return  # a script already on the nodes
    if code is None:
        raise WorkloadError(f"training.command[0] {first}: a script needs training.code, the dir holding it "
                            "(or give an absolute path on the nodes)")
    if code_dir is not None and first not in code_files(code_dir):
        raise WorkloadError(f"training.command[0] {first}: no such file in training.code {code_dir}: "
                            "the script's path is relative to the code dir")


def plan_workload(code: str | None, setup: tuple[str, ...], command: tuple[str, ...]) -> WorkloadPlan:
    warnings: list[str] = []
    sha256, files = None, 0
    if code is not None and "://" not in code:
        with tempfile.TemporaryDirectory(prefix="trainpipe-code-") as scratch:
            try:
                packed = pack(Path(code), Path(scratch))
            except CodeError as exc:
                raise WorkloadError(str(exc)) from None
        sha256, files = packed.sha256, packed.files
        if packed.bytes > WARN_BYTES:
            warnings.append(f"training.code {code}: {packed.bytes / 1e6:,.0f} MB is shipped to every node: keep data "
                            "and outputs out of it (list them in .trainpipeignore)")
    elif code is not None:
        try:
            found = open_store(code.rsplit("/", 1)[0]).head(code.rsplit("/", 1)[1])
        except StorageError as exc:
            raise WorkloadError(f"training.code: {exc}") from None
        if found is None:
            raise WorkloadError(f"training.code {code}: no such object: upload the archive or fix the URL")
    _check_command(command, code, bool(setup))
    identity = {"code": sha256 or code, "setup": list(setup), "command": list(command)}
    config_hash = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return WorkloadPlan(code, sha256, files, command, config_hash, tuple(warnings))


def code_archive_url(checkpoint_url: str, sha256: str) -> str:
    """Where a packed local code dir is put for the nodes to fetch: beside the run's checkpoints."""
    return f"{checkpoint_url}/{CODE_PREFIX}/code-{sha256[:16]}.tar.gz"
