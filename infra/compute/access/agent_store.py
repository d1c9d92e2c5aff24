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
        self._problem: str | None = None  # why it serves nothing, once found

    def serves(self, bundle: Bundle) -> bool:
        """Any bundle, where the store can presign (asked once: a store that cannot is said once, and sent nothing)."""
        with self._lock:
            if self._problem is None and self._store is None:
                self._store = open_store(self.url)
                name, sha256 = next(iter(bundle.hashes.items()))
                try:
                    url = self._store.presigned_get(f"{sha256}/{name}", URL_TTL_S)
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
        """Each named file's presigned URL, the file put first where the store lacks it; None when the store cannot
        presign (the reason in _problem, logged the first time)."""
        if not self.serves(bundle):
            return None
        with self._lock:
            assert self._store is not None
            wanted = {}
            for name in names:
                key = f"{bundle.hashes[name]}/{name}"
                url = self._store.presigned_get(key, URL_TTL_S)  # asked first: a store that cannot is sent nothing
                if url is None:
                    self._problem = f"{self.url} gave no presigned URL for {key}"
                    return None
                self._publish(bundle, name, key)
                wanted[name] = WantedFile(bundle.size(name), bundle.hashes[name], url)
            return wanted

    def _publish(self, bundle: Bundle, name: str, key: str) -> None:
        assert self._store is not None
        if key in self._published:
            return
        size = bundle.size(name)
        found = self._store.head(key)
        if found is None or found.size != size:
            self._store.put_file(bundle.files[name], key)
            self.uploaded_bytes += size
        self._published.add(key)
