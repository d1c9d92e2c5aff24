"""`netbench`: node-to-node TCP throughput with parallel streams (what iperf3 -P measures, in plain Python).

    NetbenchRequest(mode="server", streams=4)
    NetbenchRequest(mode="client", host="10.0.0.2", port=PORT, streams=4, seconds=3)

The server listens on a free port and says which in a `netbench-listening` event, takes exactly `streams`
connections and counts what arrives on each. Every client stream sends until the time (or its share of `bytes`) is
up, half-closes, and waits for the server's count of what it received: the client's clock therefore stops only
when the data is on the other node, not when it left this one's socket buffer.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from infra.node.events import NodeEvent, emit, fail
from infra.node.protocol import NetbenchRequest, NodeRequest, as_request

BUFFER = 4 * 1024 * 1024  # per sendall / recv_into: large calls keep the per-call Python overhead negligible
ACK = struct.Struct("!Q")  # the server's byte count for one stream, sent back after that stream's EOF


class NetbenchError(RuntimeError):
    pass


def _set_socket_buffers(sock: socket.socket, kilobytes: int) -> None:
    # 0 leaves Linux's autotuning on: an explicit SO_SNDBUF/SO_RCVBUF is capped at net.core.[rw]mem_max (often
    # 208 KB) and turns autotuning off, which would throttle exactly the long fat links this measures.
    if kilobytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, kilobytes * 1024)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, kilobytes * 1024)


def _run_threads(targets: list[Callable[[], None]]) -> None:
    """Run one thread per target; the first error any of them raised is raised here, after all have ended."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # re-raised below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


# -- server -------------------------------------------------------------------------------------------------


def listen(bind: str, port: int, backlog: int) -> socket.socket:
    if not bind and socket.has_dualstack_ipv6():
        # Both families on one socket: the client may reach this node by an IPv4 or an IPv6 address.
        return socket.create_server(("", port), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=True)
    return socket.create_server((bind, port), backlog=backlog)


def receive(conn: socket.socket, counts: list[int], index: int) -> None:
    buffer = memoryview(bytearray(BUFFER))
    received = 0
    with conn:
        while n := conn.recv_into(buffer):
            received += n
        counts[index] = received
        conn.sendall(ACK.pack(received))


def serve(server: socket.socket, streams: int, timeout_s: float, sockbuf_kb: int) -> tuple[int, float]:
    """Accept `streams` connections and drain them; total bytes and seconds from the first accept to the last EOF."""
    server.settimeout(timeout_s)
    counts = [0] * streams
    conns: list[socket.socket] = []
    started = 0.0
    try:
        for _ in range(streams):
            conn, _ = server.accept()
            started = started or time.perf_counter()
            conn.settimeout(timeout_s)
            _set_socket_buffers(conn, sockbuf_kb)
            conns.append(conn)
    except TimeoutError:
        for conn in conns:
            conn.close()
        raise NetbenchError(f"{len(conns)} of {streams} streams connected within {timeout_s:.0f}s: check that the "
                            "client node can reach this one on the port (firewall, security group)") from None
    _run_threads([lambda i=i, c=c: receive(c, counts, i) for i, c in enumerate(conns)])
    return sum(counts), time.perf_counter() - started


# -- client -------------------------------------------------------------------------------------------------


def send(sock: socket.socket, payload: memoryview, deadline: float, quota: int | None) -> int:
    """Send until the deadline (or the quota), half-close, and return what the server says it received."""
    sent = 0
    with sock:
        while (quota is None and time.perf_counter() < deadline) or (quota is not None and sent < quota):
            chunk = payload if quota is None else payload[: min(len(payload), quota - sent)]
            sock.sendall(chunk)
            sent += len(chunk)
        sock.shutdown(socket.SHUT_WR)
        ack = bytearray()
        while len(ack) < ACK.size:
            part = sock.recv(ACK.size - len(ack))
            if not part:
                raise NetbenchError("the server closed the stream before acknowledging it")
            ack += part
    received = ACK.unpack(ack)[0]
    if received != sent:
        raise NetbenchError(f"sent {sent} bytes on a stream, the server received {received}")
    return received


def run_client(host: str, port: int, streams: int, seconds: float | None, total_bytes: int | None,
               timeout_s: float, sockbuf_kb: int) -> tuple[int, float]:
    socks = []
    try:
        for _ in range(streams):
            sock = socket.create_connection((host, port), timeout=timeout_s)
            _set_socket_buffers(sock, sockbuf_kb)
            socks.append(sock)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    payload = memoryview(os.urandom(BUFFER))  # random: a compressing path cannot flatter the figure
    quota = None if total_bytes is None else -(-total_bytes // streams)
    results = [0] * streams
    started = time.perf_counter()
    deadline = started + (seconds or 0.0)

    def stream(index: int, sock: socket.socket) -> None:
        results[index] = send(sock, payload, deadline, quota)

    _run_threads([lambda i=i, s=s: stream(i, s) for i, s in enumerate(socks)])
    return sum(results), time.perf_counter() - started


def gbit_per_s(total: int, seconds: float) -> float:
    return round(total * 8 / 1e9 / max(seconds, 1e-9), 3)


def main(request: NodeRequest) -> int:
    bench = as_request(request, NetbenchRequest)
    if bench.mode == "server":
        return _server(bench)
    try:
        total, seconds = run_client(bench.host or "", bench.port, bench.streams, bench.seconds, bench.bytes,
                                    bench.timeout_s, bench.sockbuf_kb)
    except (OSError, NetbenchError) as exc:
        return fail(f"netbench client: to {bench.host}:{bench.port}: {exc}")
    emit(NodeEvent.NETBENCH, host=bench.host, port=bench.port, streams=bench.streams, bytes=total,
         seconds=round(seconds, 4), gbps=gbit_per_s(total, seconds))
    return 0


def _server(bench: NetbenchRequest) -> int:
    try:
        server = listen(bench.bind, bench.port, bench.streams)
    except OSError as exc:
        return fail(f"netbench server: cannot listen on {bench.bind or '*'}:{bench.port} ({exc.strerror or exc})")
    with server:
        emit(NodeEvent.NETBENCH_LISTENING, port=server.getsockname()[1], streams=bench.streams)
        try:
            total, seconds = serve(server, bench.streams, bench.timeout_s, bench.sockbuf_kb)
        except (OSError, NetbenchError) as exc:
            return fail(f"netbench server: {exc}")
    emit(NodeEvent.NETBENCH_SERVER, streams=bench.streams, bytes=total, seconds=round(seconds, 4),
         gbps=gbit_per_s(total, seconds))
    return 0
