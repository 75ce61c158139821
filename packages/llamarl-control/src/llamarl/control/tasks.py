"""Tasks: what a run learns. A task is rows + a prompt + reward functions (and, for multi-turn tasks,
tools or an environment); the built-in GSM8K, MATH and arithmetic tasks are tasks like any user's.

    from llamarl.control import Task

    def correct(prompt, completion, row):              # a plain Python reward function
        return float(row["answer"] in completion)

    TASK = Task(
        name="capitals",
        rows={"train": [...], "test": [...]},        # or a folder of JSONL files, Hub("id"), or a function
        prompt="What is the capital of {country}?",  # or a function row -> text or chat messages
        rewards=[correct, (brief, 0.1)],             # weighted; batched and async functions too
    )

Rows come from a local folder (`train.jsonl` / `test.jsonl`, or `.jsonl.gz`), a hub dataset (`Hub`),
a function of the split name, or lists given in code. Each row is a dict; `fields` names the ones every
row must have and `prepare` may check, normalise or skip a row, so a malformed file fails when it is
loaded, naming the file and line, before any process starts. The prompt is rendered through the model's
chat template. Rewards run in worker processes (`llamarl.exec.reward_pool`), so reward functions must
be module-level (importable by name in a fresh process): a lambda is refused when the task is checked.

A run names its task by `task.name` (a built-in, or `reasoning_gym:DATASET`) or `task.module`
(`package.module:NAME` or `path/to/file.py:NAME`, a Task of the user's own); `load_task` resolves either,
with a one-line `TaskError` for a module that does not import or does not define a Task.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamarl.control.arithmetic import arithmetic_rows
from llamarl.exec.rewards import Reward, as_rewards, gsm8k_answer, last_boxed, math_answer

if TYPE_CHECKING:
    from llamarl.exec.environments import Environment
    from llamarl.exec.tools import Tool

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")


class DataError(ValueError):
    """A dataset that cannot be used as given; the message says what to fix."""


class TaskError(ValueError):
    """A task that cannot run as given (a module that does not import, a reward that cannot reach the
    reward workers, ...); the message says what to fix, in one line."""


@dataclass(frozen=True)
class Hub:
    """Rows of a dataset on the Hugging Face hub (read with `datasets`)."""

    id: str
    config: str | None = None


Rows = str | Hub | Callable[[str], Iterable[dict]] | Mapping[str, Sequence[dict]]
"""Where a task's rows come from: a local folder (or hub id) as a string, a `Hub`, a function of the
split ("train" or "test") returning rows, or `{"train": [...], "test": [...]}`."""

Prompt = str | Callable[[dict], str | list[dict[str, Any]]]
"""A format string filled from the row (`"{question}"`), or a function of the row returning the user's
text or the whole list of chat messages."""


@dataclass(frozen=True, kw_only=True)
class Task:
    """Rows, a prompt and weighted reward functions; with `tools` or `environment`, a multi-turn task.

    Attributes:
        name: short name (output folder, logs, checkpoints).
        rows: where the rows come from (see `Rows`); None: `task.data` must say.
        prompt: how a row becomes the user's message (see `Prompt`).
        rewards: reward functions `(prompt, completion, row) -> float`, each a function (weight 1), a
            `(function, weight)` pair or an `llamarl.exec.Reward` (batched, named); the task's reward is
            their weighted sum. In a multi-turn task they score the model's last turn, unless the
            environment finishes with a reward of its own.
        system: a system message put before the prompt (None: the template's default, if any).
        fields: fields every row must have (a row without one is an error naming its file and line).
        prepare: `row -> row or None`: checks and normalises a row (raise `DataError` for a row outside
            the schema; return None to skip an unusable row, counted in one warning).
        tools: tools the model may call (`llamarl.exec.tools`); makes the task multi-turn: after each
            model turn with tool calls the results come back as tool messages, a turn without one ends
            the episode and the rewards score it.
        environment: a factory (a class, or a module-level function) of `llamarl.exec.environments.
            Environment`: one new environment per episode, which replies to each model turn or finishes.
    """

    name: str
    rows: Rows | None = None
    prompt: Prompt = "{question}"
    rewards: Sequence[Any] = ()
    system: str | None = None
    fields: tuple[str, ...] = ()
    prepare: Callable[[dict], dict | None] | None = None
    tools: Sequence[Tool] = ()
    environment: Callable[[], Environment] | None = None
    _rewards: tuple[Reward, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise TaskError("a task needs a name")
        object.__setattr__(self, "_rewards", as_rewards(self.rewards))
        object.__setattr__(self, "tools", tuple(self.tools))
        if not self._rewards and self.environment is None:
            raise TaskError(f"task {self.name!r} has no reward functions and no environment to score it")

    @property
    def reward_functions(self) -> tuple[Reward, ...]:
        """The rewards, normalised to `Reward`s."""
        return self._rewards

    @property
    def multi_turn(self) -> bool:
        """Whether an episode can take several model turns (the task has tools or an environment)."""
        return bool(self.tools) or self.environment is not None

    def new_environment(self) -> Environment:
        """A fresh environment for one episode: the task's own, or one that runs its tools."""
        if self.environment is not None:
            return self.environment()
        from llamarl.exec.environments import ToolEnvironment

        return ToolEnvironment(self.tools)

    def messages(self, row: dict) -> list[dict[str, Any]]:
        """The chat messages of a row's prompt (before the chat template)."""
        if isinstance(self.prompt, str):
            try:
                content: Any = self.prompt.format_map(row)
            except (KeyError, IndexError, ValueError) as e:
                raise DataError(
                    f"task {self.name!r}: the prompt {self.prompt!r} cannot be filled ({e!r})"
                ) from None
        else:
            content = self.prompt(row)
        messages = content if isinstance(content, list) else [{"role": "user", "content": str(content)}]
        if self.system is not None and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.system}, *messages]
        return messages

    def check_row(self, row: Any, *, where: str) -> dict | None:
        """The row, checked and prepared, or None when `prepare` skips it; DataError (naming `where`) for
        a row outside the schema."""
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for name in self.fields:
            value = row.get(name)
            if value is None or (isinstance(value, str) and not value.strip()):
                raise DataError(f"{where}: missing or empty field '{name}'")
        if self.prepare is None:
            return row
        try:
            return self.prepare(row)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None

    def check(self) -> None:
        """Raises TaskError (one line) when the task cannot be sent to the ranks and reward workers."""
        parts: list[tuple[str, Any]] = [("prompt", self.prompt), ("prepare", self.prepare)]
        parts += [(f"rewards[{i}] ({r.name})", r.fn) for i, r in enumerate(self._rewards)]
        parts += [(f"tools[{i}]", t) for i, t in enumerate(self.tools)]
        parts += [("environment", self.environment)]
        for what, part in parts:
            if part is None:
                continue
            try:
                pickle.dumps(part)
            except Exception as e:
                raise TaskError(
                    f"task {self.name!r}: {what} cannot be sent to worker processes ({type(e).__name__}); "
                    "define it at module level (not a lambda or a nested function)"
                ) from None


# -- the built-in tasks, users of the same API ----------------------------------------------------


def _gsm8k_row(row: dict) -> dict | None:
    answer = row.get("answer")
    if not isinstance(answer, str):
        raise DataError("no reference answer (expected one of the fields answer)")
    return row if "####" in answer else None  # a worked answer without its final number: unusable


def _math_row(row: dict) -> dict | None:
    """MATH rows: the `answer` column, else the last \\boxed{} of the solution."""
    present = [name for name in ("answer", "solution") if isinstance(row.get(name), str)]
    if not present:
        raise DataError("no reference answer (expected one of the fields answer, solution)")
    for name in present:
        value = row[name].strip()
        reference = (last_boxed(value) if name == "solution" else value) if value else None
        if reference:
            return {**row, "answer": reference}
    return None


GSM8K = Task(
    name="gsm8k",
    rows=Hub("openai/gsm8k", config="main"),
    prompt="{question}\n\nSolve the problem step by step, then give the final number on its own line as "
    "'#### <number>'.",
    fields=("question",),
    prepare=_gsm8k_row,
    rewards=[gsm8k_answer],
)

MATH = Task(
    name="math",
    rows=Hub("DigitalLearningGmbH/MATH-lighteval"),
    prompt="{problem}\n\nSolve the problem step by step, then put the final answer in \\boxed{{}}.",
    fields=("problem",),
    prepare=_math_row,
    rewards=[math_answer],
)

ARITH = Task(
    name="arith",
    rows=arithmetic_rows,
    prompt="{question}\n\nGive the final number on its own line as '#### <number>'.",
    fields=("question",),
    prepare=_gsm8k_row,
    rewards=[gsm8k_answer],  # the final number, as for GSM8K
)

TASKS = {task.name: task for task in (GSM8K, MATH, ARITH)}
"""The built-in tasks by name."""

# -- loading rows ----------------------------------------------------------------------------------


def load_rows(task: Task, data: str | None, split: str) -> list[dict]:
    """The checked rows of one split ("train" or "test").

    `data` (the run's `task.data`) overrides the task's own rows: a local folder holding `train.jsonl` /
    `test.jsonl` (or `.jsonl.gz`) in the task's schema, or a hub dataset id.
    """
    source: Rows | None = task.rows if data is None else data
    if source is None:
        raise DataError(f"task {task.name!r} has no rows of its own; give a folder with --data")
    if isinstance(source, str):
        if Path(source).exists() or source.startswith((".", "/", "~")):
            return _load_jsonl(task, _split_file(Path(source).expanduser(), split))
        same = isinstance(task.rows, Hub) and task.rows.id == source
        source = Hub(source, config=task.rows.config if same else None)  # type: ignore[union-attr]
    if isinstance(source, Hub):
        return _load_hub(task, source, split)
    if isinstance(source, Mapping):
        if split not in source:
            raise DataError(
                f"task {task.name!r}: its rows have no {split!r} split (it has {', '.join(source)})"
            )
        rows: Iterable[dict] = source[split]
    elif callable(source):
        rows = source(split)
    else:
        raise DataError(f"task {task.name!r}: rows of type {type(source).__name__} are not a row source")
    return _checked(task, ((row, f"{task.name}[{split}][{i}]") for i, row in enumerate(rows)), task.name)


def hub_unavailable_reason(timeout_s: float = 3.0) -> str | None:
    """Why datasets cannot come from the hub right now (offline mode set, hub unreachable), or None.

    One quick connection attempt instead of letting `datasets` retry for tens of seconds with a
    warning each time: a machine without network learns it in at most `timeout_s`.
    """
    import socket
    from urllib.parse import urlparse

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"offline mode is set ({name})"
    from huggingface_hub import constants  # a dependency of `datasets`; only its endpoint is read

    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        return f"the hub is unreachable ({type(e).__name__})"
    return None


def _split_file(folder: Path, split: str) -> Path:
    """`split.jsonl` in `folder`, or its gzip-compressed `split.jsonl.gz` when only that exists."""
    plain = folder / f"{split}.jsonl"
    packed = folder / f"{split}.jsonl.gz"
    return packed if packed.is_file() and not plain.is_file() else plain


def _load_jsonl(task: Task, path: Path) -> list[dict]:
    if not path.is_file():
        raise DataError(f"{path}: file not found (--data must be a folder with train.jsonl and test.jsonl)")
    rows = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
            rows.append((row, where))
    return _checked(task, rows, str(path))


def _checked(task: Task, rows: Iterable[tuple[Any, str]], source: str) -> list[dict]:
    """The checked rows; rows `prepare` skips are counted in one warning."""
    kept, skipped = [], []
    for row, where in rows:
        checked = task.check_row(row, where=where)
        if checked is None:
            skipped.append(where)
        else:
            kept.append(checked)
    if not kept:
        raise DataError(f"{source}: no usable rows")
    if skipped:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        logger.warning("skipped %d row(s) without a usable reference answer: %s", len(skipped), shown)
    return kept


def _load_hub(task: Task, hub: Hub, split: str) -> list[dict]:
    import datasets  # imported here: local runs never pay for it

    try:
        rows = datasets.load_dataset(hub.id, hub.config, split=split)
    except Exception as e:  # the hub raises many types; the user needs the id and the reason
        raise DataError(f"could not load dataset '{hub.id}' split '{split}': {e}") from None
    return _checked(task, ((dict(row), f"{hub.id}[{split}][{i}]") for i, row in enumerate(rows)), hub.id)
