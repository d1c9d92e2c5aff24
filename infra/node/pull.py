"""`pull`: the training image on this node, pulled with the node's engine, and its digest reported (IMAGE_PULLED).

Started beside staging, so the image is there when training starts. An image the engine cannot pull but already
holds (built or imported on the node) is used as it is, said so in the event (local: true).
"""

from __future__ import annotations

import subprocess
import time

from infra.node.events import NodeEvent, emit, fail
from infra.node.protocol import NodeRequest, PullRequest, as_request
from infra.node.trainenv import TrainEnvError, resolve_engine

INSPECT_TIMEOUT_S = 60.0


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def digest(engine: str, image: str) -> str | None:
    """The image's registry digest (repo@sha256:...), or its local id when it came from no registry; None when the
    engine does not hold it."""
    found = subprocess.run([engine, "image", "inspect", "--format", "{{json .RepoDigests}} {{.Id}}", image],
                           capture_output=True, text=True, timeout=INSPECT_TIMEOUT_S, check=False)
    if found.returncode != 0:
        return None
    digests, _, image_id = found.stdout.strip().partition(" ")
    named = [d for d in (digests.strip("[]").replace('"', "").split(",")) if d]
    return named[0] if named else image_id.strip()


def main(request: NodeRequest) -> int:
    pulling = as_request(request, PullRequest)
    image = pulling.training_env.image
    assert image is not None
    try:
        engine = resolve_engine(pulling.training_env)
    except TrainEnvError as exc:
        return fail(f"{pulling.node}: cannot pull {image}: {exc}")
    started = time.monotonic()
    try:
        pulled = subprocess.run([engine, "pull", image], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=pulling.timeout_s, check=False)
        problem = None if pulled.returncode == 0 else _last_line(pulled.stderr or pulled.stdout)
    except subprocess.TimeoutExpired:
        problem = f"still pulling after {pulling.timeout_s:g}s"
    except OSError as exc:
        return fail(f"{pulling.node}: cannot pull {image}: {engine}: {exc.strerror}")
    found = digest(engine, image)
    if found is None:
        return fail(f"{pulling.node}: pulling {image} with {engine} failed ({problem}): check training.image and "
                    "that the node can reach its registry (and is logged in to it)")
    emit(NodeEvent.IMAGE_PULLED, image=image, digest=found, engine=engine, local=problem is not None,
         seconds=round(time.monotonic() - started, 3), **({"pull_error": problem} if problem else {}))
    return 0
