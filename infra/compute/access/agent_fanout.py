"""The agent's bundle sent once per cluster: the head gets it from the run's store prefix (agent_store) or, where the
store cannot serve it, from the orchestrator, and the other nodes fetch the files they lack from the head over the
cluster network, so the orchestrator's uplink carries at most one copy of the wheels (~66 MB), not one per node.

On the head (stdlib, run by the head's own Python: the agent's env may not be made yet): SERVE, an HTTP server of the
bundle dir alone (GET/HEAD of the wheel files it held when it started, nothing else, nothing written), bound to the
head's cluster address (Node.cluster_address, what peer-serve binds) on a port it picks itself, answering only
requests that carry the per-bootstrap token (which travels in the environment, never on a command line). It is
started the first time a node lacks a file, stopped when the bootstrap ends, and ends on its own at a deadline that
covers the bootstrap's own bounds, should the orchestrator be gone.

On each other node: agent_fetch.FETCH of the files it lacks, each verified by size and sha256. A file the head holds
with other bytes (or a head that cannot be reached) ends the fetch: the node then gets what it still lacks from the
store, else from the orchestrator, as without a head (agent_env.fetch_missing logs why).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from infra.cancel import CANCEL
from infra.compute.access.agent_env import (
    AgentEnvError,
    Bundle,
    BundleSource,
    Counted,
    Fetched,
    NodeBundle,
    copy_files,
    fetch_missing,
    json_line,
    node_bundle,
    one_line,
)
from infra.compute.access.agent_fetch import TOKEN_ENV, WantedFile, fetch_files
from infra.compute.access.remote import Process, RemoteError
from infra.compute.access.ssh.runner import SshRunner

log = logging.getLogger(__name__)

SERVER_MARKER = "trainpipe-agent-bundle-server"  # in SERVE's first line: the server's command line names it
START_TIMEOUT_S = 120.0  # from starting SERVE to its port line: one python start on a loaded node
STOP_GRACE_S = 5.0

# argv: bundle dir, address to bind, seconds to serve at most. Prints {"port": N} once listening.
SERVE = f"# {SERVER_MARKER}\n" + r"""
import hmac, json, os, shutil, socket, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

root, host, serve_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
expected = "Bearer " + os.environ.pop("TRAINPIPE_BUNDLE_TOKEN")
# What it held at start, by name: no path a request names can reach anything else.
names = {n for n in os.listdir(root) if n.endswith(".whl") and not n.startswith(".")}

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.answer(True)

    def do_HEAD(self):
        self.answer(False)

    def answer(self, body):
        name = self.path.lstrip("/")
        if not hmac.compare_digest(self.headers.get("Authorization", ""), expected):
            return self.send_error(403)
        if name not in names:
            return self.send_error(404)
        try:
            handle = os.fdopen(os.open(os.path.join(root, name), os.O_RDONLY | os.O_NOFOLLOW), "rb")
        except OSError:
            return self.send_error(404)
        with handle:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(os.fstat(handle.fileno()).st_size))
            self.end_headers()
            if body:
                shutil.copyfileobj(handle, self.wfile, 1 << 20)

class Server(ThreadingHTTPServer):
    daemon_threads = True
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

server = Server((host, 0), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(json.dumps({"port": server.server_address[1]}), flush=True)
# Stopped by the orchestrator (SIGTERM to its group); this bound holds should the orchestrator be gone.
threading.Event().wait(serve_s)
"""

def url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class HeadSource:
    """The head's bundle files served to the other nodes of its cluster (an agent_env.BundleSource). The server is
    started the first time a node lacks a file (nodes that have every file cost the head nothing) and stopped by
    stop(); serve_s bounds it on the head should stop() never come."""

    from_store = False

    def __init__(self, runner: SshRunner, node_python: str, found: NodeBundle, address: str, serve_s: float) -> None:
        self.node_name = runner.node_name
        self.content = found.bundle.content
        self._runner = runner
        self._argv = [node_python, "-c", SERVE, found.dir, address, str(serve_s)]
        self._address = address
        self._token = secrets.token_urlsafe(24)  # per bootstrap: only this cluster's bootstrap reads the bundle
        self._lock = threading.Lock()
        self._process: Process | None = None
        self._url: str | None = None
        self._problem: str | None = None  # why it serves nothing: it could not start, or it was stopped

    def serves(self, bundle: Bundle) -> bool:
        return bundle.content == self.content

    def fetch(self, runner: SshRunner, node_python: str, bundle: Bundle, bundle_dir: str, names: list[str]
              ) -> Fetched:
        url = self._serving()
        if url is None:
            return Fetched(0, 0.0, self._problem)
        wanted = {name: WantedFile(bundle.size(name), bundle.hashes[name], f"{url}/{name}") for name in names}
        return fetch_files(runner, node_python, bundle_dir, wanted, self.node_name, self._token)

    def _serving(self) -> str | None:
        """The server's URL, started on the first call; None (the reason in _problem) when it could not start."""
        with self._lock:
            if self._url is None and self._problem is None:
                try:
                    self._url = self._start()
                    log.info("%s: serving the agent's wheels to its peers at %s", self.node_name, self._url)
                except (AgentEnvError, RemoteError) as exc:
                    self._problem = str(exc)
            return self._url

    def _start(self) -> str:
        lines: queue.Queue[str] = queue.Queue()
        self._process = self._runner.start(self._argv, env={TOKEN_ENV: self._token}, on_line=lines.put)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                found = json_line(lines.get(timeout=0.2))
            except queue.Empty:
                found = None
            if found is not None and "port" in found:
                return f"http://{url_host(self._address)}:{found['port']}"
            if self._process.poll() is not None and lines.empty():
                raise AgentEnvError(f"{self.node_name}: the agent's file server exited {self._process.poll()} on "
                                    f"{self._address}: {one_line(self._process.tail()) or 'no output'}")
        raise AgentEnvError(f"{self.node_name}: the agent's file server named no port within {START_TIMEOUT_S:.0f}s")

    def stop(self) -> None:
        """End the server, if it was started (it is gone from the head when this returns, or logged as left), and
        start none after: a node still asking copies from the orchestrator."""
        with self._lock:
            process, self._process = self._process, None
            self._url, self._problem = None, "the bootstrap that served it ended"
        if process is None:
            return
        if process.terminate(grace_s=STOP_GRACE_S) is None:
            log.warning("%s: the agent's file server did not end: it ends by itself at its deadline",
                        self.node_name)


@dataclass(frozen=True)
class Stocked:
    """The head as its cluster's source of the bundle (None: it holds too few of the wheels to serve), and how its
    files got there: copied from here, or fetched from the run's store prefix."""

    source: HeadSource | None
    copied: int = 0
    store_bytes: int = 0


def head_source(runner: SshRunner, node_python: str, agent_root: str, address: str, serve_s: float,
                stock: bool, store: BundleSource | None = None) -> Stocked:
    """The head as its cluster's source of the bundle. stock: get the files it lacks first (a launch), from store
    when given, what is left copied from here; otherwise (a replacement beside a surviving head) the head serves only
    when it holds every file already."""
    found = node_bundle(runner, node_python, agent_root)
    missing = found.missing()
    if missing and not stock:
        log.info("%s: lacks %d of the agent's wheels: the new nodes get theirs from elsewhere", runner.node_name,
                 len(missing))
        return Stocked(None)
    started = time.monotonic()
    fetched = Counted()
    if missing and store is not None:
        found, fetched = fetch_missing(runner, node_python, found, [store])
    copied = copy_files(runner, found.bundle, found.dir, found.missing())
    if copied or fetched.store:
        log.info("%s: the head has the agent's wheels for its peers too in %.1fs (%.1f MB from the store, %.1f MB "
                 "copied from here)", runner.node_name, time.monotonic() - started, fetched.store / 1e6, copied / 1e6)
    return Stocked(HeadSource(runner, node_python, found, address, serve_s), copied, fetched.store)


class PendingSource:
    """The head's HeadSource while the nodes are bootstrapped in parallel: the head's bootstrap publishes it once the
    head holds the wheels (publish), while the other nodes wait for their boot and then for it (wait, bounded)."""

    def __init__(self, head_name: str, wait_s: float) -> None:
        self.head_name = head_name
        self.stocked = Stocked(None)  # how the head got the wheels it serves
        self._wait_s = wait_s
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._source: HeadSource | None = None
        self._problem = ""
        self._stopped = False

    @contextmanager
    def publishing(self) -> Iterator[None]:
        """Around the head's side until it publishes: a failure in it publishes no source (the nodes waiting are told
        why) and is raised, to the head's own bootstrap."""
        try:
            yield
        except BaseException as exc:
            self._publish(None, f"its wheels could not be made ready there: {one_line(str(exc)) or type(exc).__name__}")
            raise
        finally:
            if not self._ready.is_set():
                self._publish(None, "the head's bootstrap published none")

    def publish(self, stocked: Stocked) -> None:
        """What head_source returned."""
        self.stocked = stocked
        self._publish(stocked.source, "it lacks some of the agent's wheels")

    def _publish(self, source: HeadSource | None, problem: str) -> None:
        with self._lock:
            self._source, self._problem = source, problem
            stopped = self._stopped
        if stopped and source is not None:
            source.stop()
        self._ready.set()

    def wait(self, node_name: str) -> HeadSource | None:
        """The head's source once published; None when there is none or it is not ready within the bound (why is
        logged: the node copies its wheels from the orchestrator)."""
        deadline = time.monotonic() + self._wait_s
        while not self._ready.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            CANCEL.check()
            if time.monotonic() >= deadline:
                log.warning("%s: %s was not ready to serve the agent's wheels within %.0fs: copying them from here",
                            node_name, self.head_name, self._wait_s)
                return None
        if self._source is None:
            log.warning("%s: %s serves no agent wheels (%s): copying them from here", node_name, self.head_name,
                        self._problem)
        return self._source

    def stop(self) -> None:
        """Stop the head's server; a source published after this serves nothing."""
        with self._lock:
            self._stopped = True
            source = self._source
        if source is not None:
            source.stop()
