"""Mixed precision (`training.mixed_precision: bf16`): what runs in bfloat16, what stays
float32, the ratio of the first minibatch, one step of every trainer against float32,
and the one-line errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlhflab import ops
from rlhflab.config import load_config
from rlhflab.errors import UserError
from rlhflab.models.actor_critic import ActorCritic, Critic, Reference, ValueHead, hidden_size_of
from rlhflab.models.load import load_model
from rlhflab.models.precision import autocast, check_mixed_precision
from rlhflab.rewards import register

ROOT = Path(__file__).resolve().parents[1]


def _batch(tok, n: int = 4, t: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = tok([f"Question: what is {i} + {2 * i}?\nAnswer:" for i in range(n)], return_tensors="pt",
                  padding=True)
    response_ids = torch.randint(3, len(tok), (n, t), generator=g)                     # (B, T)
    response_mask = torch.ones(n, t, dtype=torch.long)
    response_mask[0, 3:] = 0                                                           # one short response
    return prompts["input_ids"], prompts["attention_mask"], response_ids, response_mask


def _linear_output_dtypes(module: torch.nn.Module) -> tuple[list[torch.dtype], list]:
    """Record the output dtype of every nn.Linear in `module` (hooks returned for removal)."""
    seen: list[torch.dtype] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
             for m in module.modules() if isinstance(m, torch.nn.Linear)]
    return seen, hooks


# --------------------------------------------------------------------------------------
# What runs in bfloat16 and what stays float32
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["value_head", "separate"])
def test_autocast_runs_decoder_matmuls_in_bfloat16_and_keeps_logprobs_values_float32(tiny_model_dir, layout):
    policy, tok = load_model(str(tiny_model_dir))
    if layout == "separate":
        base = load_model(str(tiny_model_dir))[0]
        actor = ActorCritic(policy, critic=Critic(base, ValueHead(hidden_size_of(base))))
    else:
        actor = ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy)))
    batch = _batch(tok)
    decoders = [policy.model] + ([actor.critic.base.model] if layout == "separate" else [])
    out = {}
    for mode in ("no", "bf16"):
        actor.mixed_precision = mode
        seen, hooks = [], []
        for d in decoders:
            s, h = _linear_output_dtypes(d)
            seen.append(s)
            hooks += h
        out[mode] = actor(*batch, with_values=True, with_entropy=True)
        for h in hooks:
            h.remove()
        # Every projection of every decoder layer (q, k, v, o, gate, up, down: 7 per layer, 2 layers).
        want = torch.bfloat16 if mode == "bf16" else torch.float32
        for s in seen:
            assert len(s) == 14 and set(s) == {want}, (mode, s)
    for mode in ("no", "bf16"):
        assert out[mode].logprobs.dtype == torch.float32
        assert out[mode].values.dtype == torch.float32
        assert out[mode].entropy.dtype == torch.float32
    # bfloat16 matmuls move the results, by little: log-probs of a 512-token vocabulary
    # (about -6.2 each) within 0.05, values (of order 0.01) within 2e-3.
    mask = batch[3].bool()
    diff = (out["bf16"].logprobs - out["no"].logprobs)[mask].abs()
    assert 0 < diff.max() < 0.05, diff.max()
    assert (out["bf16"].values - out["no"].values).abs().max() < 2e-3


def test_the_value_head_and_the_chunked_op_ignore_autocast():
    # Both compute in float32 inside an autocast region: the same bits as outside it.
    torch.manual_seed(0)
    head = ValueHead(16)
    hidden = torch.randn(3, 4, 16)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 4))
    outside = head(hidden), ops.chunked_logprobs(hidden, weight, None, targets, chunk_size=5, with_entropy=True)
    (outside[1].logprobs.sum() + outside[1].entropy.sum()).backward()
    grad_outside, weight.grad = weight.grad.clone(), None
    with autocast("bf16", "cpu"):
        inside = head(hidden), ops.chunked_logprobs(hidden, weight, None, targets, chunk_size=5, with_entropy=True)
        (inside[1].logprobs.sum() + inside[1].entropy.sum()).backward()  # backward inside autocast too
    assert inside[0].dtype == torch.float32 and torch.equal(inside[0], outside[0])
    assert torch.equal(inside[1].logprobs, outside[1].logprobs)
    assert torch.equal(inside[1].entropy, outside[1].entropy)
    assert torch.equal(weight.grad, grad_outside)
    # The control: a plain linear layer under autocast does not keep float32.
    with autocast("bf16", "cpu"):
        assert head.summary(hidden).dtype == torch.bfloat16


# --------------------------------------------------------------------------------------
# The first minibatch: ratio exactly 1 when the old log-probs come from the same autocast
# --------------------------------------------------------------------------------------
def test_ratio_is_exactly_one_at_the_first_minibatch_under_bf16(ppo_cfg):
    from rlhflab.data.prompts import load_prompts, step_prompts
    from rlhflab.engine.minibatch import select
    from rlhflab.engine.update import PPOMath, minibatch_loss
    from rlhflab.trainers import ppo
    from rlhflab.trainers.common import Timer
    from rlhflab.trainers.loop import build_run

    # One minibatch holding the whole rollout, as the update's first one sees it.
    cfg = ppo_cfg("training.mixed_precision=bf16", "ppo.mini_batch_size=16", "ppo.kl_coeff=0.1")
    torch.manual_seed(0)
    run = build_run(cfg, ppo.method(cfg))
    assert run.models.actor.mixed_precision == "bf16" and run.models.reference.mixed_precision == "bf16"
    examples = step_prompts(load_prompts(cfg.dataset, run.models.tokenizer, "train"), 16, cfg.training.seed, 1)
    roll = ppo.collect_rollout(run, examples, Timer())
    rows = torch.randperm(len(roll), generator=torch.Generator().manual_seed(3))  # shuffled, as the update does
    mb = select(roll, rows, roll.response_mask)
    actor = run.models.actor
    out = actor(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, with_values=True)
    mask = mb.response_mask.bool()
    assert torch.equal(out.logprobs[mask], mb.old_logprobs[mask])       # ratio = exp(0) = 1 exactly
    assert torch.equal(out.values[mask], mb.old_values[mask])
    loss, st = minibatch_loss(actor, mb, cfg.ppo, 1.0, PPOMath(), float(mask.sum()))
    assert st.approx_kl == 0.0 and st.policy_clip_frac == 0.0 and st.value_clip_frac == 0.0
    assert math.isfinite(float(loss.detach()))
    # The control: old log-probs from float32 passes would not give 1 (why both are autocast).
    actor.mixed_precision = "no"
    fp32 = actor(mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, with_values=False)
    assert (fp32.logprobs - out.logprobs)[mask].abs().max() > 1e-4


# --------------------------------------------------------------------------------------
# One step of every trainer, bf16 against float32
# --------------------------------------------------------------------------------------
@register("test_precision_length_mod3")
def length_mod3(prompt: str, response: str, example: dict) -> float:
    return float(len(response) % 3)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from rlhflab.data import arith, preferences

    out = tmp_path_factory.mktemp("precision-data")
    arith.write_task(out, n_train=64, n_test=16)
    preferences.write_off_by_one_pairs(out)
    preferences.write_arith_pairs(out / "rm", n_train=32, n_test=8, seed=0)
    return out


COMMON = ["training.num_threads=1", "logging.progress_bar=false", "logging.plots=false", "training.device=cpu"]
RL = ["training.total_steps=1", "training.eval_interval=0", "training.save_interval=0",
      "generation.max_new_tokens=6", "reward.sources=[{type: rule, name: test_precision_length_mod3}]",
      "logging.doctor=false", "dataset.num_eval_samples=8"]
POLICY_METHODS = {  # module name, config stem, section overrides
    "ppo": ("ppo", "ppo", ["ppo.rollout_samples=8", "ppo.batch_size=8", "ppo.mini_batch_size=8", "ppo.epochs=1"]),
    "ppo-critic": ("ppo", "ppo", ["ppo.rollout_samples=8", "ppo.batch_size=8", "ppo.mini_batch_size=8",
                                  "ppo.epochs=1", "model.critic=separate"]),
    "grpo": ("grpo", "grpo", ["grpo.group_size=4", "grpo.prompts_per_step=2", "grpo.batch_size=8",
                              "grpo.mini_batch_size=8", "grpo.gradient_accumulation_steps=1"]),
    "rloo": ("rloo", "rloo", ["rloo.k=4", "rloo.prompts_per_step=2", "rloo.mini_batch_size=8"]),
    "reinforce-pp": ("reinforce_pp", "reinforce_pp", ["reinforce_pp.prompts_per_step=8",
                                                      "reinforce_pp.mini_batch_size=8"]),
    "dr-grpo": ("dr_grpo", "dr_grpo", ["dr_grpo.group_size=4", "dr_grpo.prompts_per_step=2",
                                       "dr_grpo.batch_size=8", "dr_grpo.mini_batch_size=8"]),
    "trpo": ("trpo", "trpo", ["trpo.rollout_samples=8", "trpo.batch_size=8", "trpo.value_mini_batch_size=8"]),
}


def _run(trainer: str, model: Path, data: Path, out: Path, mixed_precision: str) -> tuple[dict, Path]:
    """One step of `trainer`; returns its first logged metrics and the folder of its saved model."""
    mp = [f"training.mixed_precision={mixed_precision}", f"training.output_dir={out}", *COMMON]
    if trainer == "sft":
        from rlhflab.trainers.sft import SFTRunConfig, train_sft
        cfg, _ = load_config(ROOT / "configs" / "sft_debug.yaml", SFTRunConfig, [
            f"model.name_or_path={model}", f"data.path={data / 'sft.jsonl'}", f"data.eval_path={data / 'test.jsonl'}",
            "sft.max_steps=1", "sft.batch_size=8", "sft.eval_before=false", "sft.num_eval_generate=0",
            "data.num_eval_samples=8", *mp])
        res = train_sft(cfg, quiet=True)
        return res.history[0], res.final_dir
    if trainer == "rm":
        from rlhflab.trainers.rm import RMRunConfig, train_rm
        cfg, _ = load_config(ROOT / "configs" / "rm_debug.yaml", RMRunConfig, [
            f"model.name_or_path={model}", f"data.path={data / 'rm' / 'train.jsonl'}",
            f"data.eval_path={data / 'rm' / 'test.jsonl'}", "rm.max_steps=1", "rm.batch_size=8",
            "rm.eval_before=false", *mp])
        res = train_rm(cfg, quiet=True)
        return res.history[0], res.final_dir
    if trainer == "dpo":
        from rlhflab.trainers import dpo
        cfg, _ = load_config(ROOT / "configs" / "dpo_debug.yaml", dpo.DPORunConfig, [
            f"model.name_or_path={model}", f"dataset.path={data / 'pairs_train.jsonl'}",
            f"dataset.eval_path={data / 'pairs_test.jsonl'}", "dpo.task_eval_path=null", "dpo.max_steps=1",
            "dpo.batch_size=8", "dpo.mini_batch_size=8", "training.eval_interval=0", "training.save_interval=0",
            "dataset.num_eval_samples=8", *mp])
        res = dpo.train(cfg, quiet=True)
        return res.history[0], res.final_dir
    import importlib
    name, stem, extra = POLICY_METHODS[trainer]
    module = importlib.import_module(f"rlhflab.trainers.{name}")
    schema = next(getattr(module, a) for a in dir(module) if a.endswith("RunConfig"))
    cfg, _ = load_config(ROOT / "configs" / f"{stem}_debug.yaml", schema, [
        f"model.name_or_path={model}", f"dataset.path={data / 'train.jsonl'}",
        f"dataset.eval_path={data / 'test.jsonl'}", *RL, *extra, *mp])
    res = module.train(cfg, quiet=True)
    return res.history[0], res.final_dir


# The metrics that read the forward pass, per trainer, and how far bf16 may move them
# (relative). The sampled responses are the same in both runs (generation is not under
# autocast and the seed is the same), so every difference is the forward passes' rounding.
# Measured (float32 vs bf16): SFT loss 6.29998 vs 6.30006, RM 0.73929 vs 0.73893, DPO
# logps/chosen -83.3956 vs -83.3953, PPO loss/value 0.79528 vs 0.79524 and
# rollout/value_mean -0.04953 both, loss/entropy 6.2232 both (random weights: near ln 512).
CLOSE = {"loss/entropy": 0.01, "loss/value": 0.02, "rollout/value_mean": 0.05, "train/loss": 0.01,
         "logps/chosen": 0.01}
KEYS = {"sft": ["train/loss"], "rm": ["train/loss"], "dpo": ["logps/chosen"],
        "ppo": ["loss/entropy", "loss/value", "rollout/value_mean"],
        "ppo-critic": ["loss/entropy", "loss/value", "rollout/value_mean"],
        "trpo": ["loss/value", "rollout/value_mean"]}


def _update(folder: Path, start: dict) -> torch.Tensor:
    """The step's change of every policy weight, flattened."""
    from safetensors.torch import load_file
    end = load_file(str(folder / "model.safetensors"))
    return torch.cat([(end[k] - start[k]).flatten() for k in sorted(start) if k in end])


@pytest.mark.parametrize("trainer", ["sft", "rm", "dpo", *POLICY_METHODS])
def test_one_bf16_step_of_every_trainer_is_finite_and_close_to_float32(trainer, tiny_model_dir, data_dir, tmp_path):
    from safetensors.torch import load_file

    runs = {mode: _run(trainer, tiny_model_dir, data_dir, tmp_path / mode, mode) for mode in ("no", "bf16")}
    metrics = {mode: r[0] for mode, r in runs.items()}
    assert all(math.isfinite(v) for v in metrics["bf16"].values() if isinstance(v, float)), metrics["bf16"]
    for key in KEYS.get(trainer, ["loss/entropy"]):
        a, b = metrics["no"][key], metrics["bf16"][key]
        assert abs(a - b) <= CLOSE[key] * max(abs(a), 1e-2) + 1e-4, (key, a, b)
    # The update itself: bf16 changed it (autocast was on in the backward pass too), and
    # it points the same way. Measured cosines 0.990 (RM) to 0.9975, TRPO 1.0000 (a
    # natural-gradient step scaled to max_kl); Adam's first step is lr·sign(g) per weight,
    # so a cosine of c means about (1 + c) / 2 of the weights moved the same way.
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    d32, d16 = _update(runs["no"][1], start), _update(runs["bf16"][1], start)
    assert d32.abs().max() > 0 and not torch.equal(d32, d16)
    assert float(torch.nn.functional.cosine_similarity(d32, d16, dim=0)) > 0.97


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------
def test_fp16_is_refused_with_the_key_and_the_fix(ppo_cfg):
    with pytest.raises(UserError, match=r"^training.mixed_precision: fp16 needs a loss scaler.*use "
                                        r"training.mixed_precision=bf16"):
        check_mixed_precision("fp16", "cpu")
    from rlhflab.trainers import ppo
    with pytest.raises(UserError, match="training.mixed_precision: fp16"):
        ppo.train(ppo_cfg("training.mixed_precision=fp16", "training.total_steps=1"), quiet=True)


def test_bf16_on_a_gpu_without_it_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(UserError) as err:
        check_mixed_precision("bf16", torch.device("cuda"))
    assert str(err.value) == ("training.mixed_precision: bf16 is not supported by this GPU; "
                              "use training.mixed_precision=no")


def test_yaml_no_means_no_autocast_and_bad_values_name_the_choices(ppo_cfg, tmp_path):
    from rlhflab.config.loader import ConfigError
    from rlhflab.trainers.ppo import PPORunConfig

    assert ppo_cfg().training.mixed_precision == "no"
    (tmp_path / "c.yaml").write_text("defaults: [" + str(ROOT / "configs" / "ppo_debug.yaml") + "]\n"
                                     "training:\n  mixed_precision: no\n")       # YAML 1.1 reads false
    assert load_config(tmp_path / "c.yaml", PPORunConfig)[0].training.mixed_precision == "no"
    with pytest.raises(ConfigError, match="training.mixed_precision: expected one of 'no', 'bf16', 'fp16', False, "
                                          "got 'bf17'; did you mean 'bf16'"):
        load_config(None, PPORunConfig, ["training.mixed_precision=bf17"])
    check_mixed_precision("no", "cpu")
    check_mixed_precision("bf16", "cpu")  # this CPU runs it


def test_reference_under_bf16_matches_the_policy_before_training(tiny_model_dir):
    # The frozen copy and the policy compute the same log-probs under the same autocast,
    # so the KL to the reference starts at exactly 0.
    policy, tok = load_model(str(tiny_model_dir))
    actor = ActorCritic(policy, value_head=ValueHead(hidden_size_of(policy)))
    actor.mixed_precision = "bf16"
    ref = Reference.frozen_copy(policy)
    ref.mixed_precision = "bf16"
    batch = _batch(tok)
    with torch.no_grad():
        lp = actor(*batch, with_values=False).logprobs
    assert torch.equal(ref.logprobs(*batch), lp)
