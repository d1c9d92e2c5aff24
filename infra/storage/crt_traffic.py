"""Whether awscrt's connections are moving bytes: the only byte-level progress of a request a caller can see.

The CRT's callbacks fire only once a whole part has landed or been stored, in order (on_progress and on_body alike:
measured on awscrt 0.38.1 through a 400 KB/s link, one call per 5 MiB part, 13 s apart), so a healthy part on a slow
link looks exactly like a stalled one to them. The kernel counts what moves underneath:
- received: every byte the CRT's event-loop threads read from their sockets (rchar in /proc/self/task/<tid>/io);
- sent: every byte the far ends of this process's TCP connections acknowledged (tcp_info's tcpi_bytes_acked),
  since the loops write with send(), which no per-thread count (wchar) includes, and read a part's whole body from
  its file before sending it.
While either grows, the link is alive, and a request that landed nothing is slow, not stalled. The acknowledged
count is every TCP connection's of the process: another client's traffic in the same process (the orchestrator's
API calls) keeps the link alive too, so a stall there is caught once that traffic pauses as well.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import threading
import time

SAMPLE_S = 0.05  # the counts are read at most this often, however many requests ask
# The loops also read their wake-up eventfds (8 bytes a wake-up: ~8 B/s measured on a stalled link): the link is
# moving only once this much more was read, a packet's worth of socket bytes, not a few wake-ups.
MOVED_BYTES = 16 << 10
_THREAD_PREFIX = "AwsEventLoop"  # how aws-c-io names its event-loop threads
_TASKS = "/proc/self/task"
_FDS = "/proc/self/fd"
_BYTES_ACKED = struct.Struct("=Q")  # struct tcp_info's tcpi_bytes_acked (Linux 4.1+)
_BYTES_ACKED_AT = 120
_TCP_INFO_LEN = 256  # the kernel copies at most what it has; a shorter answer has no tcpi_bytes_acked


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


def tcp_bytes_acked() -> int:
    """Bytes the far ends of this process's TCP connections have acknowledged, summed over the open ones."""
    try:
        fds = os.listdir(_FDS)
    except OSError:
        return 0  # no /proc: sent bytes are never seen, and requests' own progress decides alone
    total = 0
    for fd in fds:
        try:
            is_socket = os.readlink(f"{_FDS}/{fd}").startswith("socket:")
        except OSError:
            continue  # closed since it was listed
        if is_socket:
            total += _bytes_acked(int(fd))
    return total


def _bytes_acked(fd: int) -> int:
    """One socket's acknowledged bytes, read through a duplicate closed at once: the owner's descriptor is never
    touched (it may close it meanwhile). 0 when it is gone or no TCP socket."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return 0
    try:
        sock = socket.socket(fileno=duplicate)
    except OSError:  # the number was reused for a file since it was listed, and socket() keeps what it refuses
        os.close(duplicate)
        return 0
    with sock:
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except OSError:
            return 0  # a unix socket
    if len(info) < _BYTES_ACKED_AT + _BYTES_ACKED.size:
        return 0  # a kernel older than tcpi_bytes_acked
    return int(_BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0])


def _read_bytes(tid: str) -> int:
    """Bytes one thread has read, from sockets or files."""
    with open(f"{_TASKS}/{tid}/io") as io:
        fields = dict(line.split(": ", 1) for line in io.read().splitlines() if ": " in line)
    return int(fields["rchar"])


class CrtTraffic:
    """When the CRT's connections last moved a byte, either way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[str] = []
        self._counts = (-1, -1)  # (received by the event loops, acknowledged by the far ends)
        self._moved = time.monotonic()
        self._sampled = -math.inf

    def idle_s(self) -> float:
        """Seconds since the CRT last received a byte or had one it sent acknowledged, on any connection."""
        now = time.monotonic()
        with self._lock:
            if now - self._sampled >= SAMPLE_S:
                self._sampled = now
                counts = (self._sample_received(), tcp_bytes_acked())
                if any(not 0 <= count - last < MOVED_BYTES for count, last in zip(counts, self._counts, strict=True)):
                    self._counts, self._moved = counts, now
            return now - self._moved

    def _sample_received(self) -> int:
        # The event loops live as long as the process (one shared bootstrap): their ids are looked up again only
        # when one is gone or none was there yet.
        for _ in range(2):
            try:
                if self._threads:
                    return sum(_read_bytes(tid) for tid in self._threads)
            except (OSError, KeyError, ValueError):
                pass
            self._threads = _event_loop_threads()
        return self._counts[0]


TRAFFIC = CrtTraffic()
