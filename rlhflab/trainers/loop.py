"""The loop around every policy-optimisation method (PPO, GRPO, RLOO, REINFORCE++,
Dr. GRPO, GSPO, TRPO): set up once, then per step

    1. rollout      step k's episodes from the rollout service (fresh prompts keyed by
                    (seed, step); `rlhflab.rollout.service`)
    2-4. prepare    the method's: scores, the reference/old passes, advantages
    5. update       the method's update (the shared engine, or TRPO's own line search)
    (push)          the updated weights to the service, tagged with their version k
    6. log, evaluate, save

A method is what it owns (`prepare(run, roll, step, timer)` and `update(run, roll,
step)`, the numbered phases in its own file) and a few facts: its config section,
whether it has a critic, whether it needs the reference. Everything around it is here,
once. `one_step` runs phases 1-5 of one step in one call, for tests and benches.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from rlhflab import cpu, ops
from rlhflab.data.prompts import PromptFormat, load_prompts, step_prompts
from rlhflab.engine.dist import (Dist, explained_variance, group_advantages,  # noqa: F401 (re-exported)
                                 launched_world_size, whiten)
from rlhflab.engine.update import PPOMath, policy_update
from rlhflab.errors import UserError
from rlhflab.evaluate import EvalChecks, EvalResult, build_eval_checks, evaluate_policy, save_samples
from rlhflab.models.load import resolve_device
from rlhflab.models.setup import CriticKind, PolicyModels, build_models
from rlhflab.rewards import build_reward
from rlhflab.rewards.preflight import preflight
from rlhflab.rollout import Rollout, RolloutBackend, make_backend
from rlhflab.rollout.service import InProcessService, ProducerService, ProducerSpec
from rlhflab.run import Run, TrainResult, entry_point, start_run
from rlhflab.trainers.common import (Timer, check_finite_model, diverged, format_metrics, last_eval,
                                     make_optimization, make_probe_batch)


@dataclass
class PolicyMethod:
    """What the loop needs to know about a method."""

    name: str                                   # the command and the config section, e.g. "grpo"
    prepare: Callable[..., dict]                # phases 2-4: (run, roll, step, timer) -> extra metrics
    update: Callable[..., dict]                 # phase 5: (run, roll, step) -> metrics
    critic: CriticKind | None = None            # PPO: the configured model.critic; critic-free: None
    need_reference: Callable[[object], bool] = lambda cfg: False
    plot_groups: dict[str, list[str]] | None = None
    optimizer_params: Callable[[object], list] | None = None  # what the optimizer trains (default: every trainable)
    step_knob: str = "learning_rate"  # the section key a diverging run is told to lower
    stale_correction: bool = True  # tis_cap defaults to ASYNC_TIS_CAP at max_staleness >= 1 (GSPO: no token weights)


@dataclass
class RLRun:
    """Everything a step function works with."""

    cfg: object                 # the method's run config
    sec: object                 # its method section (a PolicySection)
    models: PolicyModels
    backend: RolloutBackend
    scorer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    math: PPOMath = field(default_factory=PPOMath)
    ptx: object | None = None   # rlhflab.data.ptx.PtxData when sec.ptx_coeff > 0
    dist: Dist = field(default_factory=Dist)
    train_model: torch.nn.Module | None = None  # models.actor as the strategy wraps it (itself in one process)
    checks: EvalChecks | None = None  # eval.correct and eval.rewards, for the held-out evaluation
    context: Run | None = None  # the run context (rlhflab.run): rank 0's writes and prints
    service: object | None = None  # the rollout service (rlhflab.rollout.service): step k's episodes, the pushes

    def ptx_batches(self, step: int):
        return self.ptx.batches(step) if self.ptx is not None else None


def score_responses(scorer, roll: Rollout, reward_cfg, device: torch.device) -> torch.Tensor:
    """Sequence scores (B,): the reward sources, minus the missing-EOS penalty, clipped."""
    scores = scorer.score(roll.prompts, roll.responses, roll.examples).float().to(device)  # (B,)
    if reward_cfg.missing_eos_penalty:
        scores = scores - reward_cfg.missing_eos_penalty * roll.hit_limit.float().to(device)
    if reward_cfg.score_clip is not None:
        scores = scores.clamp(-reward_cfg.score_clip, reward_cfg.score_clip)
    return scores


def env_active(cfg) -> bool:
    """True when the run config names an environment or tools (multi-turn episodes)."""
    env = getattr(cfg, "env", None)
    return env is not None and bool(env.name or env.tools)


def episode_budget(cfg) -> int:
    """Tokens one episode may take on the vLLM engine: `env.max_length`, else room for
    `env.max_turns` turns of prompt-sized context and `max_new_tokens` actions each."""
    env = cfg.env
    return env.max_length or env.max_turns * ((cfg.dataset.max_prompt_length or 256) + cfg.generation.max_new_tokens)


def episode_rewards(roll: Rollout, device: torch.device) -> torch.Tensor | None:
    """(B, N) the environment's turn rewards of a multi-turn rollout, or None."""
    batch = getattr(roll, "episodes", None)
    return None if batch is None else (batch.turn_rewards * batch.turn_mask).float().to(device)


def outcome_scores(roll: Rollout, scores: torch.Tensor) -> torch.Tensor:
    """The episode's return for the outcome-based methods (GRPO, RLOO, Dr. GRPO,
    REINFORCE++): the reward sources' score of the final answer plus the plain sum of the
    environment's turn rewards (`ops.episode_returns`); single-turn: `scores` unchanged."""
    turns = episode_rewards(roll, scores.device)
    if turns is None:
        return scores
    return scores + ops.episode_returns(turns, torch.ones_like(turns))


def broadcast_advantages(seq_advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The same advantage on every response token: (B,), (B, T) -> (B, T), 0 on padding."""
    if seq_advantages.dim() != 1 or seq_advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(f"advantages must be (B,) = ({response_mask.shape[0]},), "
                         f"got {tuple(seq_advantages.shape)}")
    return seq_advantages.float().unsqueeze(1) * response_mask.float()  # (B, T)


def rollout_metrics(roll: Rollout, dist: Dist | None = None) -> dict[str, float]:
    """Rewards, lengths and what the method put on the rollout (values, advantages, KL),
    over the whole step: under several processes the per-response numbers are gathered
    and the per-token means summed over ranks."""
    dist = dist or Dist()
    mask = roll.response_mask.float()
    per_row = torch.stack([roll.scores.float().cpu(), mask.sum(-1).cpu(), roll.hit_limit.float().cpu()], 1)
    per_row = torch.cat(dist.gather(per_row)) if dist.distributed else per_row       # (B_all, 3)
    scores, lengths, hit_limit = per_row.unbind(1)

    def token_mean(x: torch.Tensor) -> float:
        return float(dist.sum(float((x * mask).sum())) / max(dist.sum(float(mask.sum())), 1.0))

    out = {
        "rollout/reward_mean": float(scores.mean()),
        "rollout/reward_std": float(scores.std()) if len(roll) > 1 else 0.0,
        "rollout/response_length": float(lengths.mean()),
        "rollout/response_length_min": float(lengths.min()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/hit_limit_frac": float(hit_limit.mean()),
    }
    if roll.group_size > 1:  # groups whose rewards are all equal teach nothing (a group never straddles ranks)
        groups = scores.view(-1, roll.group_size)
        out["rollout/zero_spread_frac"] = float(((groups.max(1).values - groups.min(1).values) <= 1e-8)
                                                .float().mean())
    if roll.values is not None:
        out["rollout/value_mean"] = token_mean(roll.values)
    if roll.advantages is not None:
        out["rollout/advantage_mean"] = token_mean(roll.advantages)
        out["rollout/advantage_abs_mean"] = token_mean(roll.advantages.abs())
    if roll.returns is not None:
        out["rollout/return_mean"] = token_mean(roll.returns)
    if roll.values is not None and roll.returns is not None:  # the rollout's (pre-update) values
        ev = explained_variance(roll.values, roll.returns, roll.response_mask, dist)
        if math.isfinite(ev):  # NaN: the returns do not vary, nothing to explain
            out["rollout/explained_variance"] = ev
    if roll.kl is not None:  # the estimator that is penalised, summed over a response, averaged
        out["params/kl_to_ref"] = dist.mean(float((roll.kl * mask).sum(-1).mean()))
    if (getattr(roll, "sample_logprobs", None) is not None and roll.logprobs is not None
            and not roll.old_from_sampler):  # else the update measures it, before its first step
        out["rollout/logprob_gap"] = token_mean((roll.logprobs - roll.sample_logprobs).abs())
    if getattr(roll, "episodes", None) is not None:  # multi-turn: turns, max_turns, tool errors
        from rlhflab.envs.rollout import episode_metrics
        out.update(episode_metrics(roll, dist))
    return out


PLOT_GROUPS: dict[str, list[str]] = {
    "reward": ["rollout/reward_mean", "eval/reward_mean", "eval/accuracy"],
    "losses": ["loss/policy", "loss/value", "loss/kl", "loss/ptx", "loss/total"],
    "entropy": ["loss/entropy"],
    "kl": ["params/approx_kl", "params/kl_to_ref"],
    "clipping": ["params/policy_clip_frac", "params/clip_frac_low", "params/clip_frac_high",
                 "params/value_clip_frac"],
    "grad_norm": ["params/grad_norm"],
    "length": ["rollout/response_length"],
    "zero_spread": ["rollout/zero_spread_frac"],
    "values": ["rollout/value_mean", "rollout/return_mean"],
    "explained_variance": ["rollout/explained_variance"],
    "time": ["time/generate", "time/score", "time/forward", "time/update"],
    "lr": ["lr"],
}


def world_counts(sec, key: str) -> dict[str, int]:
    """The global counts of a method's section that must divide among the processes (the
    run context checks them before anything loads), by the name its error gives them."""
    return {f"{key}: prompts per step": sec.rollout_size // sec.samples_per_prompt,
            f"{key}.mini_batch_size": sec.mini_batch_size}


def build_run(cfg, method: PolicyMethod, *, resume_dir: Path | None = None, math_: PPOMath | None = None,
              dist: Dist | None = None, context: Run | None = None) -> RLRun:
    """The models, sampler, reward, optimizer and schedule of a run (no disk writes);
    under several processes the trained module is wrapped for the launcher's strategy."""
    train_cfg, sec, dist = cfg.training, getattr(cfg, method.name), dist or Dist()
    if context is None:  # a run built outside the run context (tests, benches): its CPU settings
        cpu.setup_process(resolve_device(train_cfg.device), cfg.cpu)
    processes = max(dist.world_size, launched_world_size())  # also a run built outside its launcher's context
    models = build_models(cfg.model, cfg.lora, train_cfg.device, need_reference=method.need_reference(cfg),
                          critic=method.critic, resume_dir=resume_dir, mixed_precision=train_cfg.mixed_precision,
                          world_size=processes)
    # The CPU-only speed tricks (rlhflab.cpu), on a CPU: through the run context when there is one.
    context.adopt_models(models) if context is not None else cpu.apply_to_models(models, cfg.model)
    shown = PromptFormat.resolve(cfg.dataset.prompt_template, cfg.dataset.use_chat_template, models.tokenizer)
    scorer = build_reward(cfg.reward, models.device, shown, models.tokenizer)  # reference rows shown as the run's
    checks = build_eval_checks(cfg.eval, models.device, shown, models.tokenizer) if train_cfg.eval_interval else None
    params = (method.optimizer_params or (lambda actor: actor.trainable_parameters()))(models.actor)
    optimizer, scheduler = make_optimization(params, sec, train_cfg.total_steps * sec.optimizer_steps_per_rollout())
    train_model, optimizer = dist.prepare(models.actor, optimizer, sec.max_grad_norm)
    dist.hold(train_model, "root")  # FSDP: decoder layers gathered one at a time outside the update
    prompt_room = cfg.dataset.max_prompt_length
    if env_active(cfg) and cfg.generation.backend == "vllm":  # the engine holds whole episodes
        prompt_room = episode_budget(cfg) - cfg.generation.max_new_tokens
    sizes = dict(prompt_room=prompt_room, batch_size=sec.batch_size, seed=train_cfg.seed, rank=dist.rank,
                 world_size=processes)
    gen = cfg.generation
    producer = producing(cfg)
    if producer and gen.backend != "hf":  # the engine runs in the producer; here hf serves the evaluation
        gen = replace(gen, backend="hf", vllm=replace(gen.vllm, kv_cache_gb=None, enforce_eager=False, sync_interval=1))
    if (gen.max_staleness and getattr(sec, "tis_cap", "n/a") is None and method.stale_correction
            and gen.old_logprobs != "sampler" and getattr(sec, "sequence_mask_cap", None) is None):  # (with the sampler as pi_old the weight would be 1)
        sec.tis_cap = ASYNC_TIS_CAP  # the behaviour policy is the stale sampler: TIS by default
    backend = build_backend(cfg, models.policy, models.tokenizer, gen=gen, context=context, **sizes)
    service = InProcessService(backend)
    if producer:
        spec = producer_spec(cfg, models, sizes)
        service = ProducerService(spec, staleness=cfg.generation.max_staleness,
                                  timeout_s=cfg.generation.producer_timeout_s, device=models.device,
                                  sync_check=cfg.generation.vllm.sync_check, factor=cfg.generation.vllm.sync_check_factor,
                                  floor=cfg.generation.vllm.sync_check_floor)
        if context is not None:  # the producer ends with the run, whatever ended it
            context.on_close(service.close)
    ptx = None
    if sec.ptx_coeff > 0:
        from rlhflab.data.ptx import PtxData
        ptx = PtxData.load(sec.ptx_data, models.tokenizer, prompt_template=cfg.dataset.prompt_template,
                           use_chat_template=cfg.dataset.use_chat_template, batch_size=sec.ptx_batch_size,
                           max_seq_length=cfg.dataset.max_prompt_length + cfg.generation.max_new_tokens,
                           seed=train_cfg.seed * 1_009 + dist.rank, device=models.device)
    return RLRun(cfg, sec, models, backend, scorer, optimizer, scheduler, math_ or PPOMath(), ptx, dist,
                 train_model, checks, context, service)


SAMPLER_WEIGHTS = "sampler_weights"  # a checkpoint's folder of the older versions the producer samples next


def save_sampler_weights(folder: Path, held: dict[int, dict]) -> None:
    """Write the weight versions the next steps sample from (max_staleness >= 1) into a
    checkpoint folder: sampler_weights/v<version>.safetensors each."""
    from safetensors.torch import save_file

    out = folder / SAMPLER_WEIGHTS
    out.mkdir(exist_ok=True)
    for version, state in held.items():
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"v{version}.safetensors"))


def load_sampler_weights(folder: Path) -> dict[int, dict]:
    """The weight versions a checkpoint kept for its producer (`save_sampler_weights`)."""
    from safetensors.torch import load_file

    out = Path(folder) / SAMPLER_WEIGHTS
    if not out.is_dir():
        return {}
    return {int(p.stem[1:]): load_file(str(p)) for p in sorted(out.glob("v*.safetensors"))}


ASYNC_TIS_CAP = 2.0  # tis_cap at max_staleness >= 1 when none is set (docs/rollout_backends.md: why 2)


def producing(cfg) -> bool:
    """Whether the run samples in a producer process (generation.max_staleness >= 1, or
    generation.producer: process)."""
    gen = cfg.generation
    return gen.max_staleness > 0 or gen.producer == "process"


def async_refusal(cfg, strategy: str | None = None) -> str | None:
    """Why this run cannot sample in a producer process, in one line; None when it can
    (a method whose section says ASYNCHRONOUS = False is refused at load: `sampler_rules`)."""
    gen = cfg.generation
    if not producing(cfg):
        return None
    if strategy in ("fsdp", "zero3"):
        return (f"generation.max_staleness / generation.producer: process under {strategy}: the weights are "
                f"sharded, and the producer takes whole weights from each rank; launch with "
                f"configs/accelerate/ddp.yaml or set generation.max_staleness: 0")
    return None


def build_backend(cfg, policy, tokenizer, *, gen=None, prompt_room: int | None, batch_size: int, seed: int,
                  rank: int = 0, world_size: int = 1, context: Run | None = None):
    """The run's sampler on `policy` (`gen`: the generation section, cfg.generation unless
    given): `rollout.make_backend`, wrapped for multi-turn episodes when an environment is
    configured (`envs.rollout.EpisodeBackend`). The rollout producer builds its own with it."""
    gen = gen or cfg.generation
    backend = make_backend(gen, policy, tokenizer, max_prompt_length=prompt_room, batch_size=batch_size,
                           seed=seed, rank=rank, world_size=world_size)
    if context is not None:  # the backend stops with the run (vllm: its engine)
        context.on_close(backend.close)
    if env_active(cfg):  # multi-turn episodes through the same backend (rlhflab.envs.rollout)
        from rlhflab.envs import setup_episodes
        from rlhflab.envs.rollout import EpisodeBackend
        from rlhflab.rollout import eos_ids_of
        backend = EpisodeBackend(backend, setup_episodes(cfg.env, tokenizer), cfg.env, tokenizer,
                                 prompt_field=cfg.dataset.prompt_field, stop_ids=eos_ids_of(policy, tokenizer))
    return backend


def build_producer_backend(cfg, sizes: dict, model, tokenizer):
    """In the producer process: the run's sampler on its copy of the policy, seeded by
    (seed, step, row) (hf), recording the sampler's log-probs for the importance weights
    when the run is asynchronous."""
    gen = cfg.generation
    if gen.backend == "hf":
        gen = replace(gen, seeded_sampling=True)
    backend = build_backend(cfg, model, tokenizer, gen=gen, **sizes)
    inner = getattr(backend, "backend", backend)
    if gen.max_staleness and hasattr(inner, "sample_logprobs"):
        inner.sample_logprobs = True
    return backend


def setup_producer_model(cpu_cfg, model_cfg, device, model) -> None:
    """In the producer process: the CPU settings the trainer's policy got (`rlhflab.cpu`)."""
    cpu.setup_process(device, cpu_cfg)
    cpu.apply(model, model_cfg, device)


def producer_spec(cfg, models: PolicyModels, sizes: dict) -> ProducerSpec:
    """What the producer process builds its copy of the policy and its sampler from."""
    from functools import partial

    policy, gen = models.policy, cfg.generation
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    threads = cfg.training.num_threads or max(1, (os.cpu_count() or 2) // 2)
    texts = ["The quick brown fox jumps over the lazy dog.", "1 + 2 = 3, and 4 + 5 = 9."]
    probe = make_probe_batch(models.tokenizer, texts, "cpu")
    return ProducerSpec(build=partial(build_producer_backend, cfg, sizes), model_config=base.config,
                        generation_config=getattr(base, "generation_config", None),
                        dtype=next(base.parameters()).dtype, tokenizer=models.tokenizer, device=str(models.device),
                        threads=threads, probe=probe, setup=partial(setup_producer_model, cfg.cpu, cfg.model, models.device),
                        extra={"temperature": gen.temperature,  # vLLM: its gap on every rollout judged there
                               "engine_gap": (gen.backend == "vllm" and gen.vllm.sync_check and gen.top_k == 0
                                              and gen.top_p == 1.0 and gen.min_new_tokens == 0)})


def sample_rollout(run: RLRun, examples, step: int, timer: Timer) -> Rollout:
    """1. rollout: `samples_per_prompt` responses per example (each group contiguous)."""
    with timer("generate"):
        return run.backend.generate([e.prompt for e in examples], n=run.sec.samples_per_prompt,
                                    examples=[e.row for e in examples], step=step)


def one_step(run: RLRun, examples, step: int, timer: Timer, prepare: Callable, update: Callable) -> dict[str, float]:
    """Phases 1-5 of one step in one call (tests and benches): the rollout, `prepare`
    (2-4), `update` (5); returns the step's metrics as the loop logs them."""
    roll = sample_rollout(run, examples, step, timer)
    return prepare_and_update(run, roll, step, timer, prepare, update)


def prepare_and_update(run: RLRun, roll: Rollout, step: int, timer: Timer, prepare: Callable,
                       update: Callable) -> dict[str, float]:
    """Phases 2-5 on step `step`'s rollout; returns the rollout's metrics, the update's and
    what `prepare` measured."""
    extra = prepare(run, roll, step, timer)  # 2-4. scores, the passes the method needs, advantages
    with timer("update"):                    # 5. update
        upd = update(run, roll, step)
    return {**rollout_metrics(roll, run.dist), **upd, **extra}


def run_update(run: RLRun, roll: Rollout, step: int) -> dict[str, float]:
    """5. update: the shared engine on the rollout's advantages."""
    cfg, model = run.cfg, run.train_model or run.models.actor
    with run.dist.holding(model, "sharded"):  # FSDP: every unit sharded for the update (a no-op otherwise)
        return policy_update(model, run.optimizer, run.scheduler, roll, run.sec,
                             temperature=cfg.generation.temperature, step=step, seed=cfg.training.seed,
                             max_new_tokens=cfg.generation.max_new_tokens, math_=run.math,
                             ptx=run.ptx_batches(step), dist=run.dist)


def env_preflight(cfg, quiet: bool = False):
    """One canned episode of the configured environment and tools on the first training
    row, before any model loads (`rlhflab.envs.preflight`); None without an `env:`."""
    if not env_active(cfg):
        return None
    from rlhflab.data.prompts import load_prompts
    from rlhflab.envs import preflight_env

    first = load_prompts(cfg.dataset, None, "train")[0]
    row = dict(first.row)
    row.setdefault("prompt", row.get(cfg.dataset.prompt_field, ""))
    return preflight_env(cfg.env, row, quiet=quiet)


def evaluate(run: RLRun, examples, out_dir: Path, step: int, n_show: int = 2) -> dict:
    """Greedy held-out evaluation; every sample saved to eval/step_N.jsonl, the first
    `n_show` printed. Under several processes each rank decodes whole batches (batch i on
    rank i mod N, so every batch is the one a single process would decode) and the main
    process gathers them: the same numbers either way."""
    cfg, dist = run.cfg, run.dist
    size = cfg.training.eval_batch_size
    batches = [examples[i : i + size] for i in range(0, len(examples), size)]
    mine = [b for i, b in enumerate(batches) if i % dist.world_size == dist.rank]
    # FSDP and ZeRO-3 decode in lockstep: a rank short of a batch decodes batch 0 again and drops it.
    spare = -(-len(batches) // dist.world_size) - len(mine) if dist.lockstep else 0
    def decode(b):
        if env_active(cfg):  # greedy episodes; the reward sources and checks read the final answer
            from rlhflab.evaluate import score_rollout as score_eval
            roll = run.backend.generate([e.prompt for e in b], examples=[e.row for e in b], greedy=True)
            return score_eval(roll, run.scorer, run.checks)
        return evaluate_policy(run.models.policy, run.models.tokenizer, b, run.scorer,
                               max_new_tokens=cfg.generation.max_new_tokens,
                               max_prompt_length=cfg.dataset.max_prompt_length, batch_size=size, checks=run.checks)

    parts = [decode(b).samples for b in mine + batches[:1] * spare][: len(mine)]
    gathered = dist.gather(parts)                       # rank r holds batches r, r+N, r+2N, ...
    samples = [s for i in range(len(batches)) for s in gathered[i % dist.world_size][i // dist.world_size]]
    res = EvalResult.from_samples(samples, extra=tuple(run.checks.rewards) if run.checks is not None else ())

    def write() -> None:  # the main process writes every sample and prints the first few
        path = save_samples(res, out_dir / "eval" / f"step_{step}.jsonl")
        if run.context is not None:
            run.context.write(format_eval(step, res, path, n_show))

    dist.on_main(write)
    return res.metrics()


def format_eval(step: int, res: EvalResult, path: Path, n_show: int = 2) -> str:
    """The printout of one evaluation: its metrics over the held-out prompts, then the
    first `n_show` of them with their greedy response (one response each; a response that
    runs on past its answer, as an untrained model's does, is still one response)."""
    when = "step 0 (before training)" if step == 0 else f"step {step}"
    shown = min(n_show, len(res.samples))
    lines = [f"eval at {when}: {format_metrics(res.metrics())} over {len(res.samples)} held-out prompts, greedy "
             f"(all samples: {path})" + (f"; the first {shown}:" if shown else "")]
    for s in res.samples[:shown]:
        verdict = "" if "correct" not in s else (", correct" if s["correct"] else ", wrong")
        lines.append(f"  {s['prompt']!r}\n    -> {s['response']!r}  score {s['score']:.2f}{verdict}")
    return "\n".join(lines)


@entry_point
def run_policy_training(cfg, method: PolicyMethod, *, resume: str | Path | None = None, effective=None,
                        quiet: bool = False, math_: PPOMath | None = None) -> TrainResult:
    """Set up, then per step: 1. the step's episodes from the rollout service, 2-4. the
    method's prepare, 5. its update, the weights pushed, then 6. log, evaluate, save.
    Returns where the outputs went and the metric history.

    Under several processes (`accelerate launch`, `torchrun`) each rank samples its share
    of the step's prompts and the engine reduces what must be global; the run context
    (`rlhflab.run`) has the main process alone write.
    """
    train_cfg, sec = cfg.training, getattr(cfg, method.name)
    run_ = start_run(cfg, method.name, effective=effective, resume=resume, quiet=quiet, resumable=True,
                     backend=cfg.generation.backend, critic=method.critic or "none",
                     local=world_counts(sec, method.name),
                     preflight=lambda silent: (preflight(cfg, silent),  # every reward/check plug-in, called once
                                               env_preflight(cfg, silent)))  # and one canned episode
    refusal = async_refusal(cfg, strategy="fsdp" if run_.dist.lockstep else None)
    if refusal is not None:
        raise UserError(refusal)
    run = build_run(cfg, method, resume_dir=run_.resume_dir, math_=math_, dist=run_.dist, context=run_)
    models, optimizer = run.models, run.optimizer
    train_examples = load_prompts(cfg.dataset, models.tokenizer, "train")
    eval_examples = load_prompts(cfg.dataset, models.tokenizer, "eval") if train_cfg.eval_interval else []
    start_step = run_.restore(optimizer, run.scheduler, run.train_model, rank_streams=True)
    knob = f"{method.name}.{method.step_knob}"  # what a divergence message tells the user to lower
    out_dir = run_.open(sec.max_grad_norm, kl_knob=f"{method.name}.{sec.KL_KNOB}", lr_knob=knob)
    result = run_.result(unit="episodes")
    if eval_examples and start_step == 0:
        result.eval_before = evaluate(run, eval_examples, out_dir, 0)
        run_.log_start(result.eval_before, show=False)  # evaluate printed it

    probe = make_probe_batch(models.tokenizer, [e.prompt for e in train_examples[:4]], models.device)

    def save(folder: Path, step: int) -> None:
        held = run.service.held_weights(step)  # s >= 1: the older weights the next s steps sample from
        run_.save_checkpoint(folder, step, module=run.train_model, actor=models.actor, tokenizer=models.tokenizer,
                             optimizer=optimizer, scheduler=run.scheduler, rank_rng=True, hold=False,
                             more=(lambda tmp: save_sampler_weights(tmp, held)) if held else None)

    def examples_of(step: int) -> list:
        # Fresh prompts every step; the draw depends only on (seed, step), so a resume
        # matches; each rank takes its contiguous share of them.
        prompts = step_prompts(train_examples, sec.rollout_size // sec.samples_per_prompt, train_cfg.seed, step)
        return run.dist.shard(prompts, f"{method.name}: prompts per step")

    # The rollout service starts sampling: step start_step+1 on (and up to s steps ahead).
    run.service.start(start_step, examples_of, sec.samples_per_prompt, policy=models.policy,
                      saved=load_sampler_weights(run_.resume_dir) if run_.resume_dir is not None else None,
                      last=train_cfg.total_steps)

    bar = run_.progress(train_cfg.total_steps, initial=start_step)
    total_samples, total_seconds = 0, 0.0
    for step in range(start_step + 1, train_cfg.total_steps + 1):
        timer = Timer()
        t0 = time.perf_counter()
        try:
            # 1. rollout: step k's episodes, sampled from the weights of version k-1-s (s = max_staleness).
            with timer("generate"):
                roll = run.service.get(step)
            # 2-4. the method's prepare: score, forward (reference / old passes), advantages.
            extra = method.prepare(run, roll, step, timer)
            # 5. the method's update.
            with timer("update"):
                upd = method.update(run, roll, step)
            metrics = {**rollout_metrics(roll, run.dist), **upd, **extra}
        except FloatingPointError as exc:  # a non-finite loss or gradient: stop in one line
            raise diverged(step, str(exc).removeprefix(f"step {step}: "), knob,
                           optimizer.param_groups[0]["lr"]) from None
        # Weights that blew up (a finite loss can still step them to inf) stop the run here,
        # before the next rollout samples from them or a checkpoint keeps them.
        check_finite_model(models.policy, probe, step=step, knob=knob, lr=optimizer.param_groups[0]["lr"])
        # The sampler follows the update: the weights of version k go to the service.
        run.service.push(models.policy, step, updates=sec.optimizer_steps_per_rollout())
        seconds = time.perf_counter() - t0
        total_samples += sec.rollout_size
        total_seconds += seconds
        # 6. log, evaluate, save.
        metrics.update(timer.metrics())
        metrics["time/step"] = seconds
        metrics["perf/episodes_per_s"] = sec.rollout_size / seconds
        if "time/generate" in metrics and "rollout/response_length" in metrics and not cfg.generation.max_staleness:
            # (at max_staleness >= 1 time/generate is the wait for the producer, not its sampling)
            metrics["perf/tokens_per_s"] = (metrics["rollout/response_length"] * sec.rollout_size
                                            / max(metrics["time/generate"], 1e-9))
        if producing(cfg):  # what the producer adds: how stale the episodes were, the pushes' probe gaps
            metrics["rollout/version_gap"] = float(step - 1 - roll.version)
            metrics.update(run.service.metrics())
        if eval_examples and (step % train_cfg.eval_interval == 0 or step == train_cfg.total_steps):
            metrics.update(evaluate(run, eval_examples, out_dir, step))
        run_.log(step, metrics)
        run.service.judge(metrics, step)  # the weight-sync canary on the pushes, before a save
        postfix = {"reward": f"{metrics['rollout/reward_mean']:.3f}"}
        if "params/kl_to_ref" in metrics:
            postfix["kl"] = f"{metrics['params/kl_to_ref']:.3f}"
        bar.update(1)
        bar.set_postfix(**postfix)
        if train_cfg.save_interval and step % train_cfg.save_interval == 0 and step < train_cfg.total_steps:
            save(out_dir / f"step_{step}", step)
    bar.close()
    save(result.final_dir, train_cfg.total_steps)
    result.eval_after = last_eval(result.history)
    result.samples_per_s = total_samples / total_seconds if total_seconds else 0.0
    result.models = models
    run_.finish(method.plot_groups or PLOT_GROUPS, eval_before=result.eval_before, eval_after=result.eval_after,
                episodes_per_s=result.samples_per_s)
    return result


# --------------------------------------------------------------------------------------
# The command line of a policy method
# --------------------------------------------------------------------------------------
def add_policy_parser(parser, command: str, example: str) -> None:
    """`rlhflab <command> --config FILE [--resume DIR] [key=value ...]`."""
    stem = command.replace("-", "_")
    parser.add_argument("--config", required=True, help=f"YAML config, e.g. configs/{stem}_debug.yaml "
                                                        f"(every key: rlhflab config show {command})")
    parser.add_argument("--resume", default=None, help="continue from a step_N/ checkpoint folder")
    parser.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")


def run_policy_command(args, schema, train) -> int:
    """Load the config (file, then overrides), train, report."""
    from rlhflab.config import load_config

    cfg, effective = load_config(args.config, schema, args.overrides)
    train(cfg, resume=args.resume, effective=effective).report()
    return 0


# --------------------------------------------------------------------------------------
# A policy method's run config and entry points, written once
# --------------------------------------------------------------------------------------
def sampler_rules(gen, sec, section: str) -> list[str]:
    """Cross-section rules of `generation.old_logprobs: sampler` and
    `generation.max_staleness` for a method's section."""
    if gen.max_staleness and not getattr(sec, "ASYNCHRONOUS", True):
        return [f"generation.max_staleness: {gen.max_staleness} is not available to {section}: its update is a "
                f"line search over the very policy that sampled (a stale sampler breaks its trust region); set "
                f"generation.max_staleness: 0"]
    if gen.old_logprobs != "sampler":
        return []
    if not getattr(sec, "SAMPLER_OLD_LOGPROBS", True):
        return [f"generation.old_logprobs: sampler is not available to {section} (its update recomputes the old "
                f"policy's whole distribution); set generation.old_logprobs: recompute"]
    for key in ("tis_cap", "sequence_mask_cap"):
        if getattr(sec, key, None) is not None:
            return [f"{section}.{key}: weighs by pi_old / pi_sampler, which is 1 when pi_old is the sampler's "
                    f"(generation.old_logprobs: sampler); set {section}.{key}: null or old_logprobs: recompute"]
    return []


def policy_run_config(cls_name: str, section: str, section_cls: type, *, command: str, title: str,
                      kl_weight: str, module: str) -> type:
    """The run config class of a policy method: the shared sections (model, lora, dataset,
    generation, reward, eval, training, logging) and `section: section_cls`, in the order
    the YAML shows them; `check()` applies the reference rule to `<section>.<kl_weight>`
    (a KL weight of 0 loads no reference). `title` reads "a GRPO"; `module` is the
    method's module, where the class is found by name (`config show`, the registry)."""
    from dataclasses import field as dc_field, make_dataclass

    from rlhflab.config.schema import (CpuConfig, DatasetConfig, EvalConfig, GenerationConfig, LoggingConfig,
                                       LoRAConfig, ModelConfig, RewardConfig, TrainingConfig, check_reference,
                                       check_token_budget)

    from rlhflab.envs.base import EnvConfig

    sections = [("model", ModelConfig), ("lora", LoRAConfig), ("dataset", DatasetConfig),
                ("generation", GenerationConfig), ("reward", RewardConfig), ("env", EnvConfig), ("eval", EvalConfig),
                (section, section_cls), ("training", TrainingConfig), ("logging", LoggingConfig), ("cpu", CpuConfig)]

    def check(self) -> list[str]:
        return (check_reference(self.model, self.lora, getattr(getattr(self, section), kl_weight),
                                f"{section}.{kl_weight}")
                + [f"env.{e}" for e in (self.env.check() if (self.env.name or self.env.tools) else [])]
                + sampler_rules(self.generation, getattr(self, section), section)
                + check_token_budget(self.generation, getattr(self, section), section))

    cls = make_dataclass(cls_name, [(name, kind, dc_field(default_factory=kind)) for name, kind in sections],
                         namespace={"check": check, "__doc__": f"`rlhflab {command}`: every section of {title} run."})
    cls.__module__ = module
    return cls


def policy_entry_points(method_of: Callable[[object], PolicyMethod], schema: type, *, command: str, example: str,
                        math_: PPOMath | None = None):
    """`train(cfg, resume=None, effective=None, quiet=False, math_=None)`, `add_parser` and
    `run` of a policy method: `run_policy_training` with `method_of(cfg)` (and the
    method's `math_`, e.g. GSPO's policy loss, unless the caller passes its own), the
    `--config`/`--resume` parser, the command that loads, trains and reports."""

    def train(cfg, resume: str | Path | None = None, effective=None, quiet: bool = False,
              math_: PPOMath | None = math_) -> TrainResult:
        return run_policy_training(cfg, method_of(cfg), resume=resume, effective=effective, quiet=quiet,
                                   math_=math_)

    train.__doc__ = f"Run `rlhflab {command}` as configured; returns where the outputs went and the history."

    def add_parser(parser) -> None:
        add_policy_parser(parser, command, example)

    def run(args) -> int:
        return run_policy_command(args, schema, train)

    return train, add_parser, run
