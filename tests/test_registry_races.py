"""The registry under the interleavings a night of unattended runs hits sooner or later, each forced rather than
hoped for: a promoter stopped between its decision and its write, many rounds of racing promoters on every store,
a promotion interrupted between its claim and its cleanup, and retention deleting the step a promotion targets."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from registry_checks import check_rounds, commit_step
from servers import S3Server, _serving, _tool, free_port

from infra.checkpoints.layout import manifest_key
from infra.checkpoints.store import CheckpointStore
from infra.registry import Registry, RegistryError, registry
from infra.storage import ObjectInfo, ObjectStore, StorageError, open_store
from infra.storage.base import ObjectStore as BaseStore
from infra.storage.local import FileStore

REPO = Path(__file__).resolve().parent.parent
PROMOTER = Path(__file__).resolve().with_name("registry_promoter.py")
SMALL_CLAIM_TTL_S = 1.0
ROUNDS = 20


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """An S3 server that honours If-None-Match: * (moto; rclone serve s3 ignores it)."""
    log_dir = tmp_path_factory.mktemp("moto-s3")
    port = free_port()
    with _serving([_tool("moto_server"), "-p", str(port)], port, log_dir / "moto.log"):
        yield S3Server(f"http://127.0.0.1:{port}", log_dir)


@pytest.fixture
def moto_url(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in moto_s3.env().items():
        monkeypatch.setenv(name, value)
    return moto_s3.make_bucket(f"bucket-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path}/store"


def _url(request: pytest.FixtureRequest, store: str) -> str:
    return str(request.getfixturevalue({"file": "file_url", "rclone": "s3_url", "gcs": "gs_url",
                                        "moto": "moto_url", "azure": "az_url"}[store]))


class _PlainPuts(FileStore):
    """A store with no conditional write of its own: the interface's default put_if_absent."""

    put_if_absent = BaseStore.put_if_absent


# ---- the create-only put and the probe --------------------------------------------------------------------------

@pytest.mark.parametrize(("store", "honoured"), [("file", True), ("moto", True), ("rclone", False), ("gcs", False),
                                               ("azure", True)])
def test_put_if_absent_and_the_probe_that_finds_whether_a_store_honours_it(
        request: pytest.FixtureRequest, store: str, honoured: bool) -> None:
    objects = open_store(f"{_url(request, store)}/root")
    assert objects.put_if_absent("a/move.json", b"first")
    second = objects.put_if_absent("a/move.json", b"second")
    assert (second, objects.get_bytes("a/move.json")) == ((False, b"first") if honoured else (True, b"second"))
    assert objects.honours_create_only("_registry") is honoured
    assert [info.key for info in objects.list("")] == ["a/move.json"]  # the probe is gone again


def test_an_s3_server_without_conditional_writes_gets_a_plain_put_and_is_found_out(moto_url: str) -> None:
    """A server that answers If-None-Match with 501 NotImplemented (some S3-compatible ones): put_if_absent falls
    back to a plain put, and the probe finds the store does not honour create-only puts."""
    import botocore.exceptions

    store = open_store(f"{moto_url}/root")
    client = store.client
    refused: list[str] = []

    class NoConditionalWrites:
        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        def put_object(self, **request: Any) -> Any:
            if "IfNoneMatch" in request:
                refused.append(request["Key"])
                raise botocore.exceptions.ClientError(
                    {"Error": {"Code": "NotImplemented", "Message": "If-None-Match"},
                     "ResponseMetadata": {"HTTPStatusCode": 501}}, "PutObject")
            return client.put_object(**request)

    cast(Any, store).client = NoConditionalWrites()
    assert store.put_if_absent("a", b"first") and store.put_if_absent("a", b"second")
    assert store.get_bytes("a") == b"second" and len(refused) == 2
    assert store.honours_create_only("_registry") is False


def test_the_default_put_if_absent_is_found_not_to_honour_it_and_the_registry_claims(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/store"
    target = commit_step(root, "run-1", 1, tmp_path)
    plain = _PlainPuts(root)
    assert plain.honours_create_only("_registry") is False
    registry_here = Registry(root)
    registry_here.store = plain
    claims: list[str] = []
    put_bytes = plain.put_bytes

    def recording(key: str, data: bytes) -> ObjectInfo:
        claims.extend([key] if "/claims/" in key else [])
        return put_bytes(key, data)

    cast(Any, plain).put_bytes = recording
    registry_here.promote("m", "production", target, metrics={}, reason="r", who="t")
    assert len(claims) == 1 and not list(plain.list("_registry/m/production/claims/"))


# ---- a promoter stopped between its decision and its write -------------------------------------------------------

def _wait_until_stopped(process: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    """Until the process stops itself (SIGSTOP); fails with its output if it exits instead."""
    status: list[int] = []
    waiter = threading.Thread(target=lambda: status.append(os.waitpid(process.pid, os.WUNTRACED)[1]), daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    if not status:
        process.kill()
        pytest.fail(f"the promoter neither stopped nor exited within {timeout_s:.0f} s: {process.communicate()}")
    if not os.WIFSTOPPED(status[0]):
        pytest.fail(f"the promoter exited before its write (status {status[0]}): {process.communicate()}")


@pytest.mark.parametrize("store", ["file", "moto"])
def test_a_promoter_stopped_before_its_write_loses_when_resumed(
        request: pytest.FixtureRequest, store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It read move 1 and decided; stopped past its claim's age, a rival moves the alias; resumed, it exits 2 naming
    the alias and the winner, and the rival's move stands (before create-only moves it overwrote it and exited 0)."""
    root = f"{_url(request, store)}/ckpts"
    first = commit_step(root, "run-0", 1, tmp_path)
    stopped_target, rival_target = (commit_step(root, run, 1, tmp_path) for run in ("run-late", "run-rival"))
    Registry(root).promote("m", "production", first, metrics={}, reason="first", who="t")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    late = subprocess.Popen([sys.executable, str(PROMOTER), str(SMALL_CLAIM_TTL_S), "model", "promote",
                             "m@production", stopped_target, "--root", root, "--expect", first],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_until_stopped(late)
        monkeypatch.setattr(registry, "CLAIM_TTL_S", SMALL_CLAIM_TTL_S)
        rival = Registry(root).promote("m", "production", rival_target, metrics={}, reason="rival", who="rival",
                                       expected_previous=first)
        late.send_signal(signal.SIGCONT)
        out, err = late.communicate(timeout=60)
    finally:
        if late.poll() is None:
            late.kill()
            late.communicate()
    assert late.returncode == 2, (out, err)
    assert "m@production" in err and f"moved to {rival_target} by rival" in err, err
    history = Registry(root).history("m", "production")
    assert history == [history[0], rival] and Registry(root).resolve("m", "production") == rival


# ---- many rounds of racing promoters ---------------------------------------------------------------------------

# moto and Azurite: the create-only path on S3 and Azure Blob (as file://'s), in fewer rounds: each costs moto ~0.4 s.
@pytest.mark.parametrize(("store", "rounds"), [("file", ROUNDS), ("rclone", ROUNDS), ("gcs", ROUNDS), ("moto", 5),
                                               ("azure", 5)])
def test_rounds_of_racing_promoters_have_one_winner_each(
        request: pytest.FixtureRequest, store: str, rounds: int, tmp_path: Path) -> None:
    """Two promoters from one position, released together at their claim (or create-only move), round after round:
    one wins each round, the other is refused naming it, and the history has no gap."""
    outcomes = check_rounds(f"{_url(request, store)}/ckpts", tmp_path, rounds)
    assert outcomes == [(1, 1)] * rounds


# ---- a promotion interrupted between its claim and its cleanup ---------------------------------------------------

class _Interrupting:
    """A store that fails once, the way given, when the registry does `action` on a key containing `where`."""

    def __init__(self, store: ObjectStore, action: str, where: str, failure: BaseException) -> None:
        self._store, self._action, self._where, self._failure = store, action, where, failure

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._store, name)
        if name != self._action:
            return found

        def failing(key: str, *args: Any) -> Any:
            if self._where in key and self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            return found(key, *args)

        return failing


@pytest.mark.parametrize(("action", "where", "failure"), [
    ("list", "/claims/", KeyboardInterrupt()),
    ("put_bytes", "/history/", StorageError("s3://b/_registry/m/production/history/00000002.json: connection reset")),
])
def test_an_interrupted_promotion_leaves_no_claim_behind(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        action: str, where: str, failure: BaseException) -> None:
    """On a store that ignores create-only puts (the claim protocol): Ctrl-C while deciding, or a store error at the
    write, withdraws the claim, so the next promotion wins at once (before, it waited out the claim's 10 minutes)."""
    monkeypatch.setattr(registry, "CONTENTION_DEADLINE_S", 3.0)  # what a claim left behind would cost it
    root = f"{s3_url}/ckpts"
    first, second = (commit_step(root, run, 1, tmp_path) for run in ("run-1", "run-2"))
    Registry(root).promote("m", "production", first, metrics={}, reason="first", who="t")
    interrupted = Registry(root)
    interrupted.store = cast(ObjectStore, _Interrupting(interrupted.store, action, where, failure))
    with pytest.raises(type(failure)):
        interrupted.promote("m", "production", second, metrics={}, reason="interrupted", who="t")
    assert not [info.key for info in interrupted.store.list("_registry/") if "/claims/" in info.key]
    with caplog.at_level(logging.WARNING, logger="infra.registry.registry"):
        move = Registry(root).promote("m", "production", second, metrics={}, reason="next", who="t")
    assert move.seq == 2 and "contended" not in caplog.text


# ---- retention against promotion -------------------------------------------------------------------------------

class _PausingMoves:
    """The registry's store, running before(key) just before it writes a move and after(key) once it is written."""

    def __init__(self, store: ObjectStore, before: Callable[[], None], after: Callable[[], None]) -> None:
        self._store, self._before, self._after = store, before, after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _around(self, key: str, write: Callable[[], Any]) -> Any:
        if "/history/" not in key:
            return write()
        self._before()
        written = write()
        self._after()
        return written

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        return cast(ObjectInfo, self._around(key, lambda: self._store.put_bytes(key, data)))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return bool(self._around(key, lambda: self._store.put_if_absent(key, data)))


def _night(root: str, tmp_path: Path) -> tuple[Registry, CheckpointStore, list[str]]:
    """Steps 1-5 of run-1, production at step 1: retention with keep=1 would delete steps 2, 3 and 4."""
    steps = [commit_step(root, "run-1", step, tmp_path) for step in (1, 2, 3, 4, 5)]
    registry_here = Registry(root)
    registry_here.promote("m", "production", steps[0], metrics={}, reason="first", who="t")
    return registry_here, CheckpointStore(open_store(f"{root}/run-1")), steps


def _alias_target_is_whole(root: str) -> int:
    """The step production names: committed and every file verified (what `trainpipe ckpt verify` checks first)."""
    move = Registry(root).resolve("m", "production")
    assert move is not None and move.target is not None
    step = int(move.target.rsplit("-", 1)[1])
    checkpoints = CheckpointStore(open_store(f"{root}/run-1"))
    assert step in [manifest.step for manifest in checkpoints.committed()]
    assert checkpoints.verify(step, deep=True).step == step
    return step


def test_retention_that_deletes_a_step_while_its_promotion_writes_gets_the_move_undone(
        file_url: str, tmp_path: Path) -> None:
    """Promote checked step 3 (committed), then retention, having read the protected steps before, deletes it whole
    before the move lands: promote sees its target gone after writing and moves the alias back, failing clearly."""
    registry_here, checkpoints, steps = _night(file_url, tmp_path)
    deleted: list[list[int]] = []

    def retention() -> None:
        if not deleted:
            deleted.append(checkpoints.apply_retention(1, Registry(file_url).protected(f"{file_url}/run-1")))

    registry_here.store = cast(ObjectStore, _PausingMoves(registry_here.store, retention, lambda: None))
    gone = (r"m@production: .*step-00000003 was deleted \(by retention\) as move 2 pointed the alias at it: the alias "
            r"is back at .*step-00000001 \(move 3\)")
    with pytest.raises(RegistryError, match=gone):
        registry_here.promote("m", "production", steps[2], metrics={}, reason="r", who="t")
    assert deleted == [[2, 3, 4]]
    assert _alias_target_is_whole(file_url) == 1
    assert [move.target for move in Registry(file_url).history("m", "production")] == [steps[0], steps[2], steps[0]]


def test_retention_keeps_a_step_whose_promotion_lands_after_its_manifest_went(file_url: str, tmp_path: Path) -> None:
    """Promote saw step 3 committed and waits at its write; retention, having read the protected steps, removes step
    3's manifest and the move lands right then: retention reads the protected steps again, puts the manifest back
    and keeps the files; promote, checking its target after its move, finds it committed."""
    registry_here, checkpoints, steps = _night(file_url, tmp_path)
    at_write, manifest_gone, move_written, retention_done = (threading.Event() for _ in range(4))
    delete = checkpoints.store.delete

    def pausing_delete(key: str) -> None:
        delete(key)
        if key == manifest_key(3):
            manifest_gone.set()
            assert move_written.wait(30), "the promotion never wrote its move"

    def before_move() -> None:
        at_write.set()
        assert manifest_gone.wait(30), "retention never removed step 3's manifest"

    def after_move() -> None:
        move_written.set()
        assert retention_done.wait(30), "retention never finished"

    cast(Any, checkpoints.store).delete = pausing_delete
    registry_here.store = cast(ObjectStore, _PausingMoves(registry_here.store, before_move, after_move))
    promoted: list[Any] = []
    promoting = threading.Thread(target=lambda: promoted.append(
        registry_here.promote("m", "production", steps[2], metrics={}, reason="r", who="t")))
    promoting.start()
    try:
        assert at_write.wait(30), "the promotion never reached its write"
        deleted = checkpoints.apply_retention(1, Registry(file_url).protected(f"{file_url}/run-1"))
    finally:
        retention_done.set()
        promoting.join(60)
    assert deleted == [2, 4]
    assert len(promoted) == 1 and promoted[0].target == steps[2]
    assert _alias_target_is_whole(file_url) == 3


def test_retention_puts_the_manifest_back_when_the_registry_cannot_be_read_again(file_url: str, tmp_path: Path
                                                                                 ) -> None:
    _, checkpoints, _ = _night(file_url, tmp_path)
    protected = Registry(file_url).protected(f"{file_url}/run-1")

    def unreadable() -> set[int]:
        raise RegistryError("_registry: unreadable")

    protected.reread = unreadable
    with pytest.raises(RegistryError, match="unreadable"):
        checkpoints.apply_retention(1, protected)
    assert [manifest.step for manifest in checkpoints.committed()] == [5, 4, 3, 2, 1]
