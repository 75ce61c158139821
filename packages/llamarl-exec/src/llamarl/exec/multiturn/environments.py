"""Multi-turn environments: after each model turn an environment replies (tool results, feedback) or
finishes the episode with a reward.

    class Guess:                                       # one instance per episode
        def start(self, row):                          # the episode's row (its prompt is the task's)
            self.secret, self.tries = row["secret"], 0
        def step(self, turn):                          # turn.text, turn.tool_calls, turn.index
            self.tries += 1
            if str(self.secret) in turn.text:
                return Finish(reward=1.0 / self.tries)
            return Reply([{"role": "user", "content": "No, try again."}])

The episode runner (`llamarl.exec.multiturn.episodes`) lays the conversation token by token: the model's
tokens are kept as sampled, the environment's messages go through the chat template and are masked out of the
loss. A turn limit or token limit ends an episode without a `Finish`; then the task's reward functions
score it (0 when it has none). An environment that raises drops its episode (counted), never the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from llamarl.exec.multiturn.tools import Tool, ToolCall, as_tool, error_text


@dataclass(frozen=True)
class ModelTurn:
    """One model turn as the environment sees it."""

    text: str  # the turn's text, special tokens dropped
    tool_calls: list[ToolCall]  # parsed in the chat template's tool format
    index: int  # 0 for the first turn
    problems: list[str] = field(default_factory=list)  # tool calls that could not be read


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a turn: chat messages (`tool`, `user`, ...) shown to the model next."""

    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class Finish:
    """The episode is over. `reward`: its reward; None: the task's reward functions score the last turn."""

    reward: float | None = None


class Environment(Protocol):
    """One episode's environment; a task's `environment` is a factory of these (one per episode)."""

    def start(self, row: dict) -> None:
        """Called once before the first turn with the episode's dataset row."""
        ...

    def step(self, turn: ModelTurn) -> Reply | Finish:
        """Replies to a model turn, or finishes the episode."""
        ...


class ToolEnvironment:
    """Runs the model's tool calls: a turn with calls gets their results as `tool` messages, a turn
    without one is the final answer (finish; the task's rewards score it). A call to an unknown tool,
    one that cannot be read or one that fails is answered with the error, so the model can learn from it.
    """

    def __init__(self, tools: Sequence[Tool | Any]) -> None:
        self.tools = {tool.name: tool for tool in map(as_tool, tools)}

    def start(self, row: dict) -> None:
        self.row = row

    def step(self, turn: ModelTurn) -> Reply | Finish:
        if not turn.tool_calls and not turn.problems:
            return Finish()
        messages = [{"role": "tool", "content": f"error: {problem}"} for problem in turn.problems]
        for call in turn.tool_calls:
            tool = self.tools.get(call.name)
            if tool is None:
                result = f"error: no tool named {call.name!r}; tools: {', '.join(self.tools)}"
            else:
                try:
                    result = tool(**call.arguments)
                except Exception as e:  # the model's call was wrong: it reads why
                    result = error_text(e)
            messages.append({"role": "tool", "name": call.name, "content": result})
        return Reply(messages)
