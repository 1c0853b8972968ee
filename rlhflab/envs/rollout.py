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

Each backend contributes one primitive, ``generate_ids(list of id lists) -> list[Generated]``:
the hf backend's `model.generate` on the left-padded id lists, the vLLM backend's engine
on the token ids themselves (its prefix cache reuses every earlier turn's KV). A turn
stops at the template's end-of-turn token or the model's EOS, after at most
`generation.max_new_tokens` tokens.

Seeded sampling (`generation.seeded_sampling`) keys each turn's noise by (seed, step, the
episode's global row, the turn): turn 0 uses exactly the single-turn keys, so a one-turn
environment samples what the single-turn rollout samples.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlhflab.envs.episode import EpisodeBatch, EpisodeSetup, Generated, collate_episodes, run_episodes
from rlhflab.errors import UserError

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


@torch.no_grad()
def hf_generate_ids(model, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    stop_ids: Sequence[int], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    greedy: bool = False, batch_size: int = 64, keys: torch.Tensor | None = None,
                    sample_logprobs: bool = False) -> list[Generated]:
    """`model.generate` on token-id prompts (left-padded in batches); the ids after each
    prompt, uncut (the episode runner cuts at the first stop id). `keys` (one per prompt):
    seeded sampling as `rlhflab.rollout.hf`'s;
    `sample_logprobs`: each id's log-probability under that draw, too."""
    from rlhflab.rollout.hf import decode_kwargs, draw_kwargs, drawn_logprobs, lockstep_of

    if lockstep_of(model):
        # Sharded layers make every rank run each generate call together, but episodes
        # end after different numbers of turns on different ranks: the calls would not pair up.
        raise UserError("env: multi-turn episodes with generation.backend=hf do not run under FSDP or "
                        "ZeRO-3 (sharded layers); use DDP or ZeRO-2 (configs/accelerate/ddp.yaml, zero2.yaml), "
                        "or generation.backend=vllm")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=list(stop_ids), use_cache=True,
                  **decode_kwargs(model, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p))
    was_training = model.training
    model.eval()
    out: list[Generated] = []
    for s in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[s : s + batch_size]]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)          # (G, P)
        am = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)  # (G, P)
        call_kw = dict(kwargs)
        call_kw.update(draw_kwargs(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                                   keys=None if keys is None else keys[s : s + batch_size], prompt_len=width,
                                   record=sample_logprobs))
        seqs = model.generate(input_ids=ids, attention_mask=am, **call_kw)[:, width:]
        drawn = drawn_logprobs(call_kw)
        if drawn is None:
            out.extend(Generated(row.tolist()) for row in seqs.cpu())
        else:
            out.extend(Generated(row.tolist(), lp.tolist()) for row, lp in zip(seqs.cpu(), drawn.cpu()))
    if was_training:
        model.train()
    return out


def vllm_generate_ids(engine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                      keys: torch.Tensor | None = None) -> list[Generated]:
    """The vLLM engine on token-id prompts, with the sampler's log-probs. vLLM's prefix
    cache (on by default in its V1 engine) serves the earlier turns of each episode."""
    from vllm import SamplingParams

    room = [engine.max_model_len - len(p) for p in prompts]
    params = []
    for i, r in enumerate(room):
        p = SamplingParams(n=1, max_tokens=max(1, min(max_new_tokens, r)), temperature=0.0 if greedy else temperature,
                           top_k=0 if greedy else top_k, top_p=1.0 if greedy else top_p,
                           stop_token_ids=list(stop_ids), logprobs=0, detokenize=False)
        if keys is not None and not greedy:
            p.seed = int(keys[i])
        params.append(p)
    outs = engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        res.append(Generated(ids, [step[t].logprob for step, t in zip(c.logprobs, ids)]))
    return res


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
        b, g = self.backend, self.backend.gen
        kw = dict(max_new_tokens=max_new_tokens, stop_ids=self.stop_ids, temperature=g.temperature,
                  top_k=g.top_k, top_p=g.top_p, greedy=greedy)
        if hasattr(b, "engine"):  # vLLM: push pending weights first (what its generate does)
            due = b.updates >= g.sync_interval if b.counting else not b.fresh
            b.on_pushed_weights = due or b.on_pushed_weights
            b.fresh = False
            b.engine.wake_up()
            if due:
                b.engine.sync_weights(b.policy)
                b.updates, b.pushes = 0, b.pushes + 1
            seed = getattr(b, "seed", None) if getattr(g, "seeded_sampling", False) else None
            keys = None if seed is None else _keys(seed, step, turn, row_offset, rows)
            return vllm_generate_ids(b.engine, prompts, keys=keys, **kw)
        keys = None if b.seed is None else _keys(b.seed, step, turn, row_offset, rows)
        return hf_generate_ids(b.policy, self.tokenizer, prompts, batch_size=b.batch_size, keys=keys,
                               sample_logprobs=b.sample_logprobs, **kw)

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
        engine = getattr(self.backend, "engine", None)  # vLLM: no episode longer than the engine holds
        max_length = cfg.max_length or (engine.max_model_len if engine is not None else None)
        episodes = run_episodes(self.setup, rows, gen, max_turns=cfg.max_turns, stop_ids=self.stop_ids,
                                step_timeout_s=cfg.step_timeout_s, max_length=max_length,
                                env_kwargs=cfg.kwargs, with_rows=True)
        batch = collate_episodes(episodes, self.tokenizer.pad_token_id)
        self.last = batch
        if engine is not None:
            engine.sleep()  # GPU: free the engine's memory for the update; a no-op on CPU
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
