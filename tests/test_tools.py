"""Tools: schemas from plain functions (transformers' get_json_schema, the one
apply_chat_template(tools=[fn]) uses), the hermes and plain call parsers on good, partial
and malformed calls, and every failure turned into an error message the model reads."""

from __future__ import annotations

import time

import pytest

from rlhflab.envs.base import EnvError
from rlhflab.envs.tools import answer_calls, load_tools, parse_hermes, parse_plain, tools_system_prompt

TOOLS_PY = '''
import time


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "2 + 3"
    """
    if set(expression) - set("0123456789+-*/(). "):
        raise ValueError("only numbers and + - * / ( )")
    return str(eval(expression))


def add(a: int, b: int = 1) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def slow(x: int) -> int:
    """Sleep.

    Args:
        x: anything
    """
    time.sleep(5)
    return x


def undocumented(x: int) -> int:
    """No Args section."""
    return x


def untyped(x):
    """Untyped.

    Args:
        x: anything
    """
    return x
'''


@pytest.fixture
def tools_dir(tmp_path, monkeypatch):
    (tmp_path / "my_tools_t.py").write_text(TOOLS_PY)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def tools(tools_dir):
    return load_tools(["my_tools_t:calculator", "my_tools_t.py:add", "my_tools_t:slow"])


def test_schema_from_signature_and_docstring(tools, tools_dir):
    calc, add = tools[0].schema, tools[1].schema
    assert calc == {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                      "description": 'the expression, e.g. "2 + 3"'}},
                       "required": ["expression"]},
        "return": {"type": "string"}}}
    # b has a default, so only a is required; int -> integer.
    assert add["function"]["parameters"]["required"] == ["a"]
    assert add["function"]["parameters"]["properties"]["b"]["type"] == "integer"
    # apply_chat_template builds the same schema from the function itself.
    from transformers.utils import get_json_schema
    assert get_json_schema(tools[0].fn) == calc


@pytest.mark.parametrize("spec,match", [("my_tools_t:undocumented", "describe it under 'Args:'"),
                                        ("my_tools_t:untyped", "type hint"),
                                        ("my_tools_t:nope", "has no 'nope'"),
                                        ("nowhere_mod:f", "no module")])
def test_bad_tools_are_one_line_errors(tools_dir, spec, match):
    with pytest.raises(EnvError, match=match) as err:
        load_tools([spec])
    assert "\n" not in str(err.value) and str(err.value).startswith("env.tools[0]")


def test_duplicate_tool_names_refused(tools_dir):
    with pytest.raises(EnvError, match="two tools are named 'add'"):
        load_tools(["my_tools_t:add", "my_tools_t.py:add"])


# --------------------------------------------------------------------------------------
# Parsers
# --------------------------------------------------------------------------------------
def test_hermes_good_and_several_calls():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 4}"}\n</tool_call> done')
    calls = parse_hermes(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "2+3"}, None),
                                                               ("add", {"a": 4}, None)]
    assert parse_hermes("no calls here, just an answer: 5") == []


def test_hermes_partial_malformed_and_shapeless():
    (partial,) = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}')
    assert partial.error.startswith("unterminated <tool_call>")
    (bad,) = parse_hermes('<tool_call>{"name": "calculator", "arguments": {expression: 2+3}}</tool_call>')
    assert "not valid JSON" in bad.error
    (noname,) = parse_hermes('<tool_call>{"arguments": {}}</tool_call>')
    assert '"name" string' in noname.error
    (badargs,) = parse_hermes('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    assert badargs.name == "add" and "object of named arguments" in badargs.error


def test_plain_good_several_and_malformed():
    text = ('I will use the tool.\nCALL calculator(expression="2+3")\n  CALL add(a=1, b=-2)\n'
            'CALL add(a=[1, true, null], b={"k": "v, w"})\nThe word CALL inside a sentence is left alone.')
    calls = parse_plain(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+3"}, None), ("add", {"a": 1, "b": -2}, None),
        ("add", {"a": [1, True, None], "b": {"k": "v, w"}}, None)]
    (unclosed,) = parse_plain('CALL calculator(expression="2+3"')
    assert "on one line" in unclosed.error
    (positional,) = parse_plain('CALL calculator("2+3")')
    assert "named" in positional.error
    (code,) = parse_plain('CALL calculator(expression=__import__("os").getcwd())')  # never evaluated
    assert "literal" in code.error


# --------------------------------------------------------------------------------------
# Answers: results and errors as tool messages
# --------------------------------------------------------------------------------------
def test_answers_results_and_errors_in_order(tools):
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"b": 2}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "import os"}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>{"name": "add"')
    turn = answer_calls(text, tools, "hermes", timeout_s=2)
    contents = [m["content"] for m in turn.messages]
    assert all(m["role"] == "tool" for m in turn.messages)
    assert contents[0] == "42" and contents[5] == "5"   # 6*7; add returns an int, sent as JSON text
    assert contents[1] == "error: unknown tool 'search'; the tools are: calculator, add, slow"
    assert contents[2].startswith("error: bad arguments for add: missing a required argument: 'a'")
    assert contents[3] == "error: calculator raised ZeroDivisionError: division by zero"
    assert contents[4] == "error: calculator raised ValueError: only numbers and + - * / ( )"
    assert contents[6].startswith("error: unterminated <tool_call>")
    assert (turn.calls, turn.errors) == (7, 5)
    assert answer_calls("The answer is 42.", tools, "hermes") is None


def test_a_hanging_tool_becomes_an_error_message(tools):
    start = time.monotonic()
    turn = answer_calls("CALL slow(x=1)", tools, "plain", timeout_s=0.2)
    assert time.monotonic() - start < 2
    assert turn.messages[0]["content"] == "error: slow took longer than 0.2 s" and turn.errors == 1


def test_system_prompt_names_the_tools_and_the_form(tools):
    text = tools_system_prompt(tools[:2], "plain")
    assert "- calculator(expression: string): Evaluate an arithmetic expression." in text
    assert "- add(a: integer, b: integer): Add two integers." in text
    assert 'CALL NAME(arg="value")' in text
    assert "<tool_call>" in tools_system_prompt(tools[:1], "hermes")
