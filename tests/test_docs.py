"""The README, the docs pages and the package READMEs say only what is there: every relative link resolves
(its anchor too), every repository path they name exists, every `llamarl.*` module path names a module
(and the name after it is defined there), and every command they show takes the flags it is given (an
app's flags parse as the app parses them; a tool's flags are the tool's). Nothing is run: this is fast."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "packages").glob("*/README.md")])
TOP_LEVEL = ("apps", "docs", "packages", "recipes", "tests", "tools", ".ci")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"\bllamarl(?:\.[A-Za-z_]\w*)+")
_TOP = "|".join(re.escape(d) for d in TOP_LEVEL)
REPO_PATH = re.compile(rf"^(?:\.\./)*(?:{_TOP})/[\w.\-/]*$")


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def _fenced(text: str, *languages: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in languages]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(page.read_text()).splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{_name(page)}: broken links {broken}"


def _named_paths(text: str) -> set[str]:
    """Repository paths named in backticks in the prose, or as words of the commands in code blocks."""
    words = set(CODE_SPAN.findall(_prose(text)))
    for block in _fenced(text, "bash", ""):
        for line in block.splitlines():
            words.update(w.strip("\"'(),;") for w in line.split("#", 1)[0].split())
    return {w.rstrip("/") for w in words if REPO_PATH.match(w)}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_named_repository_paths_exist(page: Path) -> None:
    # A path is read from the repository root, or from the page's own folder (a package's `tests/...`).
    missing = [
        p
        for p in sorted(_named_paths(page.read_text()))
        if not (REPO / p).exists() and not (page.parent / p).exists()
    ]
    assert not missing, f"{_name(page)} names paths that do not exist: {missing}"


def _resolves(dotted: str) -> bool:
    """Whether `llamarl.a.b...` is a module of the workspace, or names defined in one."""
    parts = dotted.split(".")
    where = REPO / "packages" / f"llamarl-{parts[1]}" / "src" / "llamarl" / parts[1]
    if not where.is_dir():
        return False
    source = where / "__init__.py"
    for i, part in enumerate(parts[2:], start=2):
        if (where / part).is_dir():
            where, source = where / part, where / part / "__init__.py"
        elif (where / f"{part}.py").is_file():
            where, source = where, where / f"{part}.py"
            if i + 1 < len(parts) and source.parent == where:
                rest = parts[i + 1 :]
                text = source.read_text()
                return all(re.search(rf"\b{re.escape(name)}\b", text) for name in rest)
        else:  # a name defined in (or exported from) the module reached so far
            text = source.read_text()
            return all(re.search(rf"\b{re.escape(name)}\b", text) for name in parts[i:])
    return True


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_module_paths_resolve(page: Path) -> None:
    names = {m.rstrip(".") for m in DOTTED.findall(page.read_text())}
    unknown = sorted(n for n in names if not _resolves(n))
    assert not unknown, f"{_name(page)} names modules or names that do not exist: {unknown}"


def _commands(text: str) -> list[str]:
    """The `uv run ...` commands of a page: code blocks (continuation lines joined) and inline code."""
    commands = [span for span in CODE_SPAN.findall(_prose(text)) if span.startswith("uv run ")]
    for block in _fenced(text, "bash", ""):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if "uv run " in line:
                commands.append(line[line.index("uv run ") :])
    return commands


def _app_call(command: str) -> tuple[str, list[str]] | None:
    """(app, flags) of a command that runs an app, or None."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        found = re.fullmatch(r"apps/(\w+)_rl", word)
        if found:
            return found.group(1), words[i + 1 :]
    return None


def _runnable_here(flags: list[str]) -> bool:
    """Flags that can be parsed without the run that makes them: no shell variables, no config file that
    an earlier command of the page writes, no task module of the reader's own (the README's example,
    `my_task.py`, is the one task module written out)."""
    if any("$" in f for f in flags):
        return False
    if "--task.module" in flags and not flags[flags.index("--task.module") + 1].startswith("my_task.py:"):
        return False
    if "--config" in flags:
        path = flags[flags.index("--config") + 1]
        return (REPO / path).is_file()
    return True


APP_COMMANDS = [
    (page, command)
    for page in PAGES
    for command in _commands(page.read_text())
    if _app_call(command) is not None and _runnable_here(_app_call(command)[1])
]


@pytest.mark.parametrize(
    ("page", "command"), APP_COMMANDS, ids=[f"{_name(p)}: {c[:60]}" for p, c in APP_COMMANDS]
)
def test_app_commands_parse(
    page: Path, command: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from test_byo_tasks import readme_example

    from llamarl.control.cli import parse_run_config

    app, flags = _app_call(command)
    if "--task.module" in flags:  # the README's example, saved as my_task.py where the command runs
        (tmp_path / "my_task.py").write_text(readme_example())
        monkeypatch.chdir(tmp_path)
    else:
        monkeypatch.chdir(REPO)
    task = None if app == "task" else app
    flags = [f for f in flags if f != "--help"]
    parse_run_config(flags, task=task, prog=f"{app}_rl", description="")


def _tool_call(command: str) -> tuple[str, list[str]] | None:
    words = shlex.split(command.replace("$(", "").replace(")", ""))
    for i, word in enumerate(words):
        if re.fullmatch(r"tools/\w+\.(py|sh)", word):
            return word, words[i + 1 :]
    return None


def _simulator_help(subcommand: str) -> str:
    from llamarl.sim.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([subcommand, "--help"])
    return out.getvalue()


TOOL_COMMANDS = [
    (page, command) for page in PAGES for command in _commands(page.read_text()) if _tool_call(command)
]


@pytest.mark.parametrize(
    ("page", "command"), TOOL_COMMANDS, ids=[f"{_name(p)}: {c[:60]}" for p, c in TOOL_COMMANDS]
)
def test_tool_commands_take_their_flags(page: Path, command: str) -> None:
    tool, args = _tool_call(command)
    if not args:
        return
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    if tool == "tools/simulate.py":
        known = _simulator_help(args[0])
        unknown = [f for f in flags if f != "--help" and not re.search(rf"{re.escape(f)}\b", known)]
    else:
        source = (REPO / tool).read_text()
        unknown = [f for f in flags if f"{f}" not in source]
    assert not unknown, f"{_name(page)}: {tool} has no flags {unknown}"


def test_the_pages_are_found() -> None:
    names = {_name(p) for p in PAGES}
    assert {"README.md", "docs/configuration.md", "docs/benchmarks.md"} <= names
    assert len(APP_COMMANDS) > 10 and len(TOOL_COMMANDS) > 5
