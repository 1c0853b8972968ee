"""Every trainer runs one step on every architecture `make-tiny` builds (llama, qwen2,
mistral, gemma) and on OPT with word_embed_proj_dim != hidden_size (OPT-350m's layout: the
decoder's output is projected to 8 of its 16 features, so a value head sized from
hidden_size would not fit), through its public `train(cfg)` API: the losses are finite and
the saved weights differ from the starting ones. PPO on a Cohere model (logit_scale) takes
its old policy from the sampler and checks that the first update's log-probs equal it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhflab.config import load_config
from rlhflab.models.tiny import ARCHS, make_tiny_model
from rlhflab.rewards import register

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ("sft", "rm", "dpo", "ppo", "grpo", "rloo", "trpo")
MODELS = (*ARCHS, "opt")


@register("test_arch_length_mod3")
def length_mod3(prompt: str, response: str, example: dict) -> float:
    """A reward that differs between samples, so every policy-gradient method has a signal."""
    return float(len(response) % 3)


def save_tiny(folder: Path, config_of, seed: int = 0, scale_head: float = 1.0) -> Path:
    """A random model of `config_of(tokenizer)` beside make-tiny's tokenizer, saved as a folder
    that `model.name_or_path` loads; `scale_head` multiplies the LM head's weight (so a
    logit transform changes the sampled distribution noticeably)."""
    from transformers import AutoModelForCausalLM

    from rlhflab.models.tiny import build_tokenizer

    tok = build_tokenizer(512, seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_of(tok))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale_head)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.generation_config, key, getattr(tok, key))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def opt_config(tok):
    from transformers import OPTConfig

    return OPTConfig(vocab_size=512, hidden_size=16, word_embed_proj_dim=8, ffn_dim=32, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=256, do_layer_norm_before=False,
                     pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("arch-models")
    models = {a: make_tiny_model(base / a, hidden_size=32, num_layers=2, num_heads=4, arch=a) for a in ARCHS}
    models["opt"] = save_tiny(base / "opt", opt_config)  # OPT-350m's layout: project_in/out, post-norm
    return models


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from rlhflab.data import arith, preferences

    out = tmp_path_factory.mktemp("arch-data")
    arith.write_task(out, n_train=64, n_test=16)
    preferences.write_off_by_one_pairs(out)                                     # pairs_train.jsonl, pairs_test.jsonl
    preferences.write_arith_pairs(out / "rm", n_train=32, n_test=8, seed=0)
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


COMMON = ["training.num_threads=1", "logging.progress_bar=false", "logging.plots=false", "training.device=cpu"]
RL = ["training.total_steps=1", "training.eval_interval=0", "training.save_interval=0",
      "generation.max_new_tokens=6", "reward.sources=[{type: rule, name: test_arch_length_mod3}]",
      "logging.doctor=false"]


def _run(trainer: str, model: Path, data: Path, out: Path, *extra_overrides: str):
    """Run `trainer` for one step; returns (history, folder of the saved model, loss key)."""
    if trainer == "sft":
        from rlhflab.trainers.sft import SFTRunConfig, train_sft
        cfg, _ = load_config(ROOT / "configs" / "sft_debug.yaml", SFTRunConfig, [
            f"model.name_or_path={model}", f"data.path={data / 'sft.jsonl'}", f"data.eval_path={data / 'test.jsonl'}",
            f"training.output_dir={out}", "sft.max_steps=1", "sft.batch_size=8", "sft.eval_before=false",
            "sft.num_eval_generate=0", "data.num_eval_samples=8", *COMMON, *extra_overrides])
        res = train_sft(cfg, quiet=True)
        return res.history, res.final_dir, "train/loss"
    if trainer == "rm":
        from rlhflab.trainers.rm import RMRunConfig, train_rm
        cfg, _ = load_config(ROOT / "configs" / "rm_debug.yaml", RMRunConfig, [
            f"model.name_or_path={model}", f"data.path={data / 'rm' / 'train.jsonl'}",
            f"data.eval_path={data / 'rm' / 'test.jsonl'}", f"training.output_dir={out}", "rm.max_steps=1",
            "rm.batch_size=8", "rm.eval_before=false", "rm.learning_rate=1e-3", *COMMON, *extra_overrides])
        res = train_rm(cfg, quiet=True)
        return res.history, res.final_dir, "train/loss"
    if trainer == "dpo":
        from rlhflab.trainers import dpo
        cfg, _ = load_config(ROOT / "configs" / "dpo_debug.yaml", dpo.DPORunConfig, [
            f"model.name_or_path={model}", f"dataset.path={data / 'pairs_train.jsonl'}",
            f"dataset.eval_path={data / 'pairs_test.jsonl'}", "dpo.task_eval_path=null", f"training.output_dir={out}",
            "dpo.max_steps=1", "dpo.batch_size=8", "dpo.mini_batch_size=8", "dpo.learning_rate=1e-3",
            "training.eval_interval=0", "training.save_interval=0", "dataset.num_eval_samples=8", *COMMON, *extra_overrides])
        res = dpo.train(cfg, quiet=True)
        return res.history, res.final_dir, "loss"
    from rlhflab.trainers import grpo, ppo, rloo, trpo
    module, schema, extra = {
        "ppo": (ppo, ppo.PPORunConfig, ["ppo.rollout_samples=8", "ppo.batch_size=8", "ppo.mini_batch_size=8",
                                        "ppo.epochs=1", "ppo.learning_rate=1e-3"]),
        "grpo": (grpo, grpo.GRPORunConfig, ["grpo.group_size=4", "grpo.prompts_per_step=2", "grpo.batch_size=8",
                                            "grpo.mini_batch_size=8", "grpo.gradient_accumulation_steps=1",
                                            "grpo.learning_rate=1e-3"]),
        "rloo": (rloo, rloo.RLOORunConfig, ["rloo.k=4", "rloo.prompts_per_step=2", "rloo.mini_batch_size=8",
                                            "rloo.learning_rate=1e-3"]),
        "trpo": (trpo, trpo.TRPORunConfig, ["trpo.rollout_samples=8", "trpo.batch_size=8", "trpo.value_epochs=1",
                                            "trpo.value_mini_batch_size=8"]),
    }[trainer]
    cfg, _ = load_config(ROOT / "configs" / f"{trainer}_debug.yaml", schema, [
        f"model.name_or_path={model}", f"dataset.path={data / 'train.jsonl'}", f"dataset.eval_path={data / 'test.jsonl'}",
        f"training.output_dir={out}", "dataset.num_eval_samples=8", *RL, *extra, *COMMON, *extra_overrides])
    res = module.train(cfg, quiet=True)
    return res.history, res.final_dir, "loss/value" if trainer == "trpo" else "loss/total"


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("arch", MODELS)
def test_one_step_of_every_trainer_on_every_architecture(arch, trainer, arch_models, data_dir, tmp_path):
    history, final_dir, loss_key = _run(trainer, arch_models[arch], data_dir, tmp_path / "run")
    losses = [h[loss_key] for h in history if loss_key in h]
    assert losses and all(math.isfinite(v) for v in losses), history
    assert all(math.isfinite(v) for h in history for v in h.values() if isinstance(v, float))
    start, end = _weights(arch_models[arch]), _weights(final_dir)
    shared = [k for k in start if k in end and start[k].shape == end[k].shape]
    assert len(shared) >= len(start) // 2  # the RM folder holds the same decoder under the same names
    changed = [k for k in shared if not torch.equal(start[k], end[k])]
    assert changed, f"{trainer} on {arch}: no weight changed"
    assert all(torch.isfinite(end[k]).all() for k in end)


@pytest.mark.parametrize("trainer", ["sft", "rm", "dpo"])
def test_bfloat16_weights_train_on_cpu_with_losses_close_to_float32(trainer, arch_models, data_dir, tmp_path):
    # The first logged value is of the batch before the update, so it compares the two
    # dtypes' forward passes on the same rows: the loss (SFT, RM), or for DPO the policy's
    # log-prob of the chosen responses (its loss is ln 2 in both while policy = reference).
    # Measured (float32 vs bfloat16): SFT loss 6.242024 vs 6.242038, RM loss 0.706713 vs
    # 0.706985, DPO log-prob -82.6909 vs -82.6915; each run takes one step.
    results = {}
    for dtype in ("float32", "bfloat16"):
        history, final_dir, key = _run(trainer, arch_models["qwen2"], data_dir, tmp_path / dtype,
                                       f"model.torch_dtype={dtype}")
        key = "logps/chosen" if trainer == "dpo" else key
        results[dtype] = (history[0][key], _weights(final_dir))
    (loss32, w32), (loss16, w16) = results["float32"], results["bfloat16"]
    assert math.isfinite(loss16) and math.isfinite(loss32)
    assert abs(loss16 - loss32) <= 0.02 * abs(loss32) + 1e-3, (loss16, loss32)
    assert {w.dtype for w in w16.values()} == {torch.bfloat16}  # saved as it trained
    start = _weights(arch_models["qwen2"])
    assert any(not torch.equal(start[k].to(torch.bfloat16), w16[k]) for k in start if k in w16)


def test_opt_with_a_separate_critic(arch_models, data_dir, tmp_path):
    # The separate critic's value head is sized from its own decoder's output (8 wide), too.
    history, _, loss_key = _run("ppo", arch_models["opt"], data_dir, tmp_path / "run", "model.critic=separate")
    assert all(math.isfinite(h[loss_key]) for h in history if loss_key in h) and history


def cohere_config(tok):
    from transformers import CohereConfig

    return CohereConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, logit_scale=0.0625,
                        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def test_ppo_on_a_scaled_head_trains_on_the_sampler_logprobs(data_dir, tmp_path):
    # Cohere multiplies its logits by logit_scale (here 1/16, the head's weight x 20 so the
    # scale moves the distribution). With the old policy taken from generate's own draw
    # (generation.old_logprobs: sampler), the first update's log-probs must equal the
    # sampler's: rollout/logprob_gap is mean |log pi - log pi_sample| before any optimizer
    # step. Both are float32 passes of different shapes over the same weights, so they agree
    # to float rounding (measured 1.4e-7), not exactly; on the raw head it was 2.02 nats a token.
    model = save_tiny(tmp_path / "cohere", cohere_config, scale_head=20.0)
    history, _, _ = _run("ppo", model, data_dir, tmp_path / "run", "generation.old_logprobs=sampler")
    gap = history[0]["rollout/logprob_gap"]
    assert 0.0 <= gap < 1e-5, gap
