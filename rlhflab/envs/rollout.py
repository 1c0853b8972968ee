"""Multi-turn rollouts for the trainers: episodes sampled through a generation backend and
laid out as the engine's `Rollout`.

`EpisodeBackend` wraps the run's backend (hf or vLLM) when the config has an `env:`
section; the trainers call its `generate` exactly as the single-turn one's, and get a
`Rollout` whose

    response_ids              the response part: the model's turns and the environment's answers
    response_mask             the action mask (loss, KL, entropy, advantages)
    response_attention_mask   every real token (what the forward attends to)
    responses                 the final assistant turn's text (what the reward sources score)
    episodes                  the `EpisodeBatch` (turn rewards and ends, turns, tool calls)

Each engine contributes one primitive, ``generate_ids(list of id lists, keys=...) ->
list[Generated]`` (`rlhflab.rollout.RolloutBackend`): the hf backend's `model.generate` on
the left-padded id lists, the vLLM backend's engine on the token ids themselves (its prefix
cache reuses every earlier turn's KV; it pushes pending weights first, by its own rule).
Nothing here reaches into an engine. A turn
stops at the template's end-of-turn token or the model's EOS, after at most
`generation.max_new_tokens` tokens.

Seeded sampling (`generation.seeded_sampling`) keys each turn's noise by (seed, step, the
episode's global row, the turn): turn 0 uses exactly the single-turn keys, so a one-turn
environment samples what the single-turn rollout samples.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlhflab.envs.episode import EpisodeBatch, EpisodeSetup, collate_episodes, run_episodes

TURN_STEP = 100_003  # turn t samples with the noise keys of step + t * TURN_STEP (turn 0: the step's own)


def episodes_to_rollout(batch: EpisodeBatch, tokenizer, group_size: int = 1, device=None):
    """The engine's `Rollout` of a batch of episodes (see the module docstring), its tensors
    on `device` (the policy's; `batch` itself stays where collate_episodes made it, the CPU)."""
    from rlhflab.rollout import Rollout

    def on(t):
        return t if t is None or device is None else t.to(device)

    prompts = [tokenizer.decode(e.prompt_ids, skip_special_tokens=False) for e in batch.episodes]
    finals = []
    for e in batch.episodes:
        said = [m["content"] for m in e.messages if m["role"] == "assistant"]
        finals.append(said[-1] if said else "")
    return Rollout(prompt_ids=on(batch.prompt_ids), prompt_mask=on(batch.prompt_mask),
                   response_ids=on(batch.response_ids), response_mask=on(batch.response_mask),
                   hit_limit=on(batch.hit_limit.clone()), prompts=prompts,
                   responses=finals, examples=[e.example for e in batch.episodes], group_size=group_size,
                   sample_logprobs=on(batch.sample_logprobs),
                   response_attention_mask=on(batch.response_attention_mask), episodes=batch)


class EpisodeBackend:
    """The run's backend, sampling multi-turn episodes (see the module docstring)."""

    def __init__(self, backend, setup: EpisodeSetup, env_cfg, tokenizer, *, prompt_field: str = "prompt",
                 stop_ids: Sequence[int] = ()):
        self.backend, self.setup, self.env_cfg, self.tokenizer = backend, setup, env_cfg, tokenizer
        self.prompt_field = prompt_field
        self.stop_ids = sorted({int(s) for s in stop_ids} | {setup.renderer.end_of_turn_id})
        self.last: EpisodeBatch | None = None

    def __getattr__(self, name):  # check_sync, engine, ... : the wrapped backend's
        backend = self.__dict__.get("backend")
        if backend is None:
            raise AttributeError(name)
        return getattr(backend, name)

    def sync(self, policy, updates: int = 1) -> None:
        self.backend.sync(policy, updates)

    def _ids(self, prompts, rows, *, greedy: bool, step: int, turn: int, row_offset: int, max_new_tokens: int):
        # the engine's one primitive on token-id prompts (its weight push included)
        b = self.backend
        keys = None if b.seed is None else _keys(b.seed, step, turn, row_offset, rows)
        return b.generate_ids(prompts, max_new_tokens=max_new_tokens, stop_ids=self.stop_ids, greedy=greedy,
                              keys=keys)

    def generate(self, prompts: Sequence[str], *, n: int = 1, examples: Sequence[dict] | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None, step: int = 0, rank: int | None = None,
                 **_ignored):
        """`n` episodes per example (rows [i·n, (i+1)·n) start from example i) as a Rollout.
        `prompts` (the single-turn prompt texts) are not used: the environment's `reset`
        opens each episode from the dataset row."""
        examples = list(examples) if examples is not None else [{} for _ in prompts]
        rows = []
        for ex in examples:
            row = dict(ex)
            row.setdefault("prompt", ex.get(self.prompt_field, ""))
            rows.extend(dict(row) for _ in range(n))
        rank = self.backend.rank if rank is None and hasattr(self.backend, "rank") else (rank or 0)
        offset = rank * len(rows)
        turn = [0]
        new = max_new_tokens or self.backend.gen.max_new_tokens

        def gen(id_lists, active):
            out = self._ids(id_lists, active, greedy=greedy, step=step, turn=turn[0], row_offset=offset,
                            max_new_tokens=new)
            turn[0] += 1
            return out

        cfg = self.env_cfg
        max_length = cfg.max_length or self.backend.context_limit  # vLLM: no episode longer than the engine holds
        episodes = run_episodes(self.setup, rows, gen, max_turns=cfg.max_turns, stop_ids=self.stop_ids,
                                step_timeout_s=cfg.step_timeout_s, max_length=max_length,
                                env_kwargs=cfg.kwargs, with_rows=True)
        batch = collate_episodes(episodes, self.tokenizer.pad_token_id)
        self.last = batch
        self.backend.idle()  # vLLM on a GPU: free the engine's memory for the update
        policy = getattr(self.backend, "policy", None)  # the update runs where the policy is (a GPU, say)
        device = next(policy.parameters()).device if policy is not None else None
        return episodes_to_rollout(batch, self.tokenizer, group_size=n, device=device)


def _keys(seed: int, step: int, turn: int, row_offset: int, rows: Sequence[int]) -> torch.Tensor:
    from rlhflab import ops

    return ops.row_keys(seed, step + turn * TURN_STEP, row_offset + torch.tensor(list(rows), dtype=torch.int64))


def early_turn_tokens(ep) -> float | None:
    """Mean action tokens per turn before an episode's last (None for a one-turn episode)."""
    if ep.num_turns < 2:
        return None
    last_start = ep.turn_ends[-2] + 1  # the last turn's actions follow the context after turn -2
    before = sum(ep.action_mask[:last_start])
    return before / (ep.num_turns - 1)


def episode_metrics(roll, dist=None) -> dict[str, float]:
    """`episode/*` metrics of a multi-turn rollout (docs/metrics.md), over every rank."""
    batch = getattr(roll, "episodes", None)
    if batch is None:
        return {}
    per_row = torch.stack([batch.num_turns.float(), batch.hit_max_turns.float(), batch.tool_calls.float(),
                           batch.tool_errors.float(), (batch.turn_rewards * batch.turn_mask).sum(-1).float(),
                           ((batch.response_attention_mask - batch.response_mask).sum(-1)).float()], 1)  # (B, 6)
    if dist is not None and dist.distributed:
        per_row = torch.cat(dist.gather(per_row))
    turns, hit_max, calls, errors, env_reward, context = per_row.unbind(1)
    early = torch.tensor([t for e in batch.episodes if (t := early_turn_tokens(e)) is not None], dtype=torch.float64)
    if dist is not None and dist.distributed:
        early = torch.cat(dist.gather(early))
    out = {} if early.numel() == 0 else {"episode/early_turn_tokens_mean": float(early.mean())}
    return out | {
        "episode/turns_mean": float(turns.mean()),
        "episode/hit_max_turns_frac": float(hit_max.mean()),
        "episode/tool_calls_mean": float(calls.mean()),
        "episode/tool_error_rate": float(errors.sum() / calls.sum()) if float(calls.sum()) > 0 else 0.0,
        "episode/env_reward_mean": float(env_reward.mean()),
        "episode/context_tokens_mean": float(context.mean()),
    }
