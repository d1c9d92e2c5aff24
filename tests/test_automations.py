"""The teardown automations survive a restart of `trainpipe serve`, against the session's real Prefect server.

A proactive trigger remembers which runs it watches; an automation deleted and recreated on restart forgets the
very run whose death caused the restart, and that run is then never marked Crashed nor swept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from flows.automations import DEAD_RUNS, SILENT_RUNS

SWEEP_DEPLOYMENT = uuid.UUID(int=7)
# Each `trainpipe serve` is a new process with its own hash seed; these seeds list the trigger's sets in different
# orders (checked below), which an order-sensitive comparison took for a changed definition.
SEEDS = ("0", "1", "2")  # three orders of the five expected events (each seed a python start: seconds in CI)

INSTALL = """
import json, sys, uuid
from flows.automations import install, teardown_automations
ids = install(teardown_automations(uuid.UUID(sys.argv[1]), int(sys.argv[2])))
print(json.dumps([str(i) for i in ids]))
"""

ORDER = """
import uuid
from flows.automations import teardown_automations
print(repr(teardown_automations(uuid.UUID(int=7), 45)[0].trigger.model_dump(mode="json")["expect"]))
"""


def _python(code: str, seed: str, *args: str) -> str:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PYTHONHASHSEED": seed, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _installed(seed: str, silence_s: int) -> list[str]:
    return list(json.loads(_python(INSTALL, seed, str(SWEEP_DEPLOYMENT), str(silence_s))))


def _named(name: str) -> list[str]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return [str(a.id) for a in client.read_automations_by_name(name)]


@pytest.fixture(autouse=True)
def no_automations_left() -> Iterator[None]:
    """The session's server also serves every other test's `trainpipe run`: a silent-run automation left on it
    would mark a long run of another test Crashed."""
    yield
    from prefect import get_client

    with get_client(sync_client=True) as client:
        for name in (SILENT_RUNS, DEAD_RUNS):
            for automation in client.read_automations_by_name(name):
                client.delete_automation(automation.id)
    assert _named(SILENT_RUNS) == _named(DEAD_RUNS) == []


def test_restarts_with_any_hash_seed_keep_the_same_automations(prefect_server: None) -> None:
    orders = {_python(ORDER, seed) for seed in SEEDS}
    assert len(orders) > 1, "the seeds no longer list the trigger's sets in different orders: pick others"

    first = _installed(SEEDS[0], 45)
    for seed in SEEDS[1:]:
        assert _installed(seed, 45) == first, f"a serve restart with PYTHONHASHSEED={seed} recreated an automation"
    assert [_named(SILENT_RUNS), _named(DEAD_RUNS)] == [[first[0]], [first[1]]]


def test_a_changed_definition_replaces_the_old_one_and_never_leaves_two(prefect_server: None) -> None:
    before = _installed(SEEDS[0], 45)
    after = _installed(SEEDS[1], 60)
    assert after[0] != before[0], "a new silence bound must replace the silent-run automation"
    assert after[1] == before[1], "the unchanged sweep automation must be kept"
    assert _named(SILENT_RUNS) == [after[0]] and _named(DEAD_RUNS) == [after[1]]
