"""Tools a model may call in a multi-turn episode, and the tool-call format of its chat template.

Ready tools: `Calculator` (arithmetic, evaluated in this process on a parsed expression, never `eval`),
`PythonTool` (the model's code in a sandboxed child process: time, memory and output limits, no network,
killed at its limit; `llamarl.exec.multiturn.sandbox`), and `FunctionTool` (a user's module-level function,
described to the model from its signature and docstring, called in a child process with time, memory
and output limits).

The tool format: a chat template that renders `tools` (Qwen2.5, Llama 3.1, Hermes, ...) gets their JSON
schemas through `apply_chat_template(..., tools=...)`; for one that ignores them (SmolLM2's) the tools
are described in the system message in the Hermes format that most templates use:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Calls are parsed from the model's text by the tokenizer's own response parser where it has one
(transformers' `response_schema`), else from `<tool_call>` blocks; results go back as `tool` messages.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from llamarl.exec.multiturn.sandbox import MAX_ERROR_CHARS, Limits, call_function, run_python


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    """Something the model can call by name. Instances travel to the generator ranks (picklable)."""

    name: str

    def schema(self) -> dict[str, Any]:
        """The tool's description as a JSON schema in the chat templates' function format."""
        ...

    def __call__(self, **arguments: Any) -> str:
        """Runs the tool; returns its result as the text the model reads. May raise (reported to the
        model as an error); must not run past its limits."""
        ...


def _schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": parameters, "required": list(parameters)},
        },
    }


# -- calculator -------------------------------------------------------------------------------------

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}


@dataclass(frozen=True)
class Calculator:
    """Evaluates an arithmetic expression: + - * / // % **, parentheses, sqrt, abs, round, min, max.

    Parsed and evaluated node by node (no `eval`); exponents and results are bounded so that no
    expression can take long or grow huge.
    """

    name: str = "calculator"
    max_exponent: int = 64
    max_digits: int = 100

    def schema(self) -> dict[str, Any]:
        return _schema(
            self.name,
            "Evaluates an arithmetic expression, e.g. '(12 + 7) * 3' or 'sqrt(2) / 4'.",
            {"expression": {"type": "string", "description": "the expression to evaluate"}},
        )

    def __call__(self, expression: str = "", **unexpected: Any) -> str:
        if unexpected:
            raise ValueError(f"unexpected arguments {sorted(unexpected)}; the calculator takes 'expression'")
        try:
            tree = ast.parse(str(expression).strip(), mode="eval")
        except SyntaxError:
            raise ValueError(f"not an arithmetic expression: {expression!r}") from None
        value = self._eval(tree.body)
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return str(value)

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise ValueError(f"exponent {right} is too large (at most {self.max_exponent})")
            return self._bounded(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
            and not node.keywords
        ):
            return self._bounded(_FUNCTIONS[node.func.id](*(self._eval(a) for a in node.args)))
        raise ValueError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")

    def _bounded(self, value: Any) -> int | float:
        if isinstance(value, int) and len(str(abs(value))) > self.max_digits:
            raise ValueError(f"the result has more than {self.max_digits} digits")
        return value


# -- Python in a sandbox ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PythonTool:
    """Runs the model's Python code in a sandboxed child process; returns what it printed.

    Limits: `timeout_s` of wall-clock (and CPU) time, `memory_mb` of address space, `max_output_bytes`
    of output (more kills it), no network, a temporary working folder. A run killed at a limit returns
    its output so far and a last line saying which limit.
    """

    name: str = "python"
    limits: Limits = field(default_factory=Limits)

    def schema(self) -> dict[str, Any]:
        return _schema(
            self.name,
            "Runs Python code and returns what it prints (use print). No network, short time limit.",
            {"code": {"type": "string", "description": "the Python code to run"}},
        )

    def __call__(self, code: str = "", **unexpected: Any) -> str:
        if unexpected:
            raise ValueError(f"unexpected arguments {sorted(unexpected)}; the python tool takes 'code'")
        return run_python(str(code), self.limits).describe() or "(no output)"


# -- a user's function ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FunctionTool:
    """A user's module-level function as a tool.

    Its schema comes from its type hints and Google-style docstring (transformers' `get_json_schema`);
    each call runs in a child process (importing the function's module there) with `limits` (time,
    memory, output; network allowed by default: it is the user's own code).
    """

    function: Any
    limits: Limits = field(default_factory=lambda: Limits(timeout_s=10.0, memory_mb=None, network=True))

    @property
    def name(self) -> str:
        return self.function.__name__

    def schema(self) -> dict[str, Any]:
        from transformers.utils import get_json_schema

        return get_json_schema(self.function)

    def __call__(self, **arguments: Any) -> str:
        result = call_function(self.function.__module__, self.function.__qualname__, arguments, self.limits)
        if result.raised is not None:  # the function's own exception, type and message
            raise ToolError(result.raised)
        if not result.ok:  # the last line says why: the limit it was killed at
            lines = result.describe().strip().splitlines()
            raise ToolError(lines[-1].strip("[]") if lines else f"exit code {result.exit_code}")
        return result.output


class ToolError(RuntimeError):
    """A tool call that failed in its child process; the message is what the model reads after
    "error: ": the function's exception ("ValueError: no such city") or the limit it was killed at."""


def error_text(error: Exception) -> str:
    """What the model reads for a failed tool call: "error: Type: message", at most `MAX_ERROR_CHARS`
    of the message."""
    text = str(error) if isinstance(error, ToolError) else f"{type(error).__name__}: {error}"
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    return f"error: {text}"


def as_tool(item: Any) -> Tool:
    """A tool as given: a `Tool`, or a plain function (wrapped in `FunctionTool`)."""
    if isinstance(item, Tool):
        return item
    if callable(item) and hasattr(item, "__qualname__"):
        return FunctionTool(item)
    raise TypeError(f"not a tool: {item!r} (a Tool, or a module-level function)")


# -- the tool format --------------------------------------------------------------------------------

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

HERMES_INSTRUCTIONS = (
    "You can call tools. Their descriptions:\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, write a JSON object with its name and arguments between tags:\n"
    '<tool_call>\n{{"name": "<tool name>", "arguments": {{<arguments>}}}}\n</tool_call>\n'
    "The result comes back in a tool message. When you have the final answer, reply without a tool call."
)


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows `tools` to the model itself."""
    messages = [{"role": "user", "content": "hi"}]
    probe = [_schema("probe_tool_name", "probe", {})]
    with_tools = tokenizer.apply_chat_template(messages, tools=probe, tokenize=False)
    return "probe_tool_name" in with_tools


def with_tool_instructions(messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[dict]:
    """`messages` with the tools described in the system message (for templates that ignore `tools`)."""
    text = HERMES_INSTRUCTIONS.format(tools="\n".join(json.dumps(s) for s in schemas))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def parse_tool_calls(text: str, tokenizer=None) -> tuple[list[ToolCall], list[str]]:
    """The tool calls in a model's turn, and a note per call that could not be read.

    The tokenizer's response parser is used where it has one; otherwise `<tool_call>` blocks holding
    `{"name": ..., "arguments": {...}}` (or a list of them). A turn without calls gives ([], []).
    """
    if tokenizer is not None and getattr(tokenizer, "response_schema", None):
        parsed = tokenizer.parse_response(text)
        calls = [c.get("function", c) for c in parsed.get("tool_calls") or []]
        return [ToolCall(c["name"], _arguments(c.get("arguments"))) for c in calls], []
    calls: list[ToolCall] = []
    problems: list[str] = []
    for block in TOOL_CALL.findall(text):
        try:
            value = json.loads(block)
        except json.JSONDecodeError as e:
            problems.append(f"the tool call is not valid JSON ({e.msg}): {block[:200]}")
            continue
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                problems.append(f"a tool call needs a 'name': {json.dumps(item)[:200]}")
                continue
            try:
                calls.append(ToolCall(item["name"], _arguments(item.get("arguments", {}))))
            except ValueError as e:
                problems.append(str(e))
    return calls, problems


def _arguments(value: Any) -> dict[str, Any]:
    if isinstance(value, str):  # some formats carry the arguments as a JSON string
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"tool arguments are not valid JSON: {value[:200]}") from None
    if not isinstance(value, dict):
        raise ValueError(f"tool arguments must be an object, got {json.dumps(value)[:200]}")
    return value
