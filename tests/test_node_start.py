"""A node command's start is part of every staging's wall time (on 2 loaded cores, each 0.1 s of imports is ~0.5 s):
the stager, the code fetch and the exchange start without the token format's numpy and pandas, without Prefect, and
read a dataset snapshot from s3:// without botocore (its import and client, ~0.3 s, through the CRT instead)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

from infra.dataset.snapshot import save_snapshot, take_snapshot
from infra.storage import open_store

HEAVY = ("numpy", "pandas", "pyarrow", "botocore", "boto3", "prefect", "great_expectations")


def loaded_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running code."""
    probe = f"import sys\n{code}\nprint(__import__('json').dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=dict(os.environ), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_node_commands_that_move_bytes_import_nothing_heavy() -> None:
    assert loaded_after("import infra.node.__main__, infra.node.stage, infra.node.code, infra.node.fanout, "
                        "infra.node.peerserve") == []


def test_a_snapshot_is_read_from_s3_without_botocore(s3_url: str) -> None:
    dataset = open_store(f"{s3_url}/dataset")
    dataset.put_bytes("a.bin", b"x" * 1000)
    url = save_snapshot(open_store(f"{s3_url}/ckpt"), take_snapshot(dataset))
    assert loaded_after(f"from infra.dataset.snapshot import read_snapshot\nread_snapshot({url!r})") == []
