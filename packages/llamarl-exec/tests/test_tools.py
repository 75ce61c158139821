"""Tools: the calculator, Python in a sandbox (time, memory, output limits, no network), a user's
function as a tool, tool calls read from a model's text, and the environment that runs them."""

from __future__ import annotations

import time

import pytest

from llamarl.exec.multiturn.environments import Finish, ModelTurn, Reply, ToolEnvironment
from llamarl.exec.multiturn.sandbox import MAX_ERROR_CHARS, Limits
from llamarl.exec.multiturn.tools import Calculator, FunctionTool, PythonTool, ToolCall, parse_tool_calls
from llamarl.exec.testing import lookup_capital

pytestmark = pytest.mark.timeout(120)


def test_calculator_evaluates_arithmetic_and_refuses_the_rest():
    calc = Calculator()
    assert calc(expression="(12 + 7) * 3") == "57"
    assert calc(expression="7 / 2") == "3.5"
    assert calc(expression="sqrt(16) + 2**10") == "1028"
    for bad, message in [
        ("__import__('os')", "unsupported"),
        ("2 ** 1000", "exponent"),
        ("10**60 * 10**60", "digits"),
        ("1 +", "not an arithmetic expression"),
    ]:
        with pytest.raises(ValueError, match=message):
            calc(expression=bad)


def test_python_tool_runs_code_and_is_killed_at_each_limit():
    tool = PythonTool(limits=Limits(timeout_s=2.0, memory_mb=256, max_output_bytes=1000))
    assert tool(code="print(sum(range(10)))") == "45\n"
    start = time.monotonic()
    assert tool(code="while True: pass").endswith("[killed: time limit]")
    assert time.monotonic() - start < 5
    flood = tool(code="while True: print('spam' * 100)")
    assert flood.endswith("[killed: output limit]") and len(flood) < 1100
    assert "MemoryError" in tool(code="x = bytearray(1 << 30)")
    network = tool(code="import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)")
    assert "Error" in network and "[exit code 1]" in network


def test_a_users_function_is_a_tool_with_a_schema_and_limits():
    tool = FunctionTool(lookup_capital, limits=Limits(timeout_s=3.0, memory_mb=None, max_output_bytes=2000))
    schema = tool.schema()["function"]
    assert schema["name"] == "lookup_capital"
    assert schema["parameters"]["properties"]["country"]["type"] == "string"
    assert tool(country="France") == "Paris"
    with pytest.raises(RuntimeError, match="time limit"):
        tool(country="loop")
    with pytest.raises(RuntimeError, match="output limit"):
        tool(country="flood")


def test_tool_calls_in_the_hermes_format():
    call = '{"name": "calculator", "arguments": {"expression": "2+2"}}'
    text = f"Let me compute.\n<tool_call>\n{call}\n</tool_call>"
    assert parse_tool_calls(text) == ([ToolCall("calculator", {"expression": "2+2"})], [])
    listed = '<tool_call>[{"name": "a", "arguments": "{\\"x\\": 1}"}, {"name": "b"}]</tool_call>'
    assert parse_tool_calls(listed) == ([ToolCall("a", {"x": 1}), ToolCall("b", {})], [])
    calls, problems = parse_tool_calls("<tool_call>{not json</tool_call>")
    assert calls == [] and "not valid JSON" in problems[0]
    assert parse_tool_calls("The answer is 4.") == ([], [])


def test_tool_environment_answers_calls_and_finishes_on_an_answer():
    env = ToolEnvironment([Calculator(), lookup_capital])
    env.start({})
    reply = env.step(
        ModelTurn(
            "",
            [
                ToolCall("calculator", {"expression": "6*7"}),
                ToolCall("nope"),
                ToolCall("calculator", {"x": 1}),
            ],
            0,
            ["the tool call is not valid JSON"],
        )
    )
    assert isinstance(reply, Reply)
    contents = [m["content"] for m in reply.messages]
    assert contents[0].startswith("error: the tool call is not valid JSON")
    assert contents[1] == "42"
    assert "no tool named 'nope'" in contents[2] and "calculator, lookup_capital" in contents[2]
    assert "unexpected arguments" in contents[3]
    assert env.step(ModelTurn("It is 42.", [], 1)) == Finish()


def test_a_tool_that_raises_tells_the_model_its_exception():
    env = ToolEnvironment([FunctionTool(lookup_capital, limits=Limits(timeout_s=10.0, memory_mb=None))])
    env.start({})
    calls = [ToolCall("lookup_capital", {"country": c}) for c in ("Atlantis", "verbose")]
    calls.append(ToolCall("lookup_capital", {"city": "Paris"}))
    reply = env.step(ModelTurn("", calls, 0))
    atlantis, verbose, wrong_argument = (m["content"] for m in reply.messages)
    assert atlantis == "error: KeyError: 'no capital known for Atlantis'"
    assert verbose.startswith("error: ValueError: why why ") and verbose.endswith("...")
    assert len(verbose) <= len("error: ") + MAX_ERROR_CHARS + 3
    assert wrong_argument.startswith("error: TypeError: lookup_capital() got an unexpected keyword argument")
