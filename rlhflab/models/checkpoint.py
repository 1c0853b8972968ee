"""Checkpoints: a Hugging Face folder anyone can load, plus what a resume needs.

A checkpoint folder (``step_N/`` or ``final/``) holds:
- the policy in Hugging Face format (``config.json``, ``model.safetensors``), loadable
  with ``AutoModelForCausalLM.from_pretrained`` and no rlhflab code; under LoRA the
  adapter is merged into a copy for this, and the adapter itself goes to ``adapter/``;
- the tokenizer;
- ``value_head.safetensors`` (shared-base layout) or ``critic/`` (separate critic), so a
  resumed run does not start with a fresh critic; neither for a critic-free trainer
  (GRPO, RLOO, DPO: a `PolicyOnly` with no critic and no value head);
- ``trainer_state.pt`` when resumable: optimizer, scheduler, RNG states and step.

It is written to a temporary sibling folder and renamed into place, so a crash mid-save
never leaves a half-written ``step_N/``.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhflab.models.actor_critic import save_value_head, unwrap

STATE_FILE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_policy(policy: torch.nn.Module, tokenizer, folder: Path) -> None:
    """The policy as a plain HF folder; a LoRA adapter is saved beside it and merged in."""
    if hasattr(policy, "peft_config"):
        policy.save_pretrained(folder / "adapter")
        import copy
        merged = copy.deepcopy(policy).merge_and_unload()
        merged.save_pretrained(folder)
    else:
        unwrap(policy).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def save_checkpoint(folder: str | Path, actor_critic, tokenizer, *, optimizer=None,
                    scheduler=None, step: int | None = None, extra: dict | None = None,
                    rank_rng: list | None = None) -> Path:
    """Write a checkpoint atomically (temporary folder, then rename).

    `actor_critic` needs `.policy`, `.critic` and `.value_head`; with both of the last two
    None (a `PolicyOnly`) only the policy and the trainer state are written.
    """
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _write_checkpoint(tmp, actor_critic, tokenizer, optimizer, scheduler, step, extra, rank_rng)
    except BaseException:  # a failed save (disk full, Ctrl-C) leaves no half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        if old.exists():
            shutil.rmtree(old)
        folder.rename(old)
    tmp.rename(folder)
    if old.exists():
        shutil.rmtree(old)
    return folder


def _write_checkpoint(tmp: Path, actor_critic, tokenizer, optimizer, scheduler, step, extra, rank_rng=None) -> None:
    save_policy(actor_critic.policy, tokenizer, tmp)
    if actor_critic.critic is not None:
        critic_dir = tmp / "critic"
        critic_dir.mkdir()
        unwrap(actor_critic.critic.base).save_pretrained(critic_dir)
        if tokenizer is not None:  # critic/ loads on its own (load_model wants a tokenizer)
            tokenizer.save_pretrained(critic_dir)
        save_value_head(actor_critic.critic.value_head, critic_dir)
    elif actor_critic.value_head is not None:
        save_value_head(actor_critic.value_head, tmp)
    if optimizer is not None:
        state = {"step": step, "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "rng": rng_state(), "extra": extra or {}}
        if rank_rng is not None:  # several processes: every rank's random state, in rank order
            state["rank_rng"] = rank_rng
        torch.save(state, tmp / STATE_FILE)
    (tmp / "rlhflab.json").write_text(json.dumps({"step": step, **(extra or {})}, indent=2))


def load_trainer_state(folder: str | Path) -> dict[str, Any]:
    return torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=False)


def restore_trainer_state(folder: str | Path, optimizer, scheduler, rank: int = 0) -> int:
    """Load a checkpoint's optimizer, scheduler and RNG states in place; returns its step.
    Under several processes rank r takes its own saved random state."""
    state = load_trainer_state(folder)
    optimizer.load_state_dict(state["optimizer"])
    if state.get("scheduler"):
        scheduler.load_state_dict(state["scheduler"])
    ranks = state.get("rank_rng")
    set_rng_state(ranks[rank] if ranks and rank < len(ranks) else state["rng"])
    return int(state["step"])


def prune_checkpoints(run_dir: str | Path, keep: int | None) -> None:
    """Keep only the newest `keep` step_N/ folders."""
    if not keep:
        return
    steps = sorted((p for p in Path(run_dir).glob("step_*") if p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]))
    for p in steps[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
