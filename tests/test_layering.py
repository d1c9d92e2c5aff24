"""Import directions between the rooms of the tree, read from the source with `ast` (nothing is imported).

A room is a top-level package of the repository (trainer, tasks, flows, ...) or, inside infra, one of its packages or
shared modules (infra.storage, infra.errors, ...). The rooms stand in LAYERS, bottom first, and every arrow points
down: a module imports only its own room and rooms on lower layers, never one on its own layer (rooms side by side
are independent of each other) nor one above. A room that is not in LAYERS fails the test, so a new package or
shared module is placed on purpose. No import circle between modules either, inside a room or across.

On top of the order:

* the node agent (infra.node), which runs on every node, never reaches orchestration: infra.job, infra.compute,
  infra.lifecycle, infra.analysis, the CLI (trainpipe), flows or tasks; checked through everything it imports
  in turn, since a node runs whatever the agent's imports pull in;
* storage (infra.storage) never imports compute (infra.compute, the providers among it), nor any other room of
  infra or the trainer (only infra.errors, the shared leaf that says which failures are transient): it is the
  bottom layer;
* nothing under infra/ or trainer/ imports Prefect, flows or tasks.

Every import counts: inside functions (they run too) and under `if TYPE_CHECKING:` (an annotation is a dependency
as well). `import a.b` and `from a import b` (b a module) are arrows to a.b; `from a import name` to a. An arrow is
what the import names: the package __init__ that Python runs first (a, for a.b) is no arrow of the importer's.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORAGE_MAY_IMPORT = ("infra.storage", "infra.errors")
ORCHESTRATION = ("infra.job", "infra.compute", "infra.lifecycle", "infra.analysis", "trainpipe", "flows", "tasks")

# Bottom first. A room imports its own modules and rooms of lower layers only.
LAYERS: tuple[tuple[str, ...], ...] = (
    # shared leaves: infra's own package docstring, which failures are transient, the workload's marker helper
    ("infra", "infra.errors", "trainpipe_sdk"),
    # object storage, and the other shared modules: the strict pydantic base, cancellation, the workspace dirs
    ("infra.storage", "infra.strict_model", "infra.cancel", "infra.workspace"),
    # what lives in the store: checkpoints (layout, commit, restore), datasets, the workload contract
    ("infra.checkpoints", "infra.dataset", "infra.workload"),
    # the model registry: aliases of committed checkpoints
    ("infra.registry",),
    # the node agent, on every node
    ("infra.node",),
    # where nodes come from: the cluster spec, providers, catalog, optimizer, node access
    ("infra.compute",),
    # the job spec (composing the rooms' sections), its plan and record; analysis of runs and clusters
    ("infra.job", "infra.analysis"),
    # a run's lifecycle (lease, preemption watch, recoveries); the bundled trainer (reads analysis' step breakdown)
    ("infra.lifecycle", "trainer"),
    # the experiment tracker's client (MLflow), loaded only for a job with a tracking section
    ("infra.tracking",),
    ("tasks",),
    ("flows", "bench"),
    ("trainpipe",),
)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violation(importer: str, imported: str) -> str | None:
    """Why importer may not import imported directly, or None when it may."""
    if _within(importer, "infra.node") and any(_within(imported, p) for p in ORCHESTRATION):
        return "the node agent imports orchestration"
    if _within(importer, "infra.storage") and _within(imported, "infra.compute"):
        return "storage imports compute"
    below_storage = any(_within(imported, p) for p in STORAGE_MAY_IMPORT)
    if _within(importer, "infra.storage") and not below_storage and (
            _within(imported, "trainer") or _within(imported, "infra")):
        return "storage imports a layer above it"
    if (_within(importer, "infra") or _within(importer, "trainer")) and any(
            _within(imported, p) for p in ("prefect", "flows", "tasks")):
        return "plain Python (infra, trainer) imports Prefect, flows or tasks"
    return None


def room_of(module: str) -> str:
    """infra's packages and shared modules are rooms of their own; elsewhere the top-level package is the room."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "infra" else parts[0]


def layer_of(room: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    return next((i for i, rooms in enumerate(layers) if room in rooms), None)


def order_violation(importer: str, imported: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> str | None:
    """Why the room order forbids importer (a module of the tree) to import imported (another), or None."""
    here, there = room_of(importer), room_of(imported)
    if here == there:
        return None
    mine, theirs = layer_of(here, layers), layer_of(there, layers)
    if mine is None or theirs is None:
        return f"{here if mine is None else there} is in no layer"
    if theirs > mine:
        return f"{here} (layer {mine}) imports {there} (layer {theirs}), a room above it"
    if theirs == mine:
        return f"{here} imports {there}, a room beside it on layer {mine}"
    return None


def _packages(root: Path) -> list[str]:
    """Every top-level package of the tree: a new one is a new room, found without being listed here."""
    return sorted(path.parent.name for path in root.glob("*/__init__.py") if path.parent.name != "tests")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(path, root): path for package in _packages(root)
            for path in sorted((root / package).rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    module: str
    line: int


def imports_with_lines(source: str, module: str, is_package: bool, known: set[str]) -> Iterator[Import]:
    """Every module the source imports, anywhere in it, with its line: `from a import b` is a.b when that is a
    module of the tree, else a (a name defined in a)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (Import(alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            if len(submodules) < len(node.names):
                yield Import(base, node.lineno)
            yield from (Import(name, node.lineno) for name in submodules)


def _arrows(root: Path) -> dict[str, dict[str, int]]:
    """Per module of the tree: every module it imports (of the tree or not), each with the line of its first import."""
    modules = _modules(root)
    known = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        arrows = graph[name] = {}
        for found in imports_with_lines(path.read_text(), name, path.name == "__init__.py", known):
            arrows.setdefault(found.module, found.line)
    return graph


def _graph(root: Path) -> dict[str, set[str]]:
    return {name: set(arrows) for name, arrows in _arrows(root).items()}


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every in-repo module start imports, directly or not, each with the module that imports it."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        here = todo.pop()
        for imported in graph.get(here, ()):
            # `import a.b.c` also runs a and a.b: their __init__ modules count as imported.
            parts = imported.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in graph and name not in via and name != start:
                    via[name] = here
                    todo.append(name)
    return via


def import_circles(arrows: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """One circle through each group of modules that import each other, directly or not (a strongly connected
    component of the import graph, Tarjan's algorithm): [a, b, ..., a], each module importing the next."""
    graph = {module: sorted(m for m in imported if m in arrows and m != module) for module, imported in arrows.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        # iterative DFS: (module, position in its list of imports)
        path = [(start, 0)]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while path:
            here, position = path[-1]
            if position < len(graph[here]):
                path[-1] = (here, position + 1)
                there = graph[here][position]
                if there not in index:
                    index[there] = low[there] = len(index)
                    stack.append(there)
                    on_stack.add(there)
                    path.append((there, 0))
                elif there in on_stack:
                    low[here] = min(low[here], index[there])
                continue
            path.pop()
            if path:
                low[path[-1][0]] = min(low[path[-1][0]], low[here])
            if low[here] == index[here]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == here:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return [_circle_in(graph, set(group)) for group in sorted(groups)]


def _circle_in(graph: Mapping[str, list[str]], group: set[str]) -> list[str]:
    """A shortest circle from the group's first module back to itself, through the group (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for here in frontier:
            for there in graph[here]:
                if there == start:
                    circle = [here]
                    while circle[-1] != start:
                        circle.append(came_from[circle[-1]])
                    return [start, *reversed(circle[:-1]), start]
                if there in group and there not in came_from:
                    came_from[there] = here
                    following.append(there)
        frontier = following
    raise AssertionError(f"no circle through {sorted(group)}")


def _describe(circle: list[str], arrows: Mapping[str, Mapping[str, int]]) -> str:
    steps = [f"{module} (line {arrows[module][after]})" for module, after in pairwise(circle)]
    return " -> ".join([*steps, circle[-1]])


def order_breaches(arrows: Mapping[str, Mapping[str, int]], layers: tuple[tuple[str, ...], ...] = LAYERS
                   ) -> list[str]:
    """Every import between modules of the tree that the room order forbids, as 'importer:line imports x: why'."""
    return [f"{importer}:{line} imports {imported}: {why}"
            for importer, imported_lines in sorted(arrows.items())
            for imported, line in sorted(imported_lines.items())
            if imported in arrows and (why := order_violation(importer, imported, layers))]


def test_rule_catches_upward_imports() -> None:
    assert violation("infra.node.watchdog", "infra.compute.providers.local") == "the node agent imports orchestration"
    assert violation("infra.node", "tasks.train") == "the node agent imports orchestration"
    assert violation("infra.storage.s3", "infra.compute.providers") == "storage imports compute"
    assert violation("infra.storage.transfer", "infra.job.spec") == "storage imports a layer above it"
    assert violation("infra.storage.transfer", "infra.storage.pool") is None
    assert violation("infra.checkpoints.commit", "prefect") is not None
    assert violation("trainer.train", "flows.retrain") is not None
    assert violation("infra.dataset.stagecache", "prefect.tasks") is not None


def test_rule_allows_downward_and_sideways_imports() -> None:
    assert violation("infra.node.sync", "infra.checkpoints.commit") is None
    assert violation("infra.node.stage", "infra.storage.transfer") is None
    assert violation("infra.compute.providers.local", "infra.node.processes") is None
    assert violation("infra.job.plan", "infra.compute.optimizer") is None
    assert violation("tasks.train", "prefect") is None
    assert violation("infra.nodes_elsewhere", "infra.job") is None  # a prefix that is not the package


def test_the_order_allows_only_arrows_down() -> None:
    assert room_of("infra.compute.providers.base") == "infra.compute"
    assert room_of("infra.errors") == "infra.errors"
    assert room_of("infra") == "infra"
    assert room_of("tasks.train") == "tasks"
    assert order_violation("infra.job.plan", "infra.compute.optimizer") is None
    assert order_violation("infra.compute.spec", "infra.compute.providers.table") is None  # inside a room
    assert order_violation("infra.compute.providers.base", "infra.job.spec") == (
        "infra.compute (layer 5) imports infra.job (layer 6), a room above it")
    assert order_violation("infra.analysis.predict", "infra.job.spec") == (
        "infra.analysis imports infra.job, a room beside it on layer 6")
    assert order_violation("infra.newroom.thing", "infra.storage") == "infra.newroom is in no layer"
    assert order_violation("tasks.train", "newpackage") == "newpackage is in no layer"


def test_imports_are_read_from_source() -> None:
    source = ("import prefect\nfrom infra.analysis import clusterbench\nfrom infra.job import JobSpec\n"
              "if TYPE_CHECKING:\n    from infra.job.spec import X\ndef f():\n    from .sibling import x\n")
    known = {"infra.analysis.clusterbench", "infra.job.spec"}
    found = set(imports_with_lines(source, "infra.node.watchdog", False, known))
    assert found == {Import("prefect", 1), Import("infra.analysis.clusterbench", 2), Import("infra.job", 3),
                     Import("infra.job.spec", 5), Import("infra.node.sibling", 7)}


def test_circles_are_found_and_named() -> None:
    arrows = {"a": {"b": 1}, "b": {"c": 2, "x": 9}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"f": 5}, "f": {"e": 6}}
    assert import_circles(arrows) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert _describe(["a", "b", "c", "a"], arrows) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    assert import_circles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []


def test_every_room_is_in_the_order() -> None:
    rooms = {room_of(module) for module in _modules(ROOT)}
    listed = [room for layer in LAYERS for room in layer]
    assert len(listed) == len(set(listed)), "a room is listed twice in LAYERS"
    assert not rooms - set(listed), f"rooms in no layer: {sorted(rooms - set(listed))}: add each to LAYERS"
    assert not set(listed) - rooms, f"LAYERS lists rooms the tree does not have: {sorted(set(listed) - rooms)}"


def test_no_import_circles() -> None:
    arrows = _arrows(ROOT)
    circles = [_describe(circle, arrows) for circle in import_circles(arrows)]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_every_arrow_points_down_the_order() -> None:
    breaches = order_breaches(_arrows(ROOT))
    assert not breaches, "\n".join(breaches)


def test_no_module_imports_a_higher_layer() -> None:
    graph = _graph(ROOT)
    broken = [f"{importer} imports {imported}: {why}" for importer, imported_set in sorted(graph.items())
              for imported in sorted(imported_set) if (why := violation(importer, imported))]
    assert not broken, "\n".join(broken)


def test_the_node_agent_reaches_no_orchestration_through_its_imports() -> None:
    graph = _graph(ROOT)
    broken = []
    for start in sorted(m for m in graph if _within(m, "infra.node")):
        for reached, importer in sorted(_reachable(graph, start).items()):
            if any(_within(reached, p) for p in ORCHESTRATION):
                broken.append(f"{start} reaches {reached} (imported by {importer})")
    assert not broken, "\n".join(broken)
