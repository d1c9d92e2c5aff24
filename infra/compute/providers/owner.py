"""Who launched a cluster, and whether that process still runs: one record and one check for every provider.

The record is {"pid", "create_time", "host"}: the pid alone is not enough (pids are reused), so the process's start
time must match too. Local, netns and ssh clusters keep it in their record and judge liveness by it. Cloud clusters
put the same facts into a tag as a one-line stamp for people to read, but do not judge liveness by it: a cloud
cluster is swept from any machine, where the launcher's pid means nothing, so they judge by the lease heartbeat
(cloud.lease_alive) instead.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import psutil

# How far the recorded and the actual start time of the process may differ (the record rounds nothing, but a
# process's create_time is derived from boot time and clock ticks, which can drift by a fraction of a second).
START_TIME_SLACK_S = 1.0


def launcher() -> dict[str, Any]:
    """This process, as the launcher of a cluster."""
    me = psutil.Process()
    return {"pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname()}


def launcher_stamp() -> str:
    """This process as user@host:pid:start-time, for tags people read (a cloud's tag values are strings)."""
    me = launcher()
    return f"{getpass.getuser()}@{me['host']}:{me['pid']}:{me['create_time']:.0f}"


def launcher_alive(owner: Mapping[str, Any], *, elsewhere: bool) -> bool:
    """Whether the launching process still runs. A launch from another machine cannot be checked from here: the
    answer is then `elsewhere` (ssh clusters: True, their launcher may well run there; local and netns clusters
    live on this machine only, so a record naming another host has no live launcher here: False)."""
    if owner.get("host") != socket.gethostname():
        return elsewhere
    try:
        process = psutil.Process(int(owner["pid"]))
        return abs(process.create_time() - float(owner["create_time"])) < START_TIME_SLACK_S
    except (psutil.NoSuchProcess, KeyError, ValueError, TypeError):
        return False


@dataclass(frozen=True)
class StampKeys:
    """The tag or label names one cloud files a Stamp's fields under."""

    cluster: str
    run_id: str
    owner: str
    created: str
    lease_ttl_s: str


@dataclass(frozen=True)
class Stamp:
    """Who launched a cloud cluster and when, as its resources carry it (each cloud under its own StampKeys)."""

    cluster: str
    run_id: str
    owner: str
    created: str
    lease_ttl_s: str

    def keyed(self, keys: StampKeys, value: Callable[[str], str] = str) -> dict[str, str]:
        """The stamp under `keys`, each value passed through `value` (a cloud whose labels restrict the characters
        gives its sanitiser)."""
        return {getattr(keys, field.name): value(getattr(self, field.name)) for field in fields(self)}

    @classmethod
    def read(cls, found: Mapping[str, str], keys: StampKeys, run_id: str = "unknown") -> Stamp:
        """The stamp filed in `found` under `keys`; a field missing is empty, a missing run id is `run_id`."""
        return cls(found.get(keys.cluster, ""), found.get(keys.run_id, run_id), found.get(keys.owner, ""),
                   found.get(keys.created, ""), found.get(keys.lease_ttl_s, ""))
