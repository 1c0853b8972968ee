"""Running a batch of multi-turn episodes, and batching them into tensors.

`run_episodes` is backend-agnostic: it takes a ``generate`` callable,

    generate(prompts: list[list[int]]) -> list[list[int] | Generated]

(one token-id prompt per active episode in, the ids the model sampled for each out,
optionally with their sampler log-probs), so the hf and vLLM backends plug in alike.
Turn by turn, every active episode's whole sequence so far is the next prompt; the
generated ids are cut after the first stop id and appended unchanged (actions); the
environment's or the tools' answer is appended as the chat template's delta (context,
`rlhflab.envs.render`). Every token's role is decided here, once:

    action_mask  1  on each id the model generated, its end-of-turn token included
                 0  on the prompt, the environment's and tools' messages, the template's
                    glue between turns (ChatML's "\\n<|im_start|>user\\n"), and padding

A turn whose text holds a tool call is answered by the tools (reward 0 for that turn);
any other turn goes to the environment's `step`. The episode ends when the environment
says done, at `max_turns`, when a turn runs out of tokens before its end-of-turn token
(`hit_limit`), or when the next turn's prompt would pass `max_length` tokens.

`collate_episodes` makes the tensors the engine takes (B episodes, P prompt columns, T
response columns, N turns):

    prompt_ids               (B, P)  the opening, left-padded (it ends at column P-1)
    prompt_mask              (B, P)  1 on real prompt tokens
    response_ids             (B, T)  everything after the opening: actions and context, right-padded
    response_mask            (B, T)  the action mask: 1 on trained tokens (loss, KL, entropy, GAE)
    response_attention_mask  (B, T)  1 on every real token, action or context; 0 on padding
    turn_rewards, turn_ends, turn_mask   (B, N)  each turn's reward, the index of its last
                                     action token in the response part, 1 for a real turn
    num_turns, hit_max_turns, hit_limit, tool_calls, tool_errors   (B,)

The forward pass must attend with ``response_attention_mask`` (context tokens are
attended to), and every loss, KL and entropy read ``response_mask``. The last real token
of every row is an action, so trimming columns by either mask keeps the same columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from rlhflab.envs.base import EnvConfig, ToolUseEnv, env_reset, env_step, load_environment_factory, make_environment
from rlhflab.envs.render import ChatRenderer
from rlhflab.envs.tools import Tool, answer_calls, load_tools, resolve_tool_format, template_renders_tools, \
    tools_system_prompt


from rlhflab.rollout import Generated  # noqa: E402,F401 (what a backend returns per prompt)


@dataclass
class Episode:
    """One finished episode as one token sequence."""

    prompt_ids: list[int]                     # the opening, rendered with the generation prompt
    ids: list[int] = field(default_factory=list)          # after the opening: actions and context in order
    action_mask: list[int] = field(default_factory=list)  # aligned with ids: 1 generated, 0 context
    turn_ends: list[int] = field(default_factory=list)    # index in ids of each turn's last action token
    turn_rewards: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)    # the conversation as text
    sample_logprobs: list[float] | None = field(default_factory=list)  # aligned with ids (0 on context)
    done: bool = False                        # the environment ended it
    hit_max_turns: bool = False
    hit_limit: bool = False                   # the last turn has no end-of-turn token (token limit)
    hit_max_length: bool = False              # stopped before a turn that would pass max_length
    tool_calls: int = 0
    tool_errors: int = 0
    example: dict = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return len(self.turn_ends)

    @property
    def total_reward(self) -> float:
        return float(sum(self.turn_rewards))


class EpisodeSetup(NamedTuple):
    """Everything loaded once per run for `run_episodes`."""

    factory: Callable | None   # the environment class; None: ToolUseEnv
    spec: str
    tools: list[Tool]
    tool_format: str           # hermes or plain (auto resolved)
    renderer: ChatRenderer
    system_prompt: str | None  # tools described for a template that does not render them


def setup_episodes(cfg: EnvConfig, tokenizer) -> EpisodeSetup:
    """Load the environment and tools named in `cfg` and bind them to `tokenizer`'s template."""
    factory = load_environment_factory(cfg.name, cfg.plugin_dir) if cfg.name else None
    spec = cfg.name or "tool use (no env.name)"
    tools = load_tools(cfg.tools, cfg.plugin_dir)
    tool_format = resolve_tool_format(cfg.tool_format, tokenizer, tools)
    rendered = template_renders_tools(tokenizer, tools)
    renderer = ChatRenderer(tokenizer, [t.schema for t in tools] if rendered else None)
    system = tools_system_prompt(tools, tool_format) if tools and not rendered else None
    return EpisodeSetup(factory, spec, tools, tool_format, renderer, system)


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if not system:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + system}] + messages[1:]
    return [{"role": "system", "content": system}] + messages


def _cut_at_stop(ids: Sequence[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """ids up to and including the first stop id; whether there was one."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return list(ids[:i + 1]), True
    return list(ids), False


def run_episodes(setup: EpisodeSetup, examples: Sequence[dict], generate: Callable, *, max_turns: int,
                 stop_ids: Sequence[int] = (), step_timeout_s: float | None = None, max_length: int | None = None,
                 env_kwargs: dict | None = None, with_rows: bool = False,
                 keep: list | None = None) -> list[Episode]:
    """One episode per example, all advanced turn by turn together (see the module docstring).

    `stop_ids` end a turn besides the template's end-of-turn token (the tokenizer's EOS).
    `with_rows`: call ``generate(prompts, rows)``, `rows` the index of each prompt's episode
    in `examples` (seeded sampling keys its noise by it). `keep`: a list that receives the
    episodes as they are opened, before the first turn (a scripted demonstration reads the
    conversation so far from them).
    """
    renderer, tok = setup.renderer, setup.renderer.tokenizer
    stop = {int(s) for s in stop_ids} | {renderer.end_of_turn_id}
    envs, episodes = [], []
    for ex in examples:
        env = make_environment(setup.factory, setup.spec, env_kwargs) if setup.factory else ToolUseEnv()
        messages = _with_system(env_reset(env, setup.spec, dict(ex), step_timeout_s), setup.system_prompt)
        _, prompt_ids = renderer.prompt(messages)
        envs.append(env)
        episodes.append(Episode(prompt_ids=prompt_ids, messages=messages, example=dict(ex)))
    if keep is not None:
        keep.extend(episodes)
    active = []
    for i, ep in enumerate(episodes):
        if max_length is not None and len(ep.prompt_ids) >= max_length:
            ep.hit_max_length = True  # not even one token of room: no turn at all
        else:
            active.append(i)
    while active:
        prompts = [episodes[i].prompt_ids + episodes[i].ids for i in active]
        outs = generate(prompts, list(active)) if with_rows else generate(prompts)
        if len(outs) != len(active):
            raise ValueError(f"generate returned {len(outs)} outputs for {len(active)} prompts")
        still = []
        for i, out in zip(active, outs):
            if _turn(episodes[i], envs[i], out, setup, tok, stop, max_turns, step_timeout_s, max_length):
                still.append(i)
        active = still
    return episodes


def _append(ep: Episode, ids: list[int], role: int, logprobs: list[float] | None) -> None:
    ep.ids.extend(ids)
    ep.action_mask.extend([role] * len(ids))
    if ep.sample_logprobs is not None:
        if role == 1 and logprobs is None:
            ep.sample_logprobs = None  # the backend gave none: the episode has none
        else:
            ep.sample_logprobs.extend(list(logprobs) if role == 1 else [0.0] * len(ids))


def _turn(ep: Episode, env, out, setup: EpisodeSetup, tok, stop: set[int], max_turns: int,
          step_timeout_s: float | None, max_length: int | None) -> bool:
    """One turn of one episode: the model's ids, then the answer. True: the episode goes on."""
    gen = out if isinstance(out, Generated) else Generated(out)
    gen = Generated([int(t) for t in gen.ids], None if gen.logprobs is None else [float(x) for x in gen.logprobs])
    ids, closed = _cut_at_stop(gen.ids, stop)
    if max_length is not None:
        room = max_length - len(ep.prompt_ids) - len(ep.ids)
        if len(ids) > room:
            ids, closed = ids[:room], False
    if not ids:  # nothing generated: nothing to train on in this turn
        ep.hit_limit = True
        return False
    _append(ep, ids, 1, None if gen.logprobs is None else gen.logprobs[:len(ids)])
    ep.turn_ends.append(len(ep.ids) - 1)
    text = tok.decode([t for t in ids if t not in stop], skip_special_tokens=True)
    ep.messages.append({"role": "assistant", "content": text})

    tool_turn = answer_calls(text, setup.tools, setup.tool_format, step_timeout_s) if setup.tools else None
    if tool_turn is not None:
        ep.tool_calls += tool_turn.calls
        ep.tool_errors += tool_turn.errors
        reward, new, done = 0.0, tool_turn.messages, False
    else:
        new, reward, done = env_step(env, setup.spec, ep.messages, text, step_timeout_s)
    ep.turn_rewards.append(reward)
    ep.hit_limit = not closed  # out of tokens mid-turn: the template cannot go on from here
    ep.done = bool(done)
    if done or not closed:
        return False
    if ep.num_turns >= max_turns:
        ep.hit_max_turns = True
        return False
    delta_text, delta_ids = setup.renderer.delta(ep.messages, new)
    if max_length is not None and len(ep.prompt_ids) + len(ep.ids) + len(delta_ids) >= max_length:
        ep.hit_max_length = True  # no room for the answer and a token of the next turn
        return False
    ep.messages.extend(new)
    _append(ep, delta_ids, 0, None)
    return True


# --------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------
@dataclass
class EpisodeBatch:
    """A batch of episodes as tensors (shapes in the module docstring)."""

    prompt_ids: Tensor                 # (B, P) left-padded
    prompt_mask: Tensor                # (B, P)
    response_ids: Tensor               # (B, T) right-padded: actions and context
    response_mask: Tensor              # (B, T) the action mask
    response_attention_mask: Tensor    # (B, T) 1 on every real token
    turn_rewards: Tensor               # (B, N) float32
    turn_ends: Tensor                  # (B, N) long, index of each turn's last action token
    turn_mask: Tensor                  # (B, N) 1 for a real turn
    num_turns: Tensor                  # (B,) long
    hit_max_turns: Tensor              # (B,) bool
    hit_limit: Tensor                  # (B,) bool: the last turn has no end-of-turn token
    tool_calls: Tensor                 # (B,) long
    tool_errors: Tensor                # (B,) long
    sample_logprobs: Tensor | None = None  # (B, T), 0 on context and padding; None if any episode lacks them
    episodes: list[Episode] = field(default_factory=list)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


def collate_episodes(episodes: Sequence[Episode], pad_token_id: int) -> EpisodeBatch:
    """Episodes as right-padded (response) and left-padded (prompt) tensors."""
    if not episodes:
        raise ValueError("collate_episodes needs at least one episode")
    b = len(episodes)
    p = max(len(e.prompt_ids) for e in episodes)
    t = max(1, max(len(e.ids) for e in episodes))
    n = max(1, max(e.num_turns for e in episodes))
    prompt_ids = torch.full((b, p), pad_token_id, dtype=torch.long)           # (B, P)
    prompt_mask = torch.zeros(b, p, dtype=torch.long)                         # (B, P)
    response_ids = torch.full((b, t), pad_token_id, dtype=torch.long)         # (B, T)
    response_mask = torch.zeros(b, t, dtype=torch.long)                       # (B, T)
    attention = torch.zeros(b, t, dtype=torch.long)                           # (B, T)
    turn_rewards = torch.zeros(b, n)                                          # (B, N)
    turn_ends = torch.zeros(b, n, dtype=torch.long)                           # (B, N)
    turn_mask = torch.zeros(b, n, dtype=torch.long)                           # (B, N)
    with_lp = all(e.sample_logprobs is not None for e in episodes)
    sample_lp = torch.zeros(b, t) if with_lp else None                        # (B, T)
    for row, e in enumerate(episodes):
        if e.prompt_ids:
            prompt_ids[row, p - len(e.prompt_ids):] = torch.tensor(e.prompt_ids)
            prompt_mask[row, p - len(e.prompt_ids):] = 1
        k = len(e.ids)
        if k:
            response_ids[row, :k] = torch.tensor(e.ids)
            response_mask[row, :k] = torch.tensor(e.action_mask)
            attention[row, :k] = 1
            if with_lp:
                sample_lp[row, :k] = torch.tensor(e.sample_logprobs, dtype=torch.float32)
        m = e.num_turns
        if m:
            turn_rewards[row, :m] = torch.tensor(e.turn_rewards, dtype=torch.float32)
            turn_ends[row, :m] = torch.tensor(e.turn_ends)
            turn_mask[row, :m] = 1
    return EpisodeBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        response_attention_mask=attention, turn_rewards=turn_rewards, turn_ends=turn_ends, turn_mask=turn_mask,
        num_turns=torch.tensor([e.num_turns for e in episodes]),
        hit_max_turns=torch.tensor([e.hit_max_turns for e in episodes]),
        hit_limit=torch.tensor([e.hit_limit for e in episodes]),
        tool_calls=torch.tensor([e.tool_calls for e in episodes]),
        tool_errors=torch.tensor([e.tool_errors for e in episodes]),
        sample_logprobs=sample_lp, episodes=list(episodes))
