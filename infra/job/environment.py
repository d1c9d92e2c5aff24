"""The training environment of a job on a node (infra.node.protocol.TrainingEnvironment): where its setup, torchrun
with the script and evaluate run.

training.image: a container (PYXIS or OCI on a Slurm cluster with cluster.slurm.containers); training.python: that
interpreter on the host; neither: the node's own Python (Node.node_python). The container sees the node's dirs at the
same paths, and the node's GPUs when the job asks for an accelerator.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from infra.compute.providers.base import Cluster, Node
from infra.job.spec import JobSpec
from infra.node.protocol import EnvironmentKind, TrainingEnvironment

IMAGE_PYTHON = "python3"  # the interpreter a container image is run with (an NGC PyTorch image's, a pod image's)


def node_mounts(node: Node) -> tuple[str, ...]:
    """The node's dirs the training reads and writes (its workdir holds the code, the inputs, the logs), each once:
    a dir below another is mounted with it."""
    dirs = sorted({d.rstrip("/") or "/" for d in (node.workdir, node.data_dir, node.ckpt_dir)})
    kept: list[str] = []
    for d in dirs:
        if not any(d == k or d.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(d)
    return tuple(kept)


def environment_kind(job: JobSpec) -> EnvironmentKind:
    if job.training.image is None:
        return EnvironmentKind.HOST
    if job.cluster.provider == "slurm" and job.cluster.slurm.containers is not None:
        return EnvironmentKind(job.cluster.slurm.containers)
    return EnvironmentKind.CONTAINER


def training_environment(job: JobSpec, cluster: Cluster, node: Node) -> TrainingEnvironment:
    """Where job's training runs on node."""
    kind = environment_kind(job)
    training = job.training
    python = IMAGE_PYTHON if training.image is not None else training.python or node.node_python
    return TrainingEnvironment(
        kind=kind, python=python, image=training.image, engine=training.engine, mounts=node_mounts(node),
        gpus=job.cluster.accelerator is not None, node_dir=node.workdir.rstrip("/") or "/",
        name=re.sub(r"[^A-Za-z0-9_.-]", "-", f"trainpipe-{cluster.name}-{node.name}"))


def env_names(env: Mapping[str, str]) -> tuple[str, ...]:
    """The names of a training command's variables (TRAINPIPE_*, the job's env and secrets): what a container gets."""
    return tuple(sorted(env))
