"""Supervised warm starts on multi-turn demonstrations, and greedy episodes for evaluation.

A demonstration is the assistant's turns of one episode as text; the environment (and
the tools) answer them as they would answer the model, through the same episode runner,
so the demonstration's token sequence, masks and context are exactly the ones RL will
train on. `sft_on_episodes` then fits the action tokens (response_mask 1) only: the
environment's tokens are attended to, never targets.

Used by the worked examples in examples/ (calculator, guess_the_number).
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from rlhflab.envs.episode import Episode, EpisodeSetup, Generated, collate_episodes, run_episodes


def demonstration_episodes(setup: EpisodeSetup, rows: Sequence[dict], reply: Callable[[dict, list[dict]], str], *,
                           max_turns: int, env_kwargs: dict | None = None) -> list[Episode]:
    """One episode per row, the assistant's turns given by ``reply(row, messages)`` (the
    conversation so far), each closed with the template's end-of-turn token."""
    tok, eot = setup.renderer.tokenizer, setup.renderer.end_of_turn_id
    opened: list[Episode] = []

    def generate(prompts, active):
        return [Generated(tok(reply(rows[i], opened[i].messages), add_special_tokens=False)["input_ids"] + [eot])
                for i in active]

    return run_episodes(setup, rows, generate, max_turns=max_turns, env_kwargs=env_kwargs, with_rows=True,
                        keep=opened)


def sft_on_episodes(model, episodes: Sequence[Episode], pad_token_id: int, *, steps: int, batch_size: int = 32,
                    lr: float = 3e-3, seed: int = 0, log: Callable[[str], None] | None = None) -> list[float]:
    """Teacher-forced NLL of the action tokens of `episodes` (context attended, not fitted),
    `steps` AdamW steps on random batches; returns the loss per step."""
    from rlhflab.models.actor_critic import PolicyOnly

    rng = random.Random(seed)
    torch.manual_seed(seed)
    actor = PolicyOnly(model).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    device = next(model.parameters()).device
    losses = []
    for step in range(steps):
        batch = collate_episodes(rng.sample(list(episodes), min(batch_size, len(episodes))), pad_token_id)
        out = actor(*(t.to(device) for t in (batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                             batch.response_attention_mask)))
        mask = batch.response_mask.to(device).float()                                # (B, T) actions only
        loss = -(out.logprobs * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if log is not None and (step + 1) % max(1, steps // 5) == 0:
            log(f"  sft step {step + 1}/{steps}: loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
    model.eval()
    return losses


@torch.no_grad()
def greedy_episodes(model, setup: EpisodeSetup, rows: Sequence[dict], *, max_turns: int, max_new_tokens: int,
                    stop_ids: Sequence[int] = (), env_kwargs: dict | None = None, batch_size: int = 64
                    ) -> list[Episode]:
    """Greedy episodes of `model` on `rows` (the hf backend's per-turn generate)."""
    from rlhflab.rollout import hf_generate_ids

    tok = setup.renderer.tokenizer
    stops = sorted({int(s) for s in stop_ids} | {setup.renderer.end_of_turn_id})

    def generate(prompts):
        return hf_generate_ids(model, tok, prompts, max_new_tokens=max_new_tokens, stop_ids=stops, greedy=True,
                               batch_size=batch_size)

    return run_episodes(setup, rows, generate, max_turns=max_turns, stop_ids=stops, env_kwargs=env_kwargs)
