"""Node events: every one a NodeEvent member, written by emit, read back by parse, and named nowhere else.

The source scan is the guard against a reader matching a name typed again (`event["event"] == "committed"`): a
renamed or misspelled event then fails here, not as a wait that times out on a cluster."""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.node.events import Event, NodeEvent, WorkloadEvent, emit, parse

ROOT = Path(__file__).resolve().parent.parent
EVENTS_MODULE = ROOT / "infra" / "node" / "events.py"
# The workload side of the contract (its checkpoint record's writer) spells its names itself, without the node agent.
EXEMPT = (ROOT / "trainer", ROOT / "trainpipe_sdk")
NAMES = {str(kind) for kind in (*NodeEvent, *WorkloadEvent)}
# The other spelling of every name too (retention_skipped, ranks_exited were spelled so): it must not come back.
SPELLINGS = NAMES | {name.replace("-", "_") for name in NAMES}
# Helpers that take the name of the event to pick out: tasks.node_output.last_event, EventTap, the tests' own.
READERS = {"last_event", "wait_for", "last", "all", "is_event", "events"}
JSON_FRAGMENT = re.compile(r'"event":\s*"([\w-]+)"')


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in SPELLINGS


def _names_in(node: ast.AST) -> list[ast.Constant]:
    """The event-name constants an operand is or holds (a tuple, list or set of them)."""
    if _is_name(node):
        return [node]  # type: ignore[list-item]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [element for element in node.elts if _is_name(element)]  # type: ignore[misc]
    return []


def _reads_kind(node: ast.AST) -> bool:
    """event.kind, event["event"], event.get("event"): an expression that is an event's name."""
    if isinstance(node, ast.Attribute):
        return node.attr == "kind"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "event"
    if isinstance(node, ast.Call) and _callee(node) == "get" and node.args:
        return isinstance(node.args[0], ast.Constant) and node.args[0].value == "event"
    return False


def literal_event_names(source: str) -> list[tuple[int, str, str]]:
    """(line, name, how) for every event name the source spells out where an event is written or read (a docstring
    that names one in prose reads nothing), in source order."""
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found: dict[tuple[int, int, str], str] = {}  # the first way a constant was seen is the one said

    def spelled(constant: ast.Constant, how: str, name: str | None = None) -> None:
        found.setdefault((constant.lineno, constant.col_offset, name or constant.value), how)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = _callee(node)
            if callee == "emit" and node.args and _is_name(node.args[0]):
                spelled(node.args[0], "emitted")  # type: ignore[arg-type]
            elif callee in READERS:
                for arg in [*node.args, *(keyword.value for keyword in node.keywords)]:
                    if _is_name(arg):
                        spelled(arg, f"passed to {callee}()")  # type: ignore[arg-type]
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_reads_kind(operand) for operand in operands):
                for operand in operands:
                    for name in _names_in(operand):
                        spelled(name, "compared with an event's kind")
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "event" and _is_name(value):
                    spelled(value, 'written as {"event": ...}')  # type: ignore[arg-type]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and len(_names_in(node)) >= 2:
            # Names gathered to compare with later (the events expected, in order); one alone may be a coincidence.
            for name in _names_in(node):
                spelled(name, "in a collection of events")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for match in JSON_FRAGMENT.finditer(node.value):
                if match.group(1) in SPELLINGS:
                    spelled(node, "inside a string as JSON", match.group(1))
    return [(line, name, how) for (line, _, name), how in sorted(found.items())]


def _sources() -> Iterator[Path]:
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if any(part.startswith(".") or part in ("node_modules", "build", "dist") for part in relative.parts):
            continue
        # This test spells names out on purpose: the scan's own examples.
        if path in (EVENTS_MODULE, Path(__file__).resolve()) or any(path.is_relative_to(e) for e in EXEMPT):
            continue
        yield path


def test_no_event_name_is_spelled_outside_the_events_module() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {name!r} {how}"
             for path in _sources() for line, name, how in literal_event_names(path.read_text())]
    assert not found, "use NodeEvent / WorkloadEvent (infra/node/events.py) instead:\n" + "\n".join(found)
    assert sum(1 for _ in _sources()) > 100, "the scan saw the source tree"


def test_the_scan_finds_each_way_of_spelling_an_event_out() -> None:
    offending = '''
emit("committed", step=1)
events.emit("retention_skipped")
if event["event"] == "uploaded": pass
if e.get("event") in ("abandoned", "skipped"): pass
if event.kind != "input-staged": pass
found = last_event(output, "probe")
tap.wait_for("peer-serving", process, 5, "server")
record = {"event": "checkpoint", "step": 1}
PATTERN = r'(\\{"event": "input-staged".*\\})'
"""A docstring may say an "event": "staged" line in prose."""
assert kinds[-2:] == ["lease-expired", "node-down"]
'''
    assert [(line, name) for line, name, _ in literal_event_names(offending)] == [
        (2, "committed"), (3, "retention_skipped"), (4, "uploaded"), (5, "abandoned"), (5, "skipped"),
        (6, "input-staged"), (7, "probe"), (8, "peer-serving"), (9, "checkpoint"), (10, "input-staged"),
        (12, "lease-expired"), (12, "node-down")]
    # The same words as anything else (a command's name in argv, a directory, a summary key) are no event names.
    innocent = '''
argv = [python, "-m", "infra.node", "probe", "--dir", data]
SHARE_DIR = "fanout"
summary = {"code": code, "checkpoint": url}
if outcome == "skipped": pass
STATES = ("pending", "running", "stopped")
COMMANDS = {"probe": "infra.node.probe", "code": "infra.node.code"}  # a dict's keys: summaries are keyed so too
'''
    assert list(literal_event_names(innocent)) == []


def test_every_event_has_one_spelling() -> None:
    assert all(re.fullmatch(r"[a-z]+(-[a-z]+)*", name) for name in NAMES), sorted(NAMES)
    assert not {str(kind) for kind in NodeEvent} & {str(kind) for kind in WorkloadEvent}


@pytest.mark.parametrize("kind", list(NodeEvent))
def test_every_event_round_trips_through_emit_and_parse(kind: NodeEvent, capsys: pytest.CaptureFixture[str]) -> None:
    emit(kind, step=7, reason="a reason", sizes=[1, 2], nested={"a": None})
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["event"] == kind.value
    event = parse(line)
    assert event == Event(kind, {"step": 7, "reason": "a reason", "sizes": [1, 2], "nested": {"a": None}})
    assert event is not None and event.kind is kind
    assert event["step"] == 7 and event.get("missing") is None and "event" not in event


def test_an_event_without_fields_is_still_an_event(capsys: pytest.CaptureFixture[str]) -> None:
    emit(NodeEvent.RANKS_EXITED)
    event = parse(capsys.readouterr().out)
    assert event is not None and event.kind is NodeEvent.RANKS_EXITED and len(event) == 0
    assert event, "`if event` after parse means a line parsed, whatever its fields"


def test_emit_takes_a_member_only(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("committed", "no-such-event"):
        with pytest.raises(TypeError, match="NodeEvent member"):
            emit(name, step=1)  # type: ignore[arg-type]
    assert capsys.readouterr().out == "", "nothing written for a rejected event"
    with pytest.raises(TypeError, match="NodeEvent member"):
        Event("committed", {})  # type: ignore[arg-type]


def test_an_unknown_event_is_ordinary_output_and_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    name = f"no-such-event-{uuid.uuid4().hex[:8]}"  # never seen before in this process, whatever ran first
    line = json.dumps({"event": name, "step": 1})
    with caplog.at_level(logging.WARNING, logger="infra.node.events"):
        assert parse(line) is None
        assert parse(line) is None
    warnings = [record for record in caplog.records if name in record.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, caplog.text


def test_lines_that_are_no_event_are_ordinary_output() -> None:
    assert parse("step 10/100 loss 2.3") is None
    assert parse('{"step": 10, "loss": 2.3}') is None
    assert parse('{"event": "committed", "step": ') is None  # cut short
