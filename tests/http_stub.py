"""Starting and stopping the HTTP(S) servers that stand in for a cloud's API in tests (tests/gce_server.py,
tests/azure_arm_server.py): on loopback, a port of the kernel's choosing, served from a daemon thread; and the stand-in
as a context manager."""

from __future__ import annotations

import ssl
import sys
import threading
from abc import ABC, abstractmethod
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

STOP_JOIN_S = 5.0


class StubServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client killed mid-request (tests kill orchestrators) is no error of the server's."""
        if not isinstance(sys.exc_info()[1], ConnectionError | ssl.SSLError):
            super().handle_error(request, client_address)


class Served:
    """One running server and the thread serving it."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], name: str, tls: ssl.SSLContext | None = None) -> None:
        self.httpd = StubServer(("127.0.0.1", 0), handler)
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=name, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=STOP_JOIN_S)


class StandIn(ABC):
    """A stand-in cloud API as a context manager: started on entry, stopped on exit."""

    @abstractmethod
    def start(self) -> Self: ...

    @abstractmethod
    def stop(self) -> None: ...

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
