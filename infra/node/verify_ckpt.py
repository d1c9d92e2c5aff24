"""`verify-ckpt`: check a committed checkpoint in the store file by file against its manifest (size and sha256)."""

from __future__ import annotations

import time

from infra.checkpoints.layout import CheckpointError
from infra.checkpoints.store import CheckpointStore
from infra.node.events import NodeEvent, emit, fail
from infra.node.protocol import NodeRequest, VerifyCkptRequest, as_request
from infra.storage import StorageError, open_store


def main(request: NodeRequest) -> int:
    verifying = as_request(request, VerifyCkptRequest)
    started = time.perf_counter()
    try:
        manifest = CheckpointStore(open_store(verifying.url)).verify(verifying.step, deep=True)
    except (CheckpointError, StorageError) as exc:
        return fail(str(exc))
    emit(NodeEvent.VERIFIED, step=manifest.step, files=len(manifest.files), bytes=sum(f.bytes for f in manifest.files),
         seconds=round(time.perf_counter() - started, 3))
    return 0
