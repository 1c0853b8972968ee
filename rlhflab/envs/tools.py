"""Tools: plain Python functions the model may call between its turns.

Named in the config as plug-ins are (``env.tools: [my_tools:calculator]``, module or
file, found in the current directory, then beside the config). A tool is an ordinary
function with type hints and a Google-style docstring:

    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. "12 * (3 + 4)"
        \"\"\"

Its JSON schema is built from the signature and docstring by transformers'
`get_json_schema` (the same function `apply_chat_template(tools=[fn])` uses), in the
``{"type": "function", "function": {"name", "description", "parameters"}}`` shape chat
templates take; a missing type hint or argument description is a one-line error at load.

Two call forms (``env.tool_format``):

- ``hermes`` (Hermes, Qwen2.5, Qwen3 templates): a JSON object in tags, one per call,
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>``.
- ``plain``, for models whose template has no tool support: one call per line, the line
  starting with ``CALL``, keyword arguments only, each value a literal (a string in
  quotes, a number, true/false/null or True/False/None, a list, a dict):
  ``CALL calculator(expression="2+3")``. Text on other lines is left alone.
- ``auto``: hermes when the tokenizer's chat template renders the tools, else plain.

When the template does not render the tools, a system message describing them and the
call form is put first in every episode (`tools_system_prompt`).

Every call's result comes back as a ``tool`` message (``{"role": "tool", "name": ...,
"content": ...}``), in the order of the calls. A malformed call, an unknown tool, bad
arguments, a tool that raises or runs past ``env.step_timeout_s``: each becomes a tool
message starting with ``error:`` that the model reads on its next turn, and is counted
(`ToolTurn.errors`); none of them stops the run.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

from rlhflab.envs.base import EnvError, Timeout, call_with_timeout, describe_exception

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PLAIN = re.compile(r"^[ \t]*CALL\b(.*)$", re.MULTILINE)
_PLAIN_CALL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*$", re.DOTALL)
_JSON_NAMES = {"true": True, "false": False, "null": None}


class ToolCall(NamedTuple):
    """One call found in the model's text: the tool's name and its arguments, or the
    reason it could not be read (`error`, then name/arguments may be empty)."""

    name: str
    arguments: dict
    error: str | None = None
    text: str = ""          # the call as written


@dataclass
class Tool:
    name: str
    fn: Callable
    schema: dict            # {"type": "function", "function": {...}}
    spec: str


def tool_schema(fn: Callable, spec: str, key: str = "env.tools") -> dict:
    """The chat-template schema of `fn`, via transformers' get_json_schema."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException
        raise EnvError(f"{key}: {spec!r}: cannot build its schema ({describe_exception(exc)}); give every "
                       "argument a type hint and describe it under 'Args:' in a Google-style docstring") from None


def load_tools(specs: Sequence[str], plugin_dir=None) -> list[Tool]:
    """Each ``module:function`` / ``file.py:function`` as a Tool; names must be unique."""
    from rlhflab.errors import UserError
    from rlhflab.rewards.plugins import load_object

    tools: list[Tool] = []
    for i, spec in enumerate(specs):
        try:
            fn = load_object(spec, plugin_dir)
        except UserError as exc:
            raise EnvError(f"env.tools[{i}]: {exc}") from None
        if not callable(fn) or isinstance(fn, type):
            raise EnvError(f"env.tools[{i}]: {spec!r} is a {type(fn).__name__}; a tool is a function")
        schema = tool_schema(fn, spec, f"env.tools[{i}]")
        name = schema["function"]["name"]
        if any(t.name == name for t in tools):
            raise EnvError(f"env.tools[{i}]: two tools are named {name!r}; give them different function names")
        tools.append(Tool(name, fn, schema, spec))
    return tools


# --------------------------------------------------------------------------------------
# Parsing calls
# --------------------------------------------------------------------------------------
def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` of `text`, in order (an unterminated last
    tag included, as an error)."""
    calls = []
    for m in _HERMES.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        raw = m.group(0)
        if not closed:
            calls.append(ToolCall("", {}, "unterminated <tool_call>: close each call with </tool_call>", raw))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"the call is not valid JSON ({exc.msg} at character {exc.pos}); write "
                                          '{"name": ..., "arguments": {...}}', raw))
            continue
        calls.append(_from_object(obj, raw))
    return calls


def _from_object(obj: Any, raw: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'a call is a JSON object with a "name" string and an "arguments" object', raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, f'"arguments" must be an object of named arguments, got '
                                         f"{type(args).__name__}", raw)
    return ToolCall(obj["name"], args, None, raw)


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def parse_plain(text: str) -> list[ToolCall]:
    """Every ``CALL name(key=value, ...)`` line of `text`, in order."""
    calls = []
    for m in _PLAIN.finditer(text):
        raw = m.group(0).strip()
        call = _PLAIN_CALL.match(m.group(1))
        if call is None:
            calls.append(ToolCall("", {}, 'write a call on one line as CALL name(key="value", n=3)', raw))
            continue
        name, body = call.group(1), call.group(2)
        try:
            tree = ast.parse(f"f({body})", mode="eval").body
            if not isinstance(tree, ast.Call) or tree.args:
                raise ValueError("arguments must be named: key=value")
            args = {}
            for kw in tree.keywords:
                if kw.arg is None:
                    raise ValueError("arguments must be named: key=value")
                args[kw.arg] = _literal(kw.value)
        except (SyntaxError, ValueError, TypeError) as exc:
            why = str(exc) if isinstance(exc, ValueError) and "named" in str(exc) else \
                "each value must be a literal: a quoted string, a number, true/false/null, a list or a dict"
            calls.append(ToolCall(name, {}, f"cannot read the arguments of {name}: {why}", raw))
            continue
        calls.append(ToolCall(name, args, None, raw))
    return calls


def parse_calls(text: str, tool_format: str) -> list[ToolCall]:
    if tool_format == "hermes":
        return parse_hermes(text)
    if tool_format == "plain":
        return parse_plain(text)
    raise ValueError(f"tool_format must be hermes or plain here, got {tool_format!r}")


# --------------------------------------------------------------------------------------
# Running calls
# --------------------------------------------------------------------------------------
class ToolTurn(NamedTuple):
    """The tools' answer to one assistant turn."""

    messages: list[dict]   # one tool message per call, in order
    calls: int
    errors: int


def _result_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def run_call(call: ToolCall, tools: Sequence[Tool], timeout_s: float | None) -> tuple[dict, bool]:
    """(the tool message, whether it is an error) for one call; never raises for the
    model's mistakes or the tool's own failures."""
    def error(name: str, why: str) -> tuple[dict, bool]:
        return {"role": "tool", "name": name or "error", "content": f"error: {why}"}, True

    if call.error:
        return error(call.name, call.error)
    by_name = {t.name: t for t in tools}
    tool = by_name.get(call.name)
    if tool is None:
        return error(call.name, f"unknown tool {call.name!r}; the tools are: {', '.join(by_name) or 'none'}")
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as exc:
        return error(call.name, f"bad arguments for {call.name}: {exc}")
    except ValueError:  # no signature to check (a builtin): let the call tell
        pass
    try:
        value = call_with_timeout(lambda: tool.fn(**call.arguments), (), timeout_s)
    except Timeout as exc:
        return error(call.name, f"{call.name} {exc}")
    except Exception as exc:  # the tool's own failure is the model's information, not a crash
        return error(call.name, f"{call.name} raised {describe_exception(exc)}")
    return {"role": "tool", "name": call.name, "content": _result_text(value)}, False


def answer_calls(text: str, tools: Sequence[Tool], tool_format: str,
                 timeout_s: float | None = None) -> ToolTurn | None:
    """The tool messages answering the calls in `text`, or None when it makes no call."""
    calls = parse_calls(text, tool_format)
    if not calls:
        return None
    messages, errors = [], 0
    for call in calls:
        msg, bad = run_call(call, tools, timeout_s)
        messages.append(msg)
        errors += bad
    return ToolTurn(messages, len(calls), errors)


# --------------------------------------------------------------------------------------
# Telling the model about the tools when its template does not
# --------------------------------------------------------------------------------------
def template_renders_tools(tokenizer, tools: Sequence[Tool]) -> bool:
    """True when the chat template puts the tools' schemas into its rendering."""
    if not tools:
        return False
    msgs = [{"role": "user", "content": "hi"}]
    try:
        with_tools = tokenizer.apply_chat_template(msgs, tools=[t.schema for t in tools], tokenize=False)
        without = tokenizer.apply_chat_template(msgs, tokenize=False)
    except Exception:
        return False
    return with_tools != without


def resolve_tool_format(tool_format: str, tokenizer, tools: Sequence[Tool]) -> str:
    if tool_format != "auto":
        return tool_format
    return "hermes" if template_renders_tools(tokenizer, tools) else "plain"


def tools_system_prompt(tools: Sequence[Tool], tool_format: str) -> str:
    """A system message describing the tools and how to call them, for templates that
    do not render tools themselves."""
    lines = ["You can call these tools:"]
    for t in tools:
        fn = t.schema["function"]
        params = fn.get("parameters", {}).get("properties", {})
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in params.items())
        lines.append(f"- {fn['name']}({args}): {fn.get('description') or ''}".rstrip(": "))
    if tool_format == "hermes":
        lines.append('To call one, write <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>.')
    else:
        lines.append('To call one, write a line CALL NAME(arg="value") and stop; the result comes back.')
    lines.append("When you have the answer, reply without a call.")
    return "\n".join(lines)
