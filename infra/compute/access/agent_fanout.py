"""The agent's bundle sent once per cluster: the orchestrator copies it to the head node, and the other nodes fetch
the files they lack from the head over the cluster network, so the orchestrator's uplink carries one copy of the
wheels (~66 MB), not one per node.

On the head (stdlib, run by the head's own Python: the agent's env may not be made yet): SERVE, an HTTP server of the
bundle dir alone (GET/HEAD of the wheel files it held when it started, nothing else, nothing written), bound to the
head's cluster address (Node.cluster_address, what peer-serve binds) on a port it picks itself, answering only
requests that carry the per-bootstrap token (which travels in the environment, never on a command line). It is
started the first time a node lacks a file, stopped when the bootstrap ends, and ends on its own at a deadline that
covers the bootstrap's own bounds, should the orchestrator be gone.

On each other node: FETCH, each missing file to a temp name beside its place, checked against the size and sha256 of
the bundle's manifest, then renamed into place; transient errors are retried with backoff, all within a deadline. A
file the head holds with other bytes (or a head that cannot be reached) ends the fetch: the node then copies what it
still lacks from the orchestrator, as without a head (agent_env.ensure_agent logs why).
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from infra.cancel import CANCEL
from infra.compute.access.agent_env import (
    AgentEnvError,
    Fetched,
    NodeBundle,
    copy_files,
    json_line,
    node_bundle,
    one_line,
)
from infra.compute.access.remote import Process, RemoteError
from infra.compute.access.ssh.runner import SshRunner

log = logging.getLogger(__name__)

TOKEN_ENV = "TRAINPIPE_BUNDLE_TOKEN"
SERVER_MARKER = "trainpipe-agent-bundle-server"  # in SERVE's first line: the server's command line names it
FETCH_TIMEOUT_S = 600.0  # one node's fetch of the whole bundle, retries included
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

# argv: head URL, bundle dir, {name: [size, sha256]} (JSON), seconds at most. Prints one JSON line: the bytes fetched
# and seconds, or an error (with the bytes fetched before it) and exit 3.
FETCH = r"""
import hashlib, http.client, json, os, sys, time, urllib.error, urllib.request

url, bundle, wanted, limit_s = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
headers = {"Authorization": "Bearer " + os.environ.pop("TRAINPIPE_BUNDLE_TOKEN")}
ATTEMPTS, FIRST_DELAY_S, READ_TIMEOUT_S = 4, 0.5, 30.0
started = time.monotonic()
deadline = started + limit_s

class Refused(Exception):
    pass  # the head's answer is final (not the manifest's bytes, no such file): asking again cannot help

def left():
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise Refused(f"not done within {limit_s:.0f}s")
    return remaining

def get(name, size, sha256):
    tmp = os.path.join(bundle, f".{name}.{os.getpid()}.part")
    request = urllib.request.Request(f"{url}/{name}", headers=headers)
    digest, got = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(request, timeout=min(READ_TIMEOUT_S, left())) as answer, open(tmp, "wb") as out:
            offered = answer.headers.get("Content-Length")
            if offered is not None and int(offered) != size:
                raise Refused(f"{name}: the head has {offered} bytes, the manifest {size}")
            while chunk := answer.read(1 << 20):
                left()
                got += len(chunk)
                digest.update(chunk)
                out.write(chunk)
        if got != size:
            raise ConnectionError(f"{name}: {got} of {size} bytes came")
        if digest.hexdigest() != sha256:
            raise Refused(f"{name}: sha256 {digest.hexdigest()} is not the manifest's {sha256}")
        os.replace(tmp, os.path.join(bundle, name))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return size

def fetch(name, size, sha256):
    for attempt in range(ATTEMPTS):
        try:
            return get(name, size, sha256)
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                raise Refused(f"{name}: HTTP {exc.code} from the head") from None
            problem = f"{name}: HTTP {exc.code} from the head"
        except (OSError, http.client.HTTPException) as exc:
            problem = f"{name}: {type(exc).__name__}: {exc}"
        delay = FIRST_DELAY_S * 2 ** attempt
        if attempt + 1 == ATTEMPTS or time.monotonic() + delay >= deadline:
            raise Refused(f"{problem} ({attempt + 1} attempts)")
        time.sleep(delay)

fetched = 0
try:
    os.makedirs(bundle, exist_ok=True)
    for name, (size, sha256) in sorted(wanted.items()):
        fetched += fetch(name, size, sha256)
except (Refused, OSError) as exc:
    print(json.dumps({"error": str(exc), "bytes": fetched, "seconds": round(time.monotonic() - started, 3)}))
    sys.exit(3)
print(json.dumps({"bytes": fetched, "seconds": round(time.monotonic() - started, 3)}))
"""


def url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class HeadSource:
    """The head's bundle files served to the other nodes of its cluster (an agent_env.BundleSource). The server is
    started the first time a node lacks a file (nodes that have every file cost the head nothing) and stopped by
    stop(); serve_s bounds it on the head should stop() never come."""

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

    def fetch(self, runner: SshRunner, node_python: str, bundle_dir: str, files: dict[str, tuple[int, str]]
              ) -> Fetched:
        url = self._serving()
        if url is None:
            return Fetched(0, 0.0, self._problem)
        argv = [node_python, "-c", FETCH, url, bundle_dir, json.dumps(files), str(FETCH_TIMEOUT_S)]
        try:
            result = runner.run(argv, env={TOKEN_ENV: self._token}, timeout=FETCH_TIMEOUT_S + 60, check=False)
        except RemoteError as exc:
            return Fetched(0, 0.0, str(exc))
        found = json_line(result.output) or {}
        if result.returncode != 0 or "error" in found:
            problem = found.get("error") or one_line(result.output) or f"exit {result.returncode}"
            return Fetched(found.get("bytes", 0), found.get("seconds", 0.0), problem)
        log.info("%s: %.1f MB of the agent's wheels fetched from %s in %.1fs", runner.node_name,
                 found["bytes"] / 1e6, self.node_name, found["seconds"])
        return Fetched(found["bytes"], found["seconds"])

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


def head_source(runner: SshRunner, node_python: str, agent_root: str, address: str, serve_s: float,
                stock: bool) -> tuple[HeadSource | None, int]:
    """The head as its cluster's source of the bundle, and the bytes copied to it. stock: copy the files it lacks
    from here first (a launch); otherwise (a replacement beside a surviving head) the head serves only when it holds
    every file already, and None says it does not."""
    found = node_bundle(runner, node_python, agent_root)
    missing = found.missing()
    if missing and not stock:
        log.info("%s: lacks %d of the agent's wheels: the new nodes get theirs from here", runner.node_name,
                 len(missing))
        return None, 0
    started = time.monotonic()
    copied = copy_files(runner, found.bundle, found.dir, missing)
    if copied:
        log.info("%s: %.1f MB of the agent's wheels copied to the head in %.1fs, for its peers too", runner.node_name,
                 copied / 1e6, time.monotonic() - started)
    return HeadSource(runner, node_python, found, address, serve_s), copied


class PendingSource:
    """The head's HeadSource while the nodes are bootstrapped in parallel: the head's bootstrap publishes it once the
    head holds the wheels (publish), while the other nodes wait for their boot and then for it (wait, bounded)."""

    def __init__(self, head_name: str, wait_s: float) -> None:
        self.head_name = head_name
        self.copied = 0  # bytes copied to the head to serve them
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

    def publish(self, source: HeadSource | None, copied: int) -> None:
        """What head_source returned: the head's source (None: it holds too few of the wheels) and the bytes copied
        to it."""
        self.copied = copied
        self._publish(source, "it lacks some of the agent's wheels")

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
