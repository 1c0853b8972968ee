"""Checkpoints: atomic writes, what a folder holds, separate-critic and LoRA reloads, and a
resumed run that continues from step_N/ as if it had never stopped."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhflab.errors import UserError
from rlhflab.metrics import MetricsLogger, read_metrics
from rlhflab.models import checkpoint
from rlhflab.models.checkpoint import load_trainer_state, prune_checkpoints, save_checkpoint
from rlhflab.trainers import ppo
from rlhflab.trainers.common import make_optimizer

from crash_helpers import stop_after_logging


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _batch(models):
    tok = models.tokenizer
    enc = tok(["Question: 1 + 2?\nAnswer:", "Question: Ada has 4 pens and gets 3 more?\nAnswer:"],
              return_tensors="pt", padding=True, add_special_tokens=False)
    resp = tok([" 3\n#### 3"] * 2, return_tensors="pt", add_special_tokens=False).input_ids
    ids = torch.cat([enc.input_ids, resp], 1)
    am = torch.cat([enc.attention_mask, torch.ones_like(resp)], 1)
    return ids, am, enc.input_ids.shape[1]


def test_checkpoint_contents_and_overwrite(ppo_cfg, tmp_path):
    models = ppo.build_models(ppo_cfg())
    ac = models.actor
    opt = make_optimizer(ac.trainable_parameters(), 1e-3)
    ac.forward_response(*_batch(models)).values.sum().backward()
    opt.step()
    folder = save_checkpoint(tmp_path / "step_3", ac, models.tokenizer, optimizer=opt, step=3, extra={"note": "x"},
                             method="ppo")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "value_head.safetensors",
            "trainer_state.pt", "rlhflab.json"} <= names
    state = load_trainer_state(folder)
    assert state["step"] == 3 and state["extra"] == {"note": "x"} and set(state["rng"]) >= {"python", "numpy", "torch"}
    saved = state["optimizer"]["state"]
    live = opt.state_dict()["state"]
    assert saved.keys() == live.keys()
    for k in live:
        assert torch.equal(saved[k]["exp_avg"], live[k]["exp_avg"])
    # The layout a resume must match is recorded in both places (check_resume reads it).
    layout = {"method": "ppo", "lora": False, "critic": "value_head", "world_size": 1, "fsdp": False, "deepspeed": False}
    assert state["layout"] == layout
    assert json.loads((folder / "rlhflab.json").read_text()) == {"step": 3, **layout, "note": "x"}
    # Saving again over it replaces it and leaves no .tmp/.old sibling.
    save_checkpoint(tmp_path / "step_3", ac, models.tokenizer, step=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
    assert json.loads((tmp_path / "step_3" / "rlhflab.json").read_text())["step"] == 4
    assert not (tmp_path / "step_3" / "trainer_state.pt").exists()  # no optimizer given this time


@pytest.mark.parametrize("existed", [False, True])
def test_failed_save_leaves_no_broken_folder(ppo_cfg, tmp_path, monkeypatch, existed):
    models = ppo.build_models(ppo_cfg())
    target = tmp_path / "step_2"
    if existed:
        save_checkpoint(target, models.actor, models.tokenizer, step=2)
        before = _tree(target)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_value_head", crash)  # after the policy was written
    with pytest.raises(UserError, match=f"cannot save the checkpoint {target}: disk full"):  # any OSError: one line
        save_checkpoint(target, models.actor, models.tokenizer, step=4)
    if existed:
        assert _tree(target) == before  # the old checkpoint is intact
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]
    else:
        assert list(tmp_path.iterdir()) == []  # no half-written folder, not even a .tmp one


def test_prune_checkpoints(tmp_path):
    for n in (2, 4, 10, 6):
        (tmp_path / f"step_{n}").mkdir()
    (tmp_path / "final").mkdir()
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step_10", "step_6"]
    prune_checkpoints(tmp_path, keep=None)
    assert len(list(tmp_path.iterdir())) == 3


def test_separate_critic_checkpoint_reloads(ppo_cfg, tmp_path):
    cfg = ppo_cfg("model.critic=separate")
    models = ppo.build_models(cfg)
    critic = models.actor.critic
    with torch.no_grad():  # make the critic differ from a fresh one
        for p in critic.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_checkpoint(tmp_path / "step_1", models.actor, models.tokenizer,
                    optimizer=make_optimizer(models.actor.trainable_parameters(), 1e-3), step=1)
    assert (tmp_path / "step_1" / "critic" / "value_head.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(tmp_path / "step_1" / "critic")  # a plain HF folder
    resumed = ppo.build_models(cfg, tmp_path / "step_1")
    ids, am, p = _batch(models)
    with torch.no_grad():
        want = models.actor.forward_response(ids, am, p)
        got = resumed.actor.forward_response(ids, am, p)
    assert torch.equal(got.values, want.values) and torch.equal(got.logits, want.logits)


def test_lora_checkpoint_reloads(ppo_cfg, tmp_path):
    cfg = ppo_cfg("lora.enabled=true", "lora.r=4", "model.reference=lora_disabled")
    models = ppo.build_models(cfg)
    with torch.no_grad():
        for n, p in models.actor.policy.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    save_checkpoint(tmp_path / "step_1", models.actor, models.tokenizer,
                    optimizer=make_optimizer(models.actor.trainable_parameters(), 1e-3), step=1)
    assert (tmp_path / "step_1" / "adapter" / "adapter_config.json").exists()
    ids, am, p = _batch(models)
    with torch.no_grad():
        want = models.actor.forward_response(ids, am, p)
    # The merged folder is a plain model with the adapter folded in.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "step_1")
    from rlhflab.models.actor_critic import position_ids_from
    t = ids.shape[1] - p
    full = merged(input_ids=ids, attention_mask=am, position_ids=position_ids_from(am)).logits
    torch.testing.assert_close(full[:, p - 1 : p + t - 1], want.logits, rtol=0, atol=1e-4)
    # A resume loads the adapter onto the base and keeps it trainable.
    resumed = ppo.build_models(cfg, tmp_path / "step_1")
    with torch.no_grad():
        got = resumed.actor.forward_response(ids, am, p)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-6)
    assert torch.equal(got.values, want.values)
    assert any(p.requires_grad for n, p in resumed.actor.policy.named_parameters() if "lora_" in n)


def test_metrics_logger_resume_drops_rows_after_the_checkpoint(tmp_path):
    log = MetricsLogger(tmp_path)
    for step in range(1, 4):
        log.log(step, {"x": float(step)})
    log.close()
    # A resume from step_2/: the row of step 3 (logged before the crash) is redone.
    log = MetricsLogger(tmp_path, resume=True, resume_step=2)
    log.log(3, {"x": 30.0})
    log.close()
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    # Without resume the file starts over.
    MetricsLogger(tmp_path).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == []


# --------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_continues_like_the_uninterrupted_run(ppo_cfg, tmp_path, monkeypatch):
    settings = ("training.total_steps=4", "training.save_interval=2", "ppo.rollout_samples=8",
                "ppo.batch_size=8", "ppo.mini_batch_size=4", "ppo.epochs=1")
    # A: four steps without a stop.
    ppo.train(ppo_cfg(*settings, out_dir=tmp_path / "a"), quiet=True)

    # B: the same run, killed after step 3 was logged (before step_4 could be saved).
    cfg_b = ppo_cfg(*settings, out_dir=tmp_path / "b")
    stop_after_logging(monkeypatch, 3, lambda: ppo.train(cfg_b, quiet=True))
    b = tmp_path / "b"
    assert (b / "step_2").is_dir() and not (b / "final").exists()
    assert [r["step"] for r in read_metrics(b / "metrics.jsonl")] == [1, 2, 3]
    saved = load_trainer_state(b / "step_2")
    assert saved["step"] == 2

    # Resume B from step_2/, capturing the optimizer as the first update finds it.
    seen = []
    real_update = ppo.run_update

    def spy_update(run, roll, step):
        seen.append((step, copy.deepcopy(run.optimizer.state_dict()), run.scheduler.last_epoch))
        return real_update(run, roll, step)

    monkeypatch.setattr(ppo, "run_update", spy_update)
    res = ppo.train(cfg_b, resume=b / "step_2", quiet=True)
    assert [s for s, _, _ in seen] == [3, 4]
    opt_state = seen[0][1]["state"]
    assert opt_state.keys() == saved["optimizer"]["state"].keys() and opt_state
    for k, st in opt_state.items():
        assert torch.equal(st["exp_avg"], saved["optimizer"]["state"][k]["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], saved["optimizer"]["state"][k]["exp_avg_sq"])
        assert float(st["step"]) == float(saved["optimizer"]["state"][k]["step"]) == 2 * 2  # 2 steps x 2 minibatches
    assert seen[0][2] == saved["scheduler"]["last_epoch"] == 4

    # The step count, the metrics file and the final weights continue the first run.
    assert [h["step"] for h in res.history] == [3, 4]
    assert load_trainer_state(b / "final")["step"] == 4
    assert json.loads((b / "final" / "rlhflab.json").read_text())["step"] == 4
    rows_a = read_metrics(tmp_path / "a" / "metrics.jsonl")
    rows_b = read_metrics(b / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    # Seeded prompts, data order and restored RNG states: the same episodes and rewards.
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for key in ("rollout/reward_mean", "rollout/response_length", "loss/policy", "loss/value"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (ra["step"], key)
    final_a = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final").state_dict()
    final_b = AutoModelForCausalLM.from_pretrained(b / "final").state_dict()
    for k in final_a:
        assert torch.equal(final_a[k], final_b[k]), k
    from safetensors.torch import load_file
    head_a = load_file(tmp_path / "a" / "final" / "value_head.safetensors")
    head_b = load_file(b / "final" / "value_head.safetensors")
    assert all(torch.equal(head_a[k], head_b[k]) for k in head_a)


def test_save_only_model_writes_the_same_weights_without_the_trainer_state(ppo_cfg, tmp_path):
    """training.save_only_model (TRL's save_only_model): the same run saved both ways gives
    byte-identical weights (policy and value head) in step_N/ and final/, and the model-only
    folders hold no trainer_state.pt; --resume from one is refused with the fix."""
    settings = ("training.total_steps=2", "training.save_interval=1", "ppo.rollout_samples=8",
                "ppo.batch_size=8", "ppo.mini_batch_size=4", "ppo.epochs=1")
    full, only = tmp_path / "full", tmp_path / "only"
    ppo.train(ppo_cfg(*settings, out_dir=full), quiet=True)
    cfg = ppo_cfg(*settings, "training.save_only_model=true", out_dir=only)
    ppo.train(cfg, quiet=True)
    for name in ("step_1", "final"):  # the last step is saved as final/ only
        kept, whole = _tree(only / name), _tree(full / name)
        assert "trainer_state.pt" in whole and "trainer_state.pt" not in kept, name
        assert {"model.safetensors", "value_head.safetensors", "config.json", "rlhflab.json"} <= set(kept), name
        for f in ("model.safetensors", "value_head.safetensors"):
            assert kept[f] == whole[f], (name, f)
    AutoModelForCausalLM.from_pretrained(only / "final")  # a plain Hugging Face folder
    with pytest.raises(UserError, match=r"saved with training.save_only_model=true .* cannot be resumed; start a "
                                        r"new run from its weights with model.name_or_path=.*step_1"):
        ppo.train(cfg, resume=only / "step_1", quiet=True)
