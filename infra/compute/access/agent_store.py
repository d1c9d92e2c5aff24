"""The agent's wheels from the run's store prefix, as the job's code travels: the orchestrator puts each file the
prefix lacks under <run prefix>/_agent/<sha256>/<name> (content-keyed, so a rerun or a second cluster of the run sends
nothing again), and a node fetches them by presigned URLs with its own Python, before it has an agent or any
credential of the store. A cloud cluster's head fetches them this way and serves its peers (agent_fanout); an SSH
host fetches its own.

A store that cannot presign (file://, a GCS identity without a signing key, an Azure SAS) serves nothing: the nodes
get their wheels from the orchestrator as without it, said once per run. The URLs are credentials: they travel in
the fetch's environment, never in a message or on a command line.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from infra.compute.access.agent_env import Bundle, Fetched
from infra.compute.access.agent_fetch import FETCH_TIMEOUT_S, WantedFile, fetch_files
from infra.compute.access.ssh.runner import SshRunner
from infra.storage import open_store
from infra.storage.base import ObjectStore, StorageError, redact

log = logging.getLogger(__name__)

AGENT_PREFIX = "_agent"  # under the run's checkpoint prefix, beside _code
# A URL outlives the fetches it serves: a bootstrap's nodes fetch within FETCH_TIMEOUT_S of asking, and one is asked
# again for every node that lacks files.
URL_TTL_S = 2 * FETCH_TIMEOUT_S + 600
URL_REUSE_S = FETCH_TIMEOUT_S + 300  # a URL handed out has at least this much of its life left: one fetch and more
PUBLISH_WORKERS = 8


def agent_store_url(run_prefix: str) -> str:
    return f"{run_prefix.rstrip('/')}/{AGENT_PREFIX}"


class StoreSource:
    """The run's store prefix as an agent_env.BundleSource: it serves any bundle, putting a file there the first time
    a node lacks it."""

    from_store = True

    def __init__(self, url: str) -> None:
        """url: where the files go (agent_store_url of the run's prefix)."""
        self.node_name = f"the store ({redact(url)})"
        self.url = url
        self.uploaded_bytes = 0  # what this orchestrator put there (a file already there is not sent again)
        self._store: ObjectStore | None = None
        self._lock = threading.Lock()
        self._published: set[str] = set()  # keys known to be in the store
        self._signed: dict[str, tuple[str, float]] = {}  # key: its presigned URL and when it was made (monotonic)
        self._problem: str | None = None  # why it serves nothing, once found

    def serves(self, bundle: Bundle) -> bool:
        """Any bundle, where the store can presign (asked once: a store that cannot is said once, and sent nothing)."""
        with self._lock:
            if self._problem is None and self._store is None:
                self._store = open_store(self.url)
                name = next(iter(bundle.hashes))
                try:
                    url = self._presigned(bundle, name)
                except (StorageError, OSError) as exc:  # e.g. an identity refused a user delegation key
                    self._problem = f"no presigned URL could be made: {exc}"
                else:
                    self._problem = None if url is not None else (
                        f"a {self._store.scheme}:// store gives no presigned URLs (or its credentials cannot sign "
                        "them)")
                if self._problem is not None:
                    log.info("the agent's wheels do not go through %s: %s; they are copied from here",
                             self.node_name, self._problem)
            return self._problem is None

    def fetch(self, runner: SshRunner, node_python: str, bundle: Bundle, bundle_dir: str, names: list[str]
              ) -> Fetched:
        try:
            wanted = self._urls(bundle, names)
        except (StorageError, OSError) as exc:
            return Fetched(0, 0.0, f"the wheels could not be put there: {exc}")
        if wanted is None:
            return Fetched(0, 0.0, self._problem)
        return fetch_files(runner, node_python, bundle_dir, wanted, self.node_name)

    def _urls(self, bundle: Bundle, names: list[str]) -> dict[str, WantedFile] | None:
        """Each named file's presigned URL, the files the store lacks put first (PUBLISH_WORKERS at a time: a
        bundle is ~20 files, most of them small, each a round trip or two); None when the store cannot presign (the
        reason in _problem, logged the first time). The lock holds a second node's call until the files are there."""
        if not self.serves(bundle):
            return None
        with self._lock:
            urls = {}
            for name in names:  # asked first: a store that cannot is sent nothing
                url = self._presigned(bundle, name)
                if url is None:
                    self._problem = f"{self.url} gave no presigned URL for {_key(bundle, name)}"
                    return None
                urls[name] = url
            missing = [name for name in names if _key(bundle, name) not in self._published]
            if missing:
                with ThreadPoolExecutor(max_workers=min(PUBLISH_WORKERS, len(missing)),
                                        thread_name_prefix="agent-store") as pool:
                    for name, sent in zip(missing, pool.map(lambda n: self._publish(bundle, n), missing),
                                          strict=True):
                        self.uploaded_bytes += sent
                        self._published.add(_key(bundle, name))
            return {name: WantedFile(bundle.size(name), bundle.hashes[name], url) for name, url in urls.items()}

    def _presigned(self, bundle: Bundle, name: str) -> str | None:
        """The file's URL, made again only once less than URL_REUSE_S of its life is left (the probe's URL serves
        the first fetch, and every node of a bootstrap gets the same)."""
        assert self._store is not None
        key = _key(bundle, name)
        made = self._signed.get(key)
        if made is not None and time.monotonic() - made[1] < URL_TTL_S - URL_REUSE_S:
            return made[0]
        url = self._store.presigned_get(key, URL_TTL_S)
        if url is not None:
            self._signed[key] = (url, time.monotonic())
        return url

    def _publish(self, bundle: Bundle, name: str) -> int:
        """Put the file where the store lacks it (or holds other bytes); the bytes sent."""
        assert self._store is not None
        key, size = _key(bundle, name), bundle.size(name)
        found = self._store.head(key)
        if found is not None and found.size == size:
            return 0
        self._store.put_file(bundle.files[name], key)
        return size


def _key(bundle: Bundle, name: str) -> str:
    return f"{bundle.hashes[name]}/{name}"
