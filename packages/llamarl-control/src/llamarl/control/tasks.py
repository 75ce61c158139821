"""Math tasks: load question/answer rows from local JSONL files or the hub, and turn them into prompts.

A `Task` knows its dataset schema (which field is the question, how to read the reference answer), the
instruction appended to each question, and the name of the reward function the rewarder runs. Rows are
validated when loaded, so a malformed file fails before any process is started.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from llamarl.control.arithmetic import arithmetic_rows
from llamarl.exec.rewards import last_boxed

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset that cannot be used as given; the message says what to fix."""


@dataclass(frozen=True, kw_only=True)
class Example:
    """One problem: the question shown to the model and the reference its answer is checked against."""

    question: str
    reference: str


@dataclass(frozen=True, kw_only=True)
class Task:
    """A dataset schema plus the prompt and reward conventions of one math benchmark."""

    name: str  # short name: the app's and the run configuration's name for the task
    reward_fn: str  # name of the answer checker in llamarl.exec.rewards
    hub_id: str | None  # default dataset on the hub; None for a synthetic task
    hub_config: str | None  # dataset config name on the hub, if any
    question_field: str  # field holding the problem statement
    reference_fields: tuple[str, ...]  # fields tried in order for the reference answer
    instruction: str  # appended to each question: tells the model how to format its final answer
    synthesize: Callable[[str], list[dict]] | None = None  # rows of a split, for a task made in code

    def example_from_row(self, row: dict, *, where: str) -> Example | None:
        """Validates one dataset row and returns it as an Example; `where` names the row in errors.

        A row outside the schema (not an object, no question, none of the reference fields) raises
        DataError. A row in the schema whose reference holds no usable answer (an empty `answer`, an
        empty `\\boxed{}`, a GSM8K answer without `####`: real datasets have a few) returns None, and
        the loader skips it.
        """
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        question = row.get(self.question_field)
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{where}: missing or empty field '{self.question_field}'")
        present = [field for field in self.reference_fields if isinstance(row.get(field), str)]
        if not present:
            expected = ", ".join(self.reference_fields)
            raise DataError(f"{where}: no reference answer (expected one of the fields {expected})")
        for field in present:
            reference = self._reference_from(field, row[field])
            if reference:
                return Example(question=question.strip(), reference=reference)
        return None

    def _reference_from(self, field: str, value: str) -> str | None:
        if not value.strip():
            return None
        if field == "solution":  # MATH rows without an `answer` column: the last \boxed{} of the solution
            return last_boxed(value)
        if self.reward_fn == "gsm8k" and "####" not in value:
            return None
        return value.strip()

    def messages(self, example: Example) -> list[dict[str, str]]:
        """The chat messages of one prompt."""
        return [{"role": "user", "content": f"{example.question}\n\n{self.instruction}"}]


GSM8K = Task(
    name="gsm8k",
    reward_fn="gsm8k",
    hub_id="openai/gsm8k",
    hub_config="main",
    question_field="question",
    reference_fields=("answer",),
    instruction=(
        "Solve the problem step by step, then give the final number on its own line as '#### <number>'."
    ),
)

MATH = Task(
    name="math",
    reward_fn="math",
    hub_id="DigitalLearningGmbH/MATH-lighteval",
    hub_config=None,
    question_field="problem",
    reference_fields=("answer", "solution"),
    instruction="Solve the problem step by step, then put the final answer in \\boxed{}.",
)

ARITH = Task(
    name="arith",
    reward_fn="gsm8k",  # the final number, as for GSM8K
    hub_id=None,
    hub_config=None,
    question_field="question",
    reference_fields=("answer",),
    instruction="Give the final number on its own line as '#### <number>'.",
    synthesize=arithmetic_rows,
)

TASKS = {task.name: task for task in (GSM8K, MATH, ARITH)}


def load_examples(task: Task, data: str | None, split: str) -> list[Example]:
    """Loads and validates one split.

    `data` is a local folder holding `train.jsonl` / `test.jsonl` (or `.jsonl.gz`) in the hub schema, a
    hub dataset id, or None for the task's default: its hub dataset, or the rows it makes in code.
    """
    if data is not None and (Path(data).exists() or data.startswith((".", "/", "~"))):
        return _load_jsonl(task, _split_file(Path(data).expanduser(), split))
    if data is None and task.synthesize is not None:
        rows = task.synthesize(split)
        return _examples(task, ((row, f"{task.name}[{split}][{i}]") for i, row in enumerate(rows)), task.name)
    if data is None and task.hub_id is None:
        raise DataError(f"task {task.name!r} has no default dataset; give a folder with --data")
    return _load_hub(task, data or task.hub_id, split)


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


def _load_jsonl(task: Task, path: Path) -> list[Example]:
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
    return _examples(task, rows, str(path))


def _examples(task: Task, rows: Iterable[tuple[dict, str]], source: str) -> list[Example]:
    """Validated examples of `rows`; rows without a usable answer are skipped with one warning."""
    examples, skipped = [], []
    for row, where in rows:
        example = task.example_from_row(row, where=where)
        if example is None:
            skipped.append(where)
        else:
            examples.append(example)
    if not examples:
        raise DataError(f"{source}: no rows with a usable reference answer")
    if skipped:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        logger.warning("skipped %d row(s) without a usable reference answer: %s", len(skipped), shown)
    return examples


def _load_hub(task: Task, dataset_id: str, split: str) -> list[Example]:
    import datasets  # imported here: local runs never pay for it

    config = task.hub_config if dataset_id == task.hub_id else None
    try:
        rows = datasets.load_dataset(dataset_id, config, split=split)
    except Exception as e:  # the hub raises many types; the user needs the id and the reason
        raise DataError(f"could not load dataset '{dataset_id}' split '{split}': {e}") from None
    return [
        task.example_from_row(dict(row), where=f"{dataset_id}[{split}][{i}]") for i, row in enumerate(rows)
    ]
