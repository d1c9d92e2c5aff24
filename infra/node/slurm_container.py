"""The srun prefix that runs a training command in a Slurm site's container, from inside the node agent's own step.

The agent is one job step of the cluster's allocation on its node; the training is a second step on the same node
(`srun --overlap` shares the allocation's resources with the agent's step) whose one task runs in the user's image:
- PYXIS: the image by Pyxis and enroot (`--container-image`), the node dirs mounted at the same paths
  (`--container-mounts=SRC:SRC,...`), the working dir set (`--container-workdir`);
- OCI: Slurm's own OCI containers (oci.conf on the node runs runc or another OCI runtime): `--container=<bundle>`.
  slurmstepd reads the bundle's config.json, replaces its process args with the step's command, appends the
  step's environment to its process env, points root.path at <bundle>/rootfs and runs the runtime on the result.
  It mounts nothing of the node's (22.05 has no option for it) and leaves the working dir as the bundle says, and
  runc refuses a rootfs behind a symlink, so trainpipe cannot run a copy of the bundle with a config of its own:
  the site's bundle must bind-mount the node's trainpipe dir at the same path and share the node's network (as the
  docker and podman containers do: torchrun's rendezvous and the ranks' gloo and NCCL connections bind the node's
  addresses). checked_bundle says in one line when it does not; derive_config makes such a config from `runc
  spec`'s. The command starts under a `/bin/sh -c` of the image's that sets the image's PATH and the working dir.
Either way `--export=ALL` hands the step the caller's environment (the TRAINPIPE_* variables, the secrets): srun
reads it from its own environment, so none of it is on a command line, and srun's stdin reaches the task's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from infra.node.protocol import EnvironmentKind, TrainingEnvironment

# The bundle's namespaces the training must not have: the node's network (rendezvous, gloo, NCCL on the node's
# addresses), IPC (NCCL's shared memory between ranks) and hostname (what torchrun reports of each node).
HOST_NAMESPACES = frozenset({"network", "ipc", "uts"})  # derive_config drops them
# The node's name resolution, as docker's --network host gives it: the node's hostname must resolve in the container
# (torch's c10d store and gloo look their own address up by it).
HOST_FILES = ("/etc/hosts", "/etc/resolv.conf")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # a bundle's that names none
# What runs first in the container: slurmstepd appends the step's environment (the node's PATH among it) after the
# bundle's own, and runc looks the command up with the last PATH, so `python3` would be the node's name for it, not
# the image's; and the process starts in the bundle's process.cwd, whatever srun's --chdir.
IN_CONTAINER = 'export PATH="$1"; cd "$2" || exit 126; shift 2; exec "$@"'


class SlurmContainerError(ValueError):
    """A training environment this module cannot run: not a Slurm container kind, a value srun would misread, or an
    OCI bundle that is missing or unreadable."""


def container_prefix(environment: TrainingEnvironment, node: str, cwd: str | None) -> list[str]:
    """The argv prefix (up to and without the command) that runs a command in environment's container on node, as
    one more step of the allocation the calling process runs in (its SLURM_JOB_ID). For OCI the bundle's config is
    checked on this node first."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        raise SlurmContainerError("SLURM_JOB_ID is not set: a Slurm container is started from the node agent's job "
                                  "step (provider slurm), which has it")
    step = ["srun", "--overlap", f"--jobid={job}", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--export=ALL",
            "--quiet"]
    if environment.kind is EnvironmentKind.PYXIS:
        return [*step, *pyxis_options(environment, cwd)]
    if environment.kind is EnvironmentKind.OCI:
        bundle, path = checked_bundle(environment)
        return [*step, f"--container={bundle}", "/bin/sh", "-c", IN_CONTAINER, "trainpipe-oci", path, cwd or "."]
    raise SlurmContainerError(f"training environment kind {environment.kind.value} is not a Slurm container: "
                              "container_prefix takes pyxis or oci")


def pyxis_options(environment: TrainingEnvironment, cwd: str | None) -> list[str]:
    """Pyxis's srun options: the image, the node dirs mounted at the same paths, the working dir."""
    options = [f"--container-image={environment.image}"]
    for mount in environment.mounts:
        if "," in mount or ":" in mount:
            raise SlurmContainerError(f"mount '{mount}' has a comma or colon: Pyxis's --container-mounts list would "
                                      "split it: use a path without them")
    if environment.mounts:
        options.append("--container-mounts=" + ",".join(f"{mount}:{mount}" for mount in environment.mounts))
    if cwd is not None:
        options.append(f"--container-workdir={cwd}")
    return options


def bundle_config(bundle: str) -> dict[str, Any]:
    """The user's bundle's config.json, read on this node; one line naming the bundle when it is not one."""
    path = Path(bundle) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise SlurmContainerError(f"OCI bundle {bundle}: no config.json on this node: training.image names an OCI "
                                  "bundle dir (config.json and its rootfs) that every node has at that path") from None
    except (OSError, ValueError) as exc:
        raise SlurmContainerError(f"OCI bundle {bundle}: cannot read its config.json ({exc}): fix or rebuild the "
                                  "bundle (e.g. `runc spec` in it)") from None
    if not isinstance(config, dict) or not isinstance(config.get("root"), dict) or "path" not in config["root"]:
        raise SlurmContainerError(f"OCI bundle {bundle}: its config.json has no root.path: rebuild the bundle "
                                  "(e.g. `runc spec` in it)")
    return config


def derive_config(config: dict[str, Any], mounts: tuple[str, ...], cwd: str | None = None) -> dict[str, Any]:
    """config (a bundle's, e.g. `runc spec`'s) made fit for training: the mounts bind-mounted at the same paths, a
    /tmp of its own where it mounts none, the node's network, IPC, hostname and name resolution, and cwd as the
    process's working dir. For whoever makes a site's bundles (and the tests)."""
    derived = json.loads(json.dumps(config))
    derived_mounts = [mount for mount in derived.get("mounts") or [] if mount.get("destination") not in mounts]
    if not any(mount.get("destination") == "/tmp" for mount in derived_mounts):
        # A read-only rootfs (runc spec's default) has no writable /tmp, which torchrun and torch need.
        derived_mounts.append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                               "options": ["nosuid", "nodev", "mode=1777"]})
    derived_mounts += [{"destination": mount, "type": "bind", "source": mount, "options": ["rbind", "rw"]}
                       for mount in mounts]
    taken = {mount.get("destination") for mount in derived_mounts}
    derived_mounts += [{"destination": path, "type": "bind", "source": path, "options": ["rbind", "ro"]}
                       for path in HOST_FILES if path not in taken]
    derived["mounts"] = derived_mounts
    linux = derived.setdefault("linux", {})
    linux["namespaces"] = [space for space in linux.get("namespaces") or [] if space.get("type") not in HOST_NAMESPACES]
    derived.pop("hostname", None)
    process = derived.setdefault("process", {})
    if cwd is not None:
        process["cwd"] = cwd
    return derived


def bundle_problem(config: dict[str, Any], bundle: str, node_dir: str) -> str | None:
    """Why the bundle cannot run the training (one line naming the fix), or None: slurmstepd mounts nothing of the
    node's, so the bundle's own config must bind-mount the node's trainpipe dir at the same path, and the training
    needs the node's network (rendezvous, gloo and NCCL bind the node's addresses)."""
    mounted = [mount.get("destination", "") for mount in config.get("mounts") or []
               if mount.get("source") == mount.get("destination")
               and {"bind", "rbind"} & {*(mount.get("options") or []), mount.get("type")}]
    if node_dir and not any(node_dir == dest or node_dir.startswith(dest.rstrip("/") + "/") for dest in mounted):
        return (f"OCI bundle {bundle}: its config.json mounts no dir holding the node's trainpipe dir {node_dir}: "
                "add a bind mount of cluster.slurm.scratch's top dir at the same path (infra.node.slurm_container."
                "derive_config writes one)")
    spaces = {space.get("type") for space in (config.get("linux") or {}).get("namespaces") or []}
    if "network" in spaces:
        return (f"OCI bundle {bundle}: its config.json gives the container a network namespace of its own: remove "
                "\"network\" from linux.namespaces (the training binds the node's addresses)")
    return None


def checked_bundle(environment: TrainingEnvironment) -> tuple[str, str]:
    """The bundle dir (environment.image) and its PATH, once its config.json is found fit on this node; else one
    line naming the fix. Slurm 22.05 runs <bundle>/rootfs whatever root.path says, and runc refuses a rootfs behind
    a symlink, so the bundle cannot be copied elsewhere with a config of trainpipe's: it is used as the site made
    it."""
    if environment.image is None:
        raise SlurmContainerError("an oci training environment needs its bundle dir (training.image)")
    config = bundle_config(environment.image)
    problem = bundle_problem(config, environment.image, environment.node_dir)
    if problem is not None:
        raise SlurmContainerError(problem)
    paths = [entry[len("PATH="):] for entry in (config.get("process") or {}).get("env") or []
             if isinstance(entry, str) and entry.startswith("PATH=")]
    return environment.image, paths[-1] if paths else DEFAULT_PATH
