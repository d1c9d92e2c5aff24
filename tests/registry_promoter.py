"""`trainpipe model ...` in a process that stops itself (SIGSTOP) just before it writes an alias move, for tests that
resume it (SIGCONT) after a rival's move: the promoter's decision is made, its write not yet sent.

    python tests/registry_promoter.py CLAIM_TTL_S model promote m@production CKPT --root ROOT --expect PREVIOUS

CLAIM_TTL_S: the registry's claim age for this process (small, so a rival outlives the stopped promoter's claim)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from infra.registry import registry
from infra.storage.base import ObjectInfo, ObjectStore
from infra.storage.gcs import GcsStore
from infra.storage.local import FileStore
from infra.storage.s3 import S3Store


def _is_move(key: str) -> bool:
    return "/history/" in key


def _stop_before_moves(store_class: type[ObjectStore]) -> None:
    patched: Any = store_class
    put_bytes = store_class.put_bytes

    def stopping_put_bytes(self: ObjectStore, key: str, data: bytes) -> ObjectInfo:
        if _is_move(key):
            os.kill(os.getpid(), signal.SIGSTOP)
        return put_bytes(self, key, data)

    patched.put_bytes = stopping_put_bytes
    put_if_absent = getattr(store_class, "put_if_absent", None)  # absent before moves were written create-only
    if put_if_absent is not None:
        def stopping_put_if_absent(self: ObjectStore, key: str, data: bytes) -> bool:
            if _is_move(key):
                os.kill(os.getpid(), signal.SIGSTOP)
            return bool(put_if_absent(self, key, data))

        patched.put_if_absent = stopping_put_if_absent


def main() -> None:
    registry.CLAIM_TTL_S = float(sys.argv[1])
    for store_class in (FileStore, S3Store, GcsStore):
        _stop_before_moves(store_class)
    sys.argv = ["trainpipe", *sys.argv[2:]]
    from trainpipe.cli import app

    app()


if __name__ == "__main__":
    main()
