"""Import directions between the rooms of the tree, read from the source with `ast` (nothing is imported).

A lower layer never imports a higher one:

* the node agent (infra.node), which runs on every node, never reaches orchestration: infra.job, infra.compute,
  infra.lifecycle, infra.analysis, the CLI (trainpipe), flows or tasks; checked through everything it imports
  in turn, since a node runs whatever the agent's imports pull in;
* storage (infra.storage) never imports compute (infra.compute, the providers among it), nor any other room of
  infra or the trainer (only infra.errors, the shared leaf that says which failures are transient): it is the
  bottom layer;
* nothing under infra/ or trainer/ imports Prefect, flows or tasks.

Imports inside functions count (they run too); so does `from package import module`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("infra", "trainer", "tasks", "flows", "trainpipe", "trainpipe_sdk", "bench")
STORAGE_MAY_IMPORT = ("infra.storage", "infra.errors")
ORCHESTRATION = ("infra.job", "infra.compute", "infra.lifecycle", "infra.analysis", "trainpipe", "flows", "tasks")


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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """Every module the source imports, anywhere in it; `from a import b` yields a.b too when that is a module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    yield f"{base}.{alias.name}"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: set(imports_of(path.read_text(), name, path.name == "__init__.py", known))
            for name, path in modules.items()}


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


def test_rule_catches_upward_imports() -> None:
    assert violation("infra.node.watch", "infra.compute.providers.local") == "the node agent imports orchestration"
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


def test_imports_are_read_from_source() -> None:
    source = "import prefect\nfrom infra.analysis import clusterbench\ndef f():\n    from .sibling import x\n"
    found = set(imports_of(source, "infra.node.watch", False, {"infra.analysis.clusterbench"}))
    assert found == {"prefect", "infra.analysis", "infra.analysis.clusterbench", "infra.node.sibling"}


def test_no_module_imports_a_higher_layer() -> None:
    graph = _graph()
    broken = [f"{importer} imports {imported}: {why}" for importer, imported_set in sorted(graph.items())
              for imported in sorted(imported_set) if (why := violation(importer, imported))]
    assert not broken, "\n".join(broken)


def test_the_node_agent_reaches_no_orchestration_through_its_imports() -> None:
    graph = _graph()
    broken = []
    for start in sorted(m for m in graph if _within(m, "infra.node")):
        for reached, importer in sorted(_reachable(graph, start).items()):
            if any(_within(reached, p) for p in ORCHESTRATION):
                broken.append(f"{start} reaches {reached} (imported by {importer})")
    assert not broken, "\n".join(broken)
