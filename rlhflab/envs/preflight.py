"""Preflight of an environment and its tools: one episode with a canned reply, before any
model loads.

The environment is created, reset on the first training row and stepped with a canned
assistant reply (the row's ``answer`` when it has one, else the empty string) until it
says done or `max_turns` is reached; every return value is checked as in training
(`rlhflab.envs.base`), each call under `step_timeout_s`. The tools are loaded and their
schemas built. Given the tokenizer (cheap to load, and no model), the episode is also
rendered turn by turn with its chat template, which catches a template that cannot
render the environment's roles or re-renders earlier turns.

An episode that the canned reply does not finish within `max_turns` is not an error (a
wrong answer may rightly go on); the line printed says so.
"""

from __future__ import annotations

from typing import NamedTuple

from rlhflab.envs.base import EnvConfig, EnvError, ToolUseEnv, env_reset, env_step, load_environment_factory, \
    make_environment
from rlhflab.envs.tools import load_tools


class EnvPreflight(NamedTuple):
    spec: str
    reply: str               # the canned reply used at every turn
    turns: int
    rewards: list[float]
    done: bool               # the environment ended the episode
    messages: list[dict]
    tools: list[str]         # the tools' names

    def line(self) -> str:
        end = "done" if self.done else f"not done at max_turns={self.turns} (fine if the canned reply is wrong)"
        tools = f"; tools {', '.join(self.tools)}" if self.tools else ""
        return (f"preflight: env {self.spec} with reply {self.reply!r:.40}: {self.turns} turn(s), rewards "
                f"{[round(r, 4) for r in self.rewards]}, {end}{tools}")


def preflight_env(cfg: EnvConfig, example: dict, tokenizer=None, quiet: bool = False) -> EnvPreflight:
    """Run one canned episode of `cfg`'s environment on `example`; one-line `EnvError` at the
    first problem (see the module docstring)."""
    errs = cfg.check()
    if errs:
        raise EnvError(f"env.{errs[0]}")
    factory = load_environment_factory(cfg.name, cfg.plugin_dir) if cfg.name else None
    spec = cfg.name or "tool use (no env.name)"
    tools = load_tools(cfg.tools, cfg.plugin_dir)
    env = make_environment(factory, spec, cfg.kwargs) if factory else ToolUseEnv()
    reply = str(example.get("answer", ""))
    messages = env_reset(env, spec, dict(example), cfg.step_timeout_s)
    renderer = None
    if tokenizer is not None:
        from rlhflab.envs.render import ChatRenderer
        from rlhflab.envs.tools import template_renders_tools

        rendered = template_renders_tools(tokenizer, tools)
        renderer = ChatRenderer(tokenizer, [t.schema for t in tools] if rendered else None)
        renderer.prompt(messages)
    rewards, done = [], False
    for _ in range(cfg.max_turns):
        messages.append({"role": "assistant", "content": reply})
        result = env_step(env, spec, messages, reply, cfg.step_timeout_s)
        rewards.append(result.reward)
        if result.done:
            done = True
            break
        if renderer is not None:
            renderer.delta(messages, result.messages)
        messages.extend(result.messages)
    out = EnvPreflight(spec, reply, len(rewards), rewards, done, messages, [t.name for t in tools])
    if not quiet:
        print(out.line())
    return out
