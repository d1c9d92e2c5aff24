"""A port free on this node now, for a server a node command starts (rendezvous, a peer server, a bench)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A port free on host (every address: "") now; whoever binds it next may race another process for it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
