"""Environments: what answers the model between its turns in a multi-turn episode.

An environment is a class of your own, named in the config the way a reward plug-in is
(``module:Class`` or ``path/to/file.py:Class``, found in the current directory, then
beside the config file, then in the installed packages; no PYTHONPATH):

    env:
      name: my_env:GuessTheNumber
      max_turns: 4
      step_timeout_s: 10

The protocol (duck-typed; nothing to inherit):

    class GuessTheNumber:
        def __init__(self, **kwargs): ...            # env.kwargs from the config, if any
        def reset(self, example: dict) -> list[dict]:
            # the opening messages of one episode, e.g.
            return [{"role": "user", "content": f"Guess my number (1-100). {example['prompt']}"}]
        def step(self, messages: list[dict], assistant_text: str) -> StepResult:
            # messages: the conversation so far, the model's newest turn included last;
            # assistant_text: that turn's text (its end-of-turn token left out).
            ...
            return StepResult(messages=[{"role": "user", "content": "higher"}], reward=0.0, done=False)

One object is made per episode, so `self` may hold the episode's state. `reset` gets the
dataset row (every field, plus ``prompt``: the row's prompt text, without a chat template).
`step` returns a `StepResult` (or a plain 3-tuple in that order):

- ``messages``: what the environment says next (a list of ``{"role": "user" | "tool" |
  "system", "content": str}``), or None when it has nothing to add;
- ``reward``: a number for this turn (0 for "no reward yet"); an episode's rewards may
  come at every turn or only at the end;
- ``done``: True ends the episode (messages given with done=True are not shown to the
  model).

The episode also ends at ``max_turns`` assistant turns (counted as ``hit_max_turns``),
when a turn runs out of tokens without its end-of-turn token, or when the conversation
would exceed the token budget. ``done=False`` with no messages is an error: the model
would have nothing new to answer.

Every call runs under ``step_timeout_s``. An exception, a wrong return type, a message
that is not a role/content dict, a non-finite reward or a call past its timeout stops
the run with one line naming the environment and the fix (`EnvError`, a `UserError`).
"""

from __future__ import annotations

import math
import numbers
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple, Optional, Protocol

from rlhflab.config.schema import f
from rlhflab.errors import UserError

CONTEXT_ROLES = ("user", "tool", "system")


class StepResult(NamedTuple):
    """What `step` returns: the environment's next messages (or None), this turn's reward,
    and whether the episode is over."""

    messages: Optional[list[dict]]
    reward: float
    done: bool


class Environment(Protocol):
    def reset(self, example: dict) -> list[dict]: ...

    def step(self, messages: list[dict], assistant_text: str) -> StepResult: ...


class EnvError(UserError):
    """An environment or a tool misbehaved in a way the run cannot go on from."""


@dataclass
class EnvConfig:
    """The `env:` section of a multi-turn run (typed and documented as config/schema.py's
    sections are; phase 2 of issue 25 puts it into the RL run configs)."""

    name: Optional[str] = f(None, "the environment: module:Class or path/to/file.py:Class (docs/environments.md); "
                                  "null: tool use only (the row's prompt, tools answered, the first turn without "
                                  "a call ends the episode)")
    max_turns: int = f(4, "assistant turns per episode at most (an episode stopped here counts as hit_max_turns)",
                       ge=1)
    step_timeout_s: Optional[float] = f(30.0, "seconds one reset/step/tool call may take; null: no limit", gt=0)
    tools: list[str] = f(factory=list, help="tools the model may call: module:function or file.py:function each")
    tool_format: Literal["auto", "hermes", "plain"] = f(
        "auto", "how the model calls tools: hermes (<tool_call>{json}</tool_call>), plain (a line "
                "CALL name(arg=\"value\")), auto (hermes when the chat template renders tools, else plain)")
    max_length: Optional[int] = f(None, "tokens per episode (prompt, actions and context) at most; null: no limit",
                                  ge=2)
    kwargs: dict = f(factory=dict, help="keyword arguments for the environment's constructor")
    plugin_dir: Optional[str] = f(None, "where plug-ins are looked for after the current directory; null: the "
                                        "config file's folder (filled in when the config is loaded)")

    def check(self) -> list[str]:
        errs = []
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            errs.append(f"max_turns: must be an integer >= 1, got {self.max_turns!r}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            errs.append(f"step_timeout_s: must be > 0 or null, got {self.step_timeout_s!r}")
        if self.tool_format not in ("auto", "hermes", "plain"):
            errs.append(f"tool_format: choose auto, hermes or plain, got {self.tool_format!r}")
        if self.max_length is not None and self.max_length < 2:
            errs.append(f"max_length: must be >= 2 or null, got {self.max_length!r}")
        return errs


# --------------------------------------------------------------------------------------
# Calls under a timeout, with one-line errors
# --------------------------------------------------------------------------------------
class Timeout(Exception):
    """A call ran past its time limit (it is left running in a daemon thread)."""


def call_with_timeout(fn: Callable, args: tuple, timeout_s: float | None):
    """fn(*args), raising `Timeout` after `timeout_s` seconds (None: wait forever).

    A Python thread cannot be killed: the call is left to finish in a daemon thread, which
    does not keep the process alive."""
    if not timeout_s:
        return fn(*args)
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001  (handed to the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="rlhflab-env-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Timeout(f"took longer than {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def where_raised(exc: BaseException, fn: Callable | None = None) -> str:
    """' at file.py:line' of the plug-in's own frame (else the last frame), or ''."""
    frames = traceback.extract_tb(exc.__traceback__)
    home = getattr(getattr(fn, "__code__", None), "co_filename", None)
    own = [f for f in frames if f.filename == home] if home else []
    own = own or [f for f in frames if "rlhflab" not in Path(f.filename).parts] or frames
    return f" at {Path(own[-1].filename).name}:{own[-1].lineno}" if own else ""


def describe_exception(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}{': ' + first if first else ''}"


# --------------------------------------------------------------------------------------
# Loading and checking
# --------------------------------------------------------------------------------------
def load_environment_factory(spec: str, plugin_dir=None) -> Callable[..., Any]:
    """The class (or factory function) named by `spec`, found as reward plug-ins are."""
    from rlhflab.rewards.plugins import load_object

    try:
        obj = load_object(spec, plugin_dir)
    except UserError as exc:
        raise EnvError(f"env.name: {exc}") from None
    if not callable(obj):
        raise EnvError(f"env.name: {spec!r} is a {type(obj).__name__}; name a class with reset(example) and "
                       "step(messages, assistant_text)")
    for method in ("reset", "step"):
        if isinstance(obj, type) and not callable(getattr(obj, method, None)):
            raise EnvError(f"env.name: {spec!r} has no {method}() method; an environment defines reset(example) "
                           "-> messages and step(messages, assistant_text) -> StepResult (docs/environments.md)")
    return obj


def make_environment(factory: Callable[..., Any], spec: str, kwargs: dict | None = None):
    """One environment object (one per episode)."""
    try:
        env = factory(**(kwargs or {}))
    except Exception as exc:
        raise EnvError(f"environment {spec!r}: creating it raised {describe_exception(exc)}{where_raised(exc)}; "
                       "fix its __init__ (or env.kwargs)") from None
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise EnvError(f"environment {spec!r}: the object has no {method}() method; an environment defines "
                           "reset(example) and step(messages, assistant_text)")
    return env


def check_messages(messages: Any, spec: str, what: str, allow_none: bool) -> list[dict] | None:
    """`messages` as a list of role/content dicts with context roles, or a one-line error."""
    if messages is None and allow_none:
        return None
    if not isinstance(messages, (list, tuple)):
        raise EnvError(f"environment {spec!r}: {what} returned messages of type {type(messages).__name__}; "
                       "return a list of {'role': ..., 'content': ...} dicts" + (" or None" if allow_none else ""))
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise EnvError(f"environment {spec!r}: {what} message {i} is {m!r:.60}; each message is a dict "
                           "with 'role' and a string 'content'")
        if m["role"] not in CONTEXT_ROLES:
            raise EnvError(f"environment {spec!r}: {what} message {i} has role {m['role']!r}; an environment "
                           f"speaks as {', '.join(CONTEXT_ROLES)} (the assistant's turns are the model's own)")
        out.append(dict(m))
    return out


def check_step_result(out: Any, spec: str) -> StepResult:
    """A StepResult from what `step` returned (a StepResult or a 3-tuple), checked."""
    if not isinstance(out, tuple) or len(out) != 3:
        raise EnvError(f"environment {spec!r}: step() returned {type(out).__name__} {out!r:.60}; return "
                       "StepResult(messages or None, reward, done) (or that 3-tuple)")
    messages, reward, done = out
    messages = check_messages(messages, spec, "step()", allow_none=True)
    value = reward.item() if getattr(reward, "ndim", None) == 0 and hasattr(reward, "item") else reward
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise EnvError(f"environment {spec!r}: step() returned reward {reward!r:.40}; return a finite number "
                       "(0.0 for no reward this turn)")
    if getattr(done, "ndim", None) == 0 and hasattr(done, "item"):
        done = done.item()
    if not isinstance(done, (bool, int)):
        raise EnvError(f"environment {spec!r}: step() returned done={done!r:.40}; return True or False")
    done = bool(done)
    if not done and not messages:
        raise EnvError(f"environment {spec!r}: step() returned done=False with no messages, so the model has "
                       "nothing new to answer and the episode would never end; return messages, or done=True")
    return StepResult(messages, float(value), done)


def env_reset(env, spec: str, example: dict, timeout_s: float | None) -> list[dict]:
    try:
        out = call_with_timeout(env.reset, (example,), timeout_s)
    except Timeout:
        raise EnvError(f"environment {spec!r}: reset() took longer than env.step_timeout_s={timeout_s:g} s; make "
                       "it faster or raise env.step_timeout_s") from None
    except Exception as exc:
        raise EnvError(f"environment {spec!r}: reset() raised {describe_exception(exc)}"
                       f"{where_raised(exc, type(env).reset if hasattr(type(env), 'reset') else None)}; "
                       "fix reset (or the data row it reads)") from None
    messages = check_messages(out, spec, "reset()", allow_none=False)
    if not messages:
        raise EnvError(f"environment {spec!r}: reset() returned no messages; return at least the first user "
                       "message")
    return messages


def env_step(env, spec: str, messages: list[dict], assistant_text: str, timeout_s: float | None) -> StepResult:
    try:
        out = call_with_timeout(env.step, ([dict(m) for m in messages], assistant_text), timeout_s)
    except Timeout:
        raise EnvError(f"environment {spec!r}: step() took longer than env.step_timeout_s={timeout_s:g} s; make "
                       "it faster or raise env.step_timeout_s") from None
    except Exception as exc:
        raise EnvError(f"environment {spec!r}: step() raised {describe_exception(exc)}"
                       f"{where_raised(exc, type(env).step if hasattr(type(env), 'step') else None)} on the reply "
                       f"{assistant_text!r:.40}; fix step (it must accept any text the model writes)") from None
    return check_step_result(out, spec)


class ToolUseEnv:
    """The environment when only tools are named: the row's prompt as the user's message;
    a turn without a tool call ends the episode with reward 0 (the run's reward sources
    score that final answer)."""

    def reset(self, example: dict) -> list[dict]:
        return [{"role": "user", "content": str(example.get("prompt", ""))}]

    def step(self, messages: list[dict], assistant_text: str) -> StepResult:
        return StepResult(None, 0.0, True)
