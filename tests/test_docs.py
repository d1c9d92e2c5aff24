"""The docs cover the tree: every field of the job config, every CLI command and its options, every room of the
Layout; every link between the pages resolves. Reads the pages and walks the spec's models and the CLI's commands
in process: no network, no Prefect, no subprocess but one `git ls-files`.

The rules, each precise enough that a page cannot pass by chance:

* a config field is documented when its whole dotted YAML path is a code span in README.md or docs/*.md:
  `cluster.ssh.hosts[].key_file` (a list's items are `[]`, a mapping's values `<name>`: `inputs.<name>.url`), and
  every top-level section of the job has a heading of its own in docs/config.md naming it as a code span;
* a command is documented when docs/cli.md has a heading naming `trainpipe <command> [<sub>]` as a code span, and
  every option of it (its long name, `--run-id`) appears in that heading's section;
* a room is named when README.md's Layout section names its directory (`infra/compute/providers/ssh/`).
"""

from __future__ import annotations

import re
import subprocess
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import typer.main
from pydantic import BaseModel

from infra.job.spec import JobSpec
from trainpipe.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG_PAGE = DOCS / "config.md"
CLI_PAGE = DOCS / "cli.md"
# What a newcomer reads in the first hour; the reference lives in docs/.
README_MAX_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
# [text](target), not an image; the target up to whitespace or the closing parenthesis.
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def headings(text: str) -> list[tuple[int, str, int]]:
    """(level, title, offset) of every ATX heading outside fenced code."""
    fenced = [match.span() for match in FENCE.finditer(text)]
    return [(len(m.group(1)), m.group(2), m.start()) for m in HEADING.finditer(text)
            if not any(start <= m.start() < end for start, end in fenced)]


def sections(text: str) -> Iterator[tuple[str, str]]:
    """(heading title, the text under it up to the next heading of the same or a higher level)."""
    found = headings(text)
    for index, (level, title, start) in enumerate(found):
        end = next((offset for lvl, _, offset in found[index + 1:] if lvl <= level), len(text))
        yield title, text[start:end]


def slug(title: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation dropped, spaces as hyphens."""
    rendered = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
    return re.sub(r"[^\w\- ]", "", rendered.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, title, _ in headings(text):
        base = slug(title)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


# ---- the job config ------------------------------------------------------------------------------------------


def _unwrap(annotation: Any) -> Iterator[tuple[str, type[BaseModel]]]:
    """Every model reachable through an annotation, with the path suffix between the field and its fields:
    '' for the model itself (optional or a union member), '[]' for a list's item, '.<name>' for a mapping's value."""
    origin = typing.get_origin(annotation)
    args = [arg for arg in typing.get_args(annotation) if arg is not Ellipsis]
    if origin is typing.Annotated:
        yield from _unwrap(args[0])
    elif origin is typing.Union or origin is types.UnionType:
        for arg in args:
            yield from _unwrap(arg)
    elif isinstance(origin, type) and issubclass(origin, Mapping):
        for suffix, model in _unwrap(args[-1]):
            yield ".<name>" + suffix, model
    elif isinstance(origin, type) and issubclass(origin, Sequence | set | frozenset) and origin not in (str, bytes):
        for arg in args:
            for suffix, model in _unwrap(arg):
                yield "[]" + suffix, model
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield "", annotation


def config_paths(model: type[BaseModel], prefix: str = "", seen: tuple[type, ...] = ()) -> Iterator[str]:
    """The dotted YAML path of every field of the model and, recursively, of every model its fields hold."""
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        yield path
        for suffix, nested in _unwrap(info.annotation):
            if nested not in seen:
                yield from config_paths(nested, f"{path}{suffix}.", (*seen, model))


def test_the_config_walk_reaches_every_kind_of_nesting() -> None:
    # Without this the coverage test below could pass by walking nothing.
    paths = set(config_paths(JobSpec))
    top = {info.alias or name for name, info in JobSpec.model_fields.items()}
    assert top <= paths
    assert any("[]." in path for path in paths), "no field inside a list of models was reached"
    assert any(".<name>." in path for path in paths), "no field inside a mapping of models was reached"
    assert max(path.count(".") for path in paths) >= 3, "no field three sections deep was reached"
    optional = [name for name, info in JobSpec.model_fields.items()
                if type(None) in typing.get_args(info.annotation) and any(_unwrap(info.annotation))]
    assert optional and all(any(path.startswith(name + ".") for path in paths) for name in optional), optional


def test_every_config_field_is_documented() -> None:
    spans = {span.strip() for page in pages() for span in CODE_SPAN.findall(text_of(page))}
    missing = [path for path in config_paths(JobSpec) if path not in spans]
    assert not missing, (f"{len(missing)} job config fields are in no doc page as a code span of their whole "
                         "path: document each in docs/config.md:\n  " + "\n  ".join(missing))


def test_every_config_section_has_its_own_heading() -> None:
    titled = {span for _, title, _ in headings(text_of(CONFIG_PAGE)) for span in CODE_SPAN.findall(title)}
    missing = [name for name, info in JobSpec.model_fields.items() if (info.alias or name) not in titled]
    assert not missing, f"docs/config.md has no heading naming these top-level sections: {', '.join(missing)}"


# ---- the command line ----------------------------------------------------------------------------------------


def commands(command: Any = None, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """('trainpipe model promote', its click command) for every command the CLI runs, through every sub-group."""
    command = typer.main.get_command(app) if command is None else command
    subcommands = getattr(command, "commands", None)
    if subcommands is None:
        yield " ".join(("trainpipe", *path)), command
        return
    for name, sub in subcommands.items():
        if not getattr(sub, "hidden", False):
            yield from commands(sub, (*path, name))


def long_options(command: Any) -> list[str]:
    return [next((opt for opt in param.opts if opt.startswith("--")), param.opts[0])
            for param in command.params
            if getattr(param, "param_type_name", "") == "option" and not getattr(param, "hidden", False)]


def test_the_command_walk_reaches_sub_groups() -> None:
    found = [name for name, _ in commands()]
    assert any(name.count(" ") >= 2 for name in found), found
    assert "trainpipe run" in found


def test_every_command_and_option_is_documented() -> None:
    # A heading's span may carry arguments: `trainpipe ckpt verify URL [STEP]` names `trainpipe ckpt verify`.
    by_command: dict[str, str] = {}
    for title, body in sections(text_of(CLI_PAGE)):
        for words in (span.split() for span in CODE_SPAN.findall(title)):
            for length in range(2, len(words) + 1):
                name = " ".join(words[:length])
                by_command[name] = by_command.get(name, "") + body
    missing = []
    for name, command in commands():
        body = by_command.get(name)
        if body is None:
            missing.append(f"{name}: no heading in docs/cli.md names it as a code span")
            continue
        for option in long_options(command):
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", body):
                missing.append(f"{name} {option}: not in its section of docs/cli.md")
    assert not missing, "undocumented commands and options:\n  " + "\n  ".join(missing)


# ---- the README and the links --------------------------------------------------------------------------------


def test_readme_is_a_first_hour_read() -> None:
    text = text_of(README)
    assert len(text.splitlines()) <= README_MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines (at most {README_MAX_LINES}): move reference into docs/")
    assert "make run" in text and "make test" in text


def test_every_link_resolves() -> None:
    broken = []
    for page in pages():
        for target in LINK.findall(text_of(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check offline
                continue
            file_part, _, fragment = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(text_of(linked)):
                broken.append(f"{where}: no heading with anchor #{fragment} in {linked.relative_to(ROOT)}")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_readme_links_every_docs_page() -> None:
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in LINK.findall(text_of(README))}
    orphans = [str(page.relative_to(ROOT)) for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert DOCS.is_dir() and not orphans, f"README.md links no page of docs/ for: {', '.join(orphans) or 'docs/'}"


def rooms() -> list[str]:
    """Every top-level directory that holds tracked files, and every package under infra/, as 'infra/job/'."""
    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                                 timeout=30).stdout.decode().split("\0")
        top = {path.split("/", 1)[0] for path in tracked if "/" in path}
    except (OSError, subprocess.SubprocessError):  # not a git checkout: what the directory holds
        top = {path.name for path in ROOT.iterdir() if path.is_dir()}
    found = {f"{name}/" for name in top if not name.startswith(".") and not name.endswith(".egg-info")
             and name not in ("__pycache__", "build", "dist")}
    found |= {f"{init.parent.relative_to(ROOT).as_posix()}/" for init in (ROOT / "infra").rglob("__init__.py")}
    return sorted(found)


def test_the_layout_names_every_room() -> None:
    layout = next((body for title, body in sections(text_of(README)) if title.strip() == "Layout"), None)
    assert layout is not None, "README.md has no '## Layout' section"
    unnamed = [room for room in rooms() if not re.search(rf"(?<![\w/.-]){re.escape(room)}", layout)]
    assert not unnamed, "README.md's Layout section names no line for: " + ", ".join(unnamed)
