"""Whether awscrt's connections are receiving bytes: the only byte-level progress of a GET a caller can see.

The CRT's callbacks fire only once a whole part has landed, in order (on_progress and on_body alike: measured on
awscrt 0.38.1 through a 400 KB/s link, one call per 5 MiB part, 13 s apart), so a healthy part on a slow link
looks exactly like a stalled one to them. The kernel counts every byte the CRT's event-loop threads read from
their sockets (rchar in /proc/self/task/<tid>/io) as it arrives: while that count grows, the link is alive and a
GET that landed nothing is slow, not stalled. (Sent bytes have no such count: the loops write with send(), which
wchar leaves out, and read a part's whole body from its file before sending it.)
"""

from __future__ import annotations

import math
import os
import threading
import time

SAMPLE_S = 0.05  # the counts are read at most this often, however many requests ask
# The loops also read their wake-up eventfds (8 bytes a wake-up: ~8 B/s measured on a stalled link): the link is
# moving only once this much more was read, a packet's worth of socket bytes, not a few wake-ups.
MOVED_BYTES = 16 << 10
_THREAD_PREFIX = "AwsEventLoop"  # how aws-c-io names its event-loop threads
_TASKS = "/proc/self/task"


def _event_loop_threads() -> list[str]:
    found = []
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []  # no /proc (not Linux): nothing is ever seen moving, and requests' own progress decides alone
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as comm:
                if comm.read().startswith(_THREAD_PREFIX):
                    found.append(tid)
        except OSError:
            continue  # the thread ended
    return found


def _read_bytes(tid: str) -> int:
    """Bytes one thread has read, from sockets or files."""
    with open(f"{_TASKS}/{tid}/io") as io:
        fields = dict(line.split(": ", 1) for line in io.read().splitlines() if ": " in line)
    return int(fields["rchar"])


class CrtTraffic:
    """When the CRT's event-loop threads last received a byte."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[str] = []
        self._received = -1
        self._moved = time.monotonic()
        self._sampled = -math.inf

    def received_idle_s(self) -> float:
        """Seconds since the CRT last received a byte, on any of its connections."""
        now = time.monotonic()
        with self._lock:
            if now - self._sampled >= SAMPLE_S:
                self._sampled = now
                received = self._sample()
                if not 0 <= received - self._received < MOVED_BYTES:
                    self._received, self._moved = received, now
            return now - self._moved

    def _sample(self) -> int:
        # The event loops live as long as the process (one shared bootstrap): their ids are looked up again only
        # when one is gone or none was there yet.
        for _ in range(2):
            try:
                if self._threads:
                    return sum(_read_bytes(tid) for tid in self._threads)
            except (OSError, KeyError, ValueError):
                pass
            self._threads = _event_loop_threads()
        return self._received


TRAFFIC = CrtTraffic()
