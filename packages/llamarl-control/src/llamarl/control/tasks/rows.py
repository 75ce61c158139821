"""Loading a task's rows: a local folder (`train.jsonl` / `test.jsonl`, or `.jsonl.gz`), a hub dataset
(`Hub`), a function of the split name, or lists given in code; each row checked by the task
(`Task.check_row`), so a malformed file fails naming its file and line, before any process starts.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from llamarl.control.tasks.task import DataError, Hub, Rows, Task

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")


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
