"""The Task API: what a run learns. A task is rows + a prompt + reward functions (and, for multi-turn
tasks, tools or an environment); the built-in tasks (`llamarl.control.tasks.gsm8k`, `.math`, `.arith`,
`.calc`, `.retry`) are tasks like any user's.

    from llamarl.control import Task

    def correct(prompt, completion, row):              # a plain Python reward function
        return float(row["answer"] in completion)

    TASK = Task(
        name="capitals",
        rows={"train": [...], "test": [...]},        # or a folder of JSONL files, Hub("id"), or a function
        prompt="What is the capital of {country}?",  # or a function row -> text or chat messages
        rewards=[correct, (brief, 0.1)],             # weighted; batched and async functions too
    )

Each row is a dict; `fields` names the ones every row must have and `prepare` may check, normalise or
skip a row, and the prompt is filled from every row, so a malformed file (a row without a field the
prompt names, say) fails when it is loaded (`llamarl.control.tasks.rows`), naming the file and line,
before any process starts. The prompt is rendered through the model's chat template. Rewards run in
worker processes (`llamarl.exec.reward.pool`), so reward functions must be module-level (importable by
name in a fresh process): a lambda is refused when the task is checked (`Task.check`), as is a tool
whose schema cannot be made from its signature and docstring.
"""

from __future__ import annotations

import pickle
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llamarl.exec.reward.functions import Reward, as_rewards

if TYPE_CHECKING:
    from llamarl.exec.multiturn.environments import Environment
    from llamarl.exec.multiturn.tools import Tool


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

Correct = Callable[[list[dict[str, Any]], str, dict], bool] | float
"""When a sample is right: a function `(prompt, completion, row) -> bool`, or a reward threshold (right
when the sample's reward is above it)."""


def prompt_fields(template: str) -> tuple[str, ...]:
    """The row fields a format-string prompt names, in order (`"{question} {meta[id]}"` -> question,
    meta). ValueError (one line) for a template that is not one: unbalanced braces, positional fields."""
    names: list[str] = []
    for _, name, spec, _ in string.Formatter().parse(template):
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not root or root.isdigit():
            raise ValueError(
                f"the prompt's field {{{name}}} is positional; name a row field, e.g. {{question}}"
            )
        names += [root, *prompt_fields(spec or "")]  # a field in a format spec: "{value:{width}}"
    return tuple(dict.fromkeys(names))


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
        tools: tools the model may call (`llamarl.exec.multiturn.tools`); makes the task multi-turn: after
        each model turn with tool calls the results come back as tool messages, a turn without one ends
            the episode and the rewards score it.
        environment: a factory (a class, or a module-level function) of `llamarl.exec.multiturn.environments.
            Environment`: one new environment per episode, which replies to each model turn or finishes.
        correct: when a sample is right, for an evaluation's accuracy (see `Correct`): a module-level
            function `(prompt, completion, row) -> bool` (in a multi-turn task `completion` is the last
            turn), or a reward threshold, right when the sample's reward is above it (`correct=0.0`:
            any reward at all). None: the task does not say (an evaluation can only report rewards).
            The built-in tasks say: their answer checker's verdict (GSM8K, MATH, arith, calc), or a
            reward above 0 (retry).
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
    correct: Correct | None = None
    _rewards: tuple[Reward, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise TaskError("a task needs a name")
        object.__setattr__(self, "_rewards", as_rewards(self.rewards))
        object.__setattr__(self, "tools", tuple(self.tools))
        if not self._rewards and self.environment is None:
            raise TaskError(f"task {self.name!r} has no reward functions and no environment to score it")
        if isinstance(self.correct, bool) or not (
            self.correct is None or callable(self.correct) or isinstance(self.correct, int | float)
        ):
            raise TaskError(
                f"task {self.name!r}: correct must be a function (prompt, completion, row) -> bool or a "
                f"reward threshold, not {self.correct!r}"
            )

    def is_correct(
        self, prompt: list[dict[str, Any]], completion: str, row: dict, reward: float
    ) -> bool | None:
        """Whether a sample is right by the task's `correct`: its function's verdict, or whether `reward`
        (the sample's reward) is above its threshold; None when the task has no `correct`."""
        if self.correct is None:
            return None
        if callable(self.correct):
            return bool(self.correct(prompt, completion, row))
        return reward > self.correct

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
        from llamarl.exec.multiturn.environments import ToolEnvironment

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
        a row outside the schema, or one the prompt cannot be made from (a field it names is missing)."""
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for name in self.fields:
            value = row.get(name)
            if value is None or (isinstance(value, str) and not value.strip()):
                raise DataError(f"{where}: missing or empty field '{name}'")
        if self.prepare is not None:
            try:
                row = self.prepare(row)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
            if row is None:
                return None
        self._check_prompt(row, where)
        return row

    def _check_prompt(self, row: dict, where: str) -> None:
        """DataError naming `where` when the prompt cannot be made from `row` (checked when the rows are
        loaded, so that no rank meets it while sampling)."""
        if isinstance(self.prompt, str):
            try:
                missing = [name for name in prompt_fields(self.prompt) if name not in row]
            except ValueError as e:
                raise DataError(f"task {self.name!r}: {e}") from None
            if missing:
                raise DataError(f"{where}: missing field '{missing[0]}' (the prompt names it)")
        try:
            self.messages(row)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
        except Exception as e:  # the user's prompt function: any error, named with its row
            raise DataError(f"{where}: the prompt function raised {type(e).__name__}: {e}") from None

    def check(self) -> None:
        """Raises TaskError (one line) when the task cannot be sent to the ranks and reward workers, its
        prompt is not a format string of row fields, or a tool's schema cannot be made."""
        if isinstance(self.prompt, str):
            try:
                prompt_fields(self.prompt)
            except ValueError as e:
                raise TaskError(f"task {self.name!r}: {e}") from None
        self._check_tools()
        parts: list[tuple[str, Any]] = [("prompt", self.prompt), ("prepare", self.prepare)]
        parts += [(f"rewards[{i}] ({r.name})", r.fn) for i, r in enumerate(self._rewards)]
        parts += [(f"tools[{i}]", t) for i, t in enumerate(self.tools)]
        parts += [("environment", self.environment), ("correct", self.correct)]
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

    def _check_tools(self) -> None:
        """TaskError naming the tool and the argument when a tool's schema cannot be made (a user's
        function needs a type hint and an `Args:` entry in its docstring for every argument)."""
        from llamarl.exec.multiturn.tools import as_tool

        for i, item in enumerate(self.tools):
            try:
                tool = as_tool(item)
                tool.schema()
            except Exception as e:  # transformers' schema parser raises its own exception types
                name = getattr(item, "name", None) or getattr(item, "__name__", f"tools[{i}]")
                raise TaskError(f"task {self.name!r}: tool {name!r}: {_schema_problem(e)}") from None


def _schema_problem(error: Exception) -> str:
    """What a tool's schema lacks, in a few words, from the schema parser's exception."""
    message = str(error)
    if found := re.search(r"no description for the argument '(\w+)'", message):
        return f"its docstring has no Args: entry for the argument '{found[1]}'"
    if found := re.search(r"Argument (\w+) is missing a type hint", message):
        return f"the argument '{found[1]}' has no type hint"
    if "has no docstring" in message:
        return "it has no docstring (its description and Args: entries tell the model how to call it)"
    return f"its schema cannot be made ({type(error).__name__}: {' '.join(message.split())})"
