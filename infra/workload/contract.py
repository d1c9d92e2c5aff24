"""The environment contract: the TRAINPIPE_* variables every training process gets, and `{placeholders}` in the
command that stand for the same values.

    TRAINPIPE_DATA_DIR        the node-local dir holding the staged dataset (a mirror of dataset.url's tree)
    TRAINPIPE_DATA_URL        the dataset's URL (what a script reading in place, dataset.access remote, opens)
    TRAINPIPE_DATA_SHARDS     a file listing this node's dataset files, one per line, relative to the data dir
    TRAINPIPE_CHECKPOINT_DIR  the node-local dir (never a network mount) the script writes checkpoints to
    TRAINPIPE_RESUME_FROM     the restored checkpoint on this node (its folder or file); empty on a fresh start
    TRAINPIPE_INIT_FROM       training.init_from restored on this node (its folder or file): weights to start a new
                              schedule from; empty without init_from and when the run resumes its own checkpoint
    TRAINPIPE_METRICS_FILE    JSON lines the script may append {"step": N, "loss": x, ...} to
    TRAINPIPE_RUN_ID          the same across recoveries and reruns of one run
    TRAINPIPE_ATTEMPT         0 for the run's first launch, then one more per recovery
    TRAINPIPE_NODE_RANK, TRAINPIPE_NUM_NODES, TRAINPIPE_NODE_IPS (comma-separated, in rank order)
    TRAINPIPE_INPUT_<NAME>    the node-local dir holding the staged input <name> (a mirror of its url's tree), one
                              per entry of the job's inputs; {input_<name>} in a command

plus torchrun's own (RANK, LOCAL_RANK, WORLD_SIZE, ...). An argument that is only an empty `{resume_from}` (or
`{init_from}`) is dropped together with the option right before it, so `--resume_from_checkpoint {resume_from}`
disappears on a fresh start. `{{` and `}}` are literal braces.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

SYNC_DIR_VAR = "TRAINPIPE_SYNC_DIR"  # the node syncer's state: read by trainpipe's own checkpoint helpers
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
INPUTS_DIR = "inputs"  # under a node's workdir: one folder per input
INPUT_PREFIX = "input_"


def input_dir(workdir: str, name: str) -> str:
    """Where input `name` is staged on a node (its TRAINPIPE_INPUT_<NAME>)."""
    return "/".join([workdir.rstrip("/"), INPUTS_DIR, name])


@dataclass(frozen=True)
class NodeContext:
    """What one node's training processes are told."""

    data_dir: str
    data_url: str
    data_shards: str
    checkpoint_dir: str
    resume_from: str
    metrics_file: str
    run_id: str
    attempt: int
    node_rank: int
    num_nodes: int
    node_ips: tuple[str, ...]
    sync_dir: str
    init_from: str = ""
    inputs: dict[str, str] = field(default_factory=dict)  # input name -> its dir on this node

    def values(self) -> dict[str, str]:
        """Placeholder name -> value."""
        return {
            "data_dir": self.data_dir,
            "data_url": self.data_url,
            "data_shards": self.data_shards,
            "checkpoint_dir": self.checkpoint_dir,
            "resume_from": self.resume_from,
            "init_from": self.init_from,
            "metrics_file": self.metrics_file,
            "run_id": self.run_id,
            "attempt": str(self.attempt),
            "node_rank": str(self.node_rank),
            "num_nodes": str(self.num_nodes),
            "node_ips": ",".join(self.node_ips),
            **{f"{INPUT_PREFIX}{name}": path for name, path in self.inputs.items()},
        }

    def environment(self) -> dict[str, str]:
        env = {f"TRAINPIPE_{name.upper()}": value for name, value in self.values().items()}
        env[SYNC_DIR_VAR] = self.sync_dir
        return env


PLACEHOLDERS: tuple[str, ...] = tuple(NodeContext.__dataclass_fields__.keys() - {"sync_dir", "inputs"})


def placeholders_in(argument: str) -> list[str]:
    """The placeholder names an argument uses, in order ({{ and }} are literal braces, not placeholders)."""
    return [match.group(1) for match in _PLACEHOLDER.finditer(argument) if match.group(1) is not None]


def check_command(command: Sequence[str], inputs: Collection[str] | None = None, extra: Sequence[str] = ()) -> None:
    """ValueError naming the argument for a placeholder that is not one of PLACEHOLDERS (or extra), nor
    {input_<name>} of a declared input (inputs None: of any input, for a command checked before the job's inputs
    are known)."""
    for index, argument in enumerate(command):
        for name in placeholders_in(argument):
            if name in PLACEHOLDERS or name in extra:
                continue
            if name.startswith(INPUT_PREFIX) and (inputs is None or name.removeprefix(INPUT_PREFIX) in inputs):
                continue
            known = sorted([*PLACEHOLDERS, *extra, *(f"{INPUT_PREFIX}{n}" for n in sorted(inputs or ()))])
            hint = (" (an input placeholder names an entry of inputs:)" if name.startswith(INPUT_PREFIX) else "")
            raise ValueError(f"command[{index}] {argument!r}: unknown placeholder {{{name}}}{hint}: use one of "
                             + ", ".join(f"{{{p}}}" for p in known) + " (write {{ or }} for a literal brace)")


def _substitute(argument: str, values: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return match.group(0)[0]  # {{ -> {, }} -> }
        return values[match.group(1)]

    return _PLACEHOLDER.sub(replace, argument)


def _is_option(argument: str) -> bool:
    if not argument.startswith("-"):
        return False
    try:
        float(argument)
    except ValueError:
        return True
    return False  # a negative number is a value, not an option


# Placeholders that may be empty on purpose: an option naming one of them goes with it.
_OPTIONAL = ("resume_from", "init_from")


def render_command(command: Sequence[str], context: NodeContext, extra: dict[str, str] | None = None) -> list[str]:
    """The command with every placeholder filled in for this node (and `extra`'s, e.g. evaluate's {checkpoint})."""
    values = {**context.values(), **(extra or {})}
    rendered: list[str] = []
    for argument in command:
        if any(argument.strip() == f"{{{name}}}" and not values[name] for name in _OPTIONAL):
            # A fresh start: no checkpoint to name, so the option that would name it goes too.
            if rendered and _is_option(rendered[-1]):
                rendered.pop()
            continue
        rendered.append(_substitute(argument, values))
    return rendered
