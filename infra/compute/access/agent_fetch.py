"""A node fetches the agent's wheels it lacks over HTTP, before it has an agent: from its cluster's head
(infra.compute.access.agent_fanout) or from the run's store prefix by presigned URLs (infra.compute.access.agent_store).

FETCH (stdlib, run by the node's own Python): each file to a temp name beside its place, checked against the size and
sha256 of the bundle's manifest, then renamed into place; transient errors are retried with backoff, all within a
deadline. An answer that is final (other bytes, no such file, access refused) ends the fetch at once: the caller
then gets what is still missing elsewhere. The files and their URLs (a presigned URL is a credential), and the head's
token, travel in the environment, never on a command line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from infra.compute.access.agent_env import Fetched, json_line, one_line
from infra.compute.access.remote import RemoteError
from infra.compute.access.ssh.runner import SshRunner

log = logging.getLogger(__name__)

FILES_ENV = "TRAINPIPE_BUNDLE_FILES"  # {name: [size, sha256, url]}
TOKEN_ENV = "TRAINPIPE_BUNDLE_TOKEN"  # the head's per-bootstrap token (a bearer header); unset for presigned URLs
FETCH_TIMEOUT_S = 600.0  # one node's fetch of the whole bundle, retries included

# argv: bundle dir, seconds at most, what serves (for messages). Prints one JSON line: the bytes fetched and
# seconds, or an error (with the bytes fetched before it) and exit 3.
FETCH = r"""
import hashlib, http.client, json, os, sys, time, urllib.error, urllib.request

bundle, limit_s, source = sys.argv[1], float(sys.argv[2]), sys.argv[3]
wanted = json.loads(os.environ.pop("TRAINPIPE_BUNDLE_FILES"))
token = os.environ.pop("TRAINPIPE_BUNDLE_TOKEN", "")
headers = {"Authorization": "Bearer " + token} if token else {}
ATTEMPTS, FIRST_DELAY_S, READ_TIMEOUT_S = 4, 0.5, 30.0
started = time.monotonic()
deadline = started + limit_s

class Refused(Exception):
    pass  # the answer is final (not the manifest's bytes, no such file, refused): asking again cannot help

def left():
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise Refused(f"not done within {limit_s:.0f}s")
    return remaining

def get(name, size, sha256, url):
    tmp = os.path.join(bundle, f".{name}.{os.getpid()}.part")
    request = urllib.request.Request(url, headers=headers)
    digest, got = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(request, timeout=min(READ_TIMEOUT_S, left())) as answer, open(tmp, "wb") as out:
            offered = answer.headers.get("Content-Length")
            if offered is not None and int(offered) != size:
                raise Refused(f"{name}: {source} has {offered} bytes, the manifest {size}")
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

def fetch(name, size, sha256, url):
    for attempt in range(ATTEMPTS):
        try:
            return get(name, size, sha256, url)
        except urllib.error.HTTPError as exc:
            # Said without the URL: a presigned one is a credential.
            if exc.code < 500 and exc.code != 429:
                raise Refused(f"{name}: HTTP {exc.code} from {source}") from None
            problem = f"{name}: HTTP {exc.code} from {source}"
        except urllib.error.URLError as exc:
            problem = f"{name}: {type(exc.reason).__name__}: {exc.reason}"
        except (OSError, http.client.HTTPException) as exc:
            problem = f"{name}: {type(exc).__name__}: {exc}"
        delay = FIRST_DELAY_S * 2 ** attempt
        if attempt + 1 == ATTEMPTS or time.monotonic() + delay >= deadline:
            raise Refused(f"{problem} ({attempt + 1} attempts)")
        time.sleep(delay)

fetched = 0
try:
    os.makedirs(bundle, exist_ok=True)
    for name, (size, sha256, url) in sorted(wanted.items()):
        fetched += fetch(name, size, sha256, url)
except (Refused, OSError) as exc:
    print(json.dumps({"error": str(exc), "bytes": fetched, "seconds": round(time.monotonic() - started, 3)}))
    sys.exit(3)
print(json.dumps({"bytes": fetched, "seconds": round(time.monotonic() - started, 3)}))
"""


@dataclass(frozen=True)
class WantedFile:
    size: int
    sha256: str
    url: str


def fetch_files(runner: SshRunner, node_python: str, bundle_dir: str, wanted: dict[str, WantedFile], source: str,
                token: str | None = None) -> Fetched:
    """wanted into bundle_dir on runner's node from source (its name, for messages), each verified before it is
    renamed into place; a failure is told in Fetched.error, never raised."""
    files = {name: [file.size, file.sha256, file.url] for name, file in wanted.items()}
    env = {FILES_ENV: json.dumps(files), **({TOKEN_ENV: token} if token else {})}
    try:
        result = runner.run([node_python, "-c", FETCH, bundle_dir, str(FETCH_TIMEOUT_S), source], env=env,
                            timeout=FETCH_TIMEOUT_S + 60, check=False)
    except RemoteError as exc:
        return Fetched(0, 0.0, str(exc))
    found = json_line(result.output) or {}
    if result.returncode != 0 or "error" in found:
        problem = found.get("error") or one_line(result.output) or f"exit {result.returncode}"
        return Fetched(found.get("bytes", 0), found.get("seconds", 0.0), problem)
    log.info("%s: %.1f MB of the agent's wheels fetched from %s in %.1fs", runner.node_name, found["bytes"] / 1e6,
             source, found["seconds"])
    return Fetched(found["bytes"], found["seconds"])
