"""Prompts: which dataset rows a generator samples, in which order, and how a row becomes token ids.

- `PromptStream`: one generator's share of every step's prompts, in the run's shuffled order.
- `PromptSource`: what a generator loop needs of the rows (token ids, chat messages, the row, decoded
  completions); `TaskPrompts` is the real one, through the model's chat template (with the task's
  tools, in the template's tool format, for a multi-turn task).
"""

from __future__ import annotations

import random
from typing import Any, Protocol

from llamarl.control.tasks.task import Task
from llamarl.exec.types import RolloutBatch


def data_order(num_rows: int, seed: int) -> list[int]:
    """The run's shuffled order of its training rows (row indices), from the seed alone: every rank
    computes the same one, and a resumed run the same again."""
    order = list(range(num_rows))
    random.Random(seed).shuffle(order)
    return order


class PromptStream:
    """The prompts one generator samples, in order: its share of every step's prompts.

    The k-th prompt of generator g is the (k mod S)-th of g's S = prompts_per_step / num_generators
    slots in step k // S of the shuffled `order`, so a lock-step run that takes S per tick sees exactly
    the prompts of that tick; dynamic sampling and stream mode simply read further. `position` is the
    state to checkpoint.
    """

    def __init__(self, order: list[int], *, prompts_per_step: int, generator_index: int, num_generators: int):
        self.order = order
        self.prompts_per_step = prompts_per_step
        self.share = prompts_per_step // num_generators
        self.offset = generator_index * self.share
        self.position = 0

    def take(self, count: int) -> list[int]:
        """The next `count` dataset indices of this generator."""
        return [self.index(p) for p in self.take_positions(count)]

    def take_positions(self, count: int) -> list[int]:
        """The next `count` prompts of this generator, as positions in the run's data order (the
        order continues past its end: position p is row order[p % len(order)])."""
        positions = []
        for k in range(self.position, self.position + count):
            step, slot = divmod(k, self.share)
            positions.append(step * self.prompts_per_step + self.offset + slot)
        self.position += count
        return positions

    def index(self, position: int) -> int:
        """The dataset index at `position` of the data order."""
        return self.order[position % len(self.order)]


class PromptSource(Protocol):
    """The rows of one split as a generator sees them, by dataset index."""

    def encode(self, index: int) -> list[int]:
        """Token ids of row `index`'s prompt (chat template applied), no padding."""
        ...

    def messages(self, index: int) -> list[dict[str, Any]]:
        """The chat messages of row `index`'s prompt (what reward functions get as `prompt`)."""
        ...

    def row(self, index: int) -> dict:
        """The dataset row (what reward functions get as `row`)."""
        ...

    def question(self, index: int) -> str:
        """The prompt as text (for the samples log)."""
        ...

    def decode(self, batch: RolloutBatch) -> list[str]:
        """The completions of `batch` as text, special tokens dropped."""
        ...


def load_tokenizer(model: str):
    """The model's tokenizer with left padding (prompts are left-padded for batched generation)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    return tokenizer


class TaskPrompts:
    """A task's rows through a model's chat template; implements `PromptSource` (encodings cached).

    For a task with tools, the tools' schemas go to the template (`tools=`); a template that ignores
    them gets them described in the system message, in the Hermes `<tool_call>` format that
    `llamarl.exec.multiturn.tools.parse_tool_calls` reads back.
    """

    def __init__(self, task: Task, rows: list[dict], tokenizer) -> None:
        self.task = task
        self.rows = rows
        self.tokenizer = tokenizer
        self._ids: dict[int, list[int]] = {}
        self.tool_schemas: list[dict] | None = None
        self._describe_tools = False
        if task.tools:
            from llamarl.exec.multiturn.tools import as_tool, template_renders_tools

            self.tool_schemas = [as_tool(t).schema() for t in task.tools]
            self._describe_tools = not template_renders_tools(tokenizer)

    def messages(self, index: int) -> list[dict[str, Any]]:
        return self.task.messages(self.rows[index])

    def encode(self, index: int) -> list[int]:
        if index not in self._ids:
            messages = self.messages(index)
            extra: dict[str, Any] = {}
            if self.tool_schemas and self._describe_tools:
                from llamarl.exec.multiturn.tools import with_tool_instructions

                messages = with_tool_instructions(messages, self.tool_schemas)
            elif self.tool_schemas:
                extra["tools"] = self.tool_schemas
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **extra
            )
            # Newer transformers return a BatchEncoding here; older ones a plain list.
            self._ids[index] = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return self._ids[index]

    def row(self, index: int) -> dict:
        return self.rows[index]

    def question(self, index: int) -> str:
        return str(self.messages(index)[-1].get("content", ""))

    def glue_tools(self) -> list[dict] | None:
        """The tools as the chat template gets them when it renders the environment's replies."""
        return self.tool_schemas if not self._describe_tools else None

    def decode(self, batch: RolloutBatch) -> list[str]:
        ids = [
            row[mask.bool()].tolist()
            for row, mask in zip(batch.completion_ids_BC, batch.completion_mask_BC, strict=True)
        ]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)
