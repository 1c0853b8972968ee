"""Helpers shared by the GRPO, RLOO and DPO tests (this module holds no tests).

- `small_model`: a very small Llama (64 hidden, 2 layers) and its tokenizer, built once
  per pytest session (`_once`: once for all of pytest-xdist's workers too).
- `easy_task`: the arithmetic task restricted to sums of 0-4 (25 facts), so that a
  supervised warm start learns the format and most facts in seconds on a CPU. The
  demonstrations are the sloppy ones of `rlhflab.data.arith` (60 % off by one).
- `warm_model`: the small model after a short supervised loop on those demonstrations
  (written here, so the tests depend on no other trainer).
- `debug_config`: a trainer's debug YAML pointed at the small model and task.
- `keep_rollouts`: the rollouts a trainer's step hands its update, kept for the test.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
from pathlib import Path

import torch

from rlhflab.config import load_config
from rlhflab.data import arith

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "Question: {prompt}\nAnswer:"


def _once(tmp_path_factory, name: str, build) -> Path:
    """A folder under the session's base temp dir, built the first time it is asked for.
    Under pytest-xdist the folder is in the root that every worker's base temp dir sits in,
    and a lock file orders the workers: the first to ask builds it, the others wait for it
    and read it (a fixture asked for in both workers' files is built once, not twice)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (path / ".done").exists():
            if path.exists():  # a build that stopped halfway
                shutil.rmtree(path)
            path.mkdir(parents=True)
            build(path)
            (path / ".done").write_text("ok")
    return path


def small_model(tmp_path_factory) -> Path:
    from rlhflab.models.tiny import make_tiny_model

    return _once(tmp_path_factory, "small-model",
                 lambda p: make_tiny_model(p, hidden_size=64, num_layers=2, num_heads=4, vocab_size=512))


def write_easy_task(out: Path, max_operand: int = 4, n_train: int = 400, n_test: int = 100,
                    wrong_rate: float = 0.6, seed: int = 0) -> None:
    def keep(r: dict) -> bool:
        return r["op"] == "+" and r["a"] <= max_operand and r["b"] <= max_operand

    test = [r for r in arith.make_split(3000, seed + 1) if keep(r)][:n_test]
    train = [r for r in arith.make_split(20000, seed, exclude={r["question"] for r in test}) if keep(r)][:n_train]
    arith.write_jsonl(train, out / "train.jsonl")
    arith.write_jsonl(test, out / "test.jsonl")
    arith.write_jsonl(arith.noisy_demonstrations(train, wrong_rate, seed + 2), out / "sft.jsonl")


def easy_task(tmp_path_factory) -> Path:
    return _once(tmp_path_factory, "easy-task", write_easy_task)


def supervised_warm_start(model_dir: Path, sft_path: Path, out_dir: Path, steps: int = 150,
                          batch_size: int = 32, lr: float = 3e-3, seed: int = 0) -> None:
    """Teacher-forced NLL on the response tokens of "Question: q\\nAnswer: completion<eos>"."""
    from rlhflab.data.loading import read_rows
    from rlhflab.models.load import disable_dropout, load_model
    from rlhflab.trainers.dpo import collate_responses, sequence_logprobs
    from rlhflab.models.actor_critic import PolicyOnly

    torch.manual_seed(seed)
    model, tok = load_model(str(model_dir))
    disable_dropout(model)
    actor = PolicyOnly(model).train()
    data = [(tok(TEMPLATE.format(prompt=r["prompt"]), add_special_tokens=False)["input_ids"],
             tok(" " + r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            for r in read_rows(str(sft_path))]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.sample(data, batch_size)
        rb = collate_responses([p for p, _ in batch], [r for _, r in batch], tok.pad_token_id)
        out = actor.forward_response(rb.input_ids, rb.attention_mask, rb.prompt_len)
        loss = -sequence_logprobs(out.logits, rb).sum() / rb.response_mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def warm_model(tmp_path_factory) -> Path:
    model, task = small_model(tmp_path_factory), easy_task(tmp_path_factory)
    return _once(tmp_path_factory, "warm-model",
                 lambda p: supervised_warm_start(model, task / "sft.jsonl", p))


def debug_config(schema, name: str, model: Path, task: Path, out: Path, *overrides: str):
    """`configs/<name>` pointed at `model` and `task`, quiet, writing to `out`."""
    cfg, _ = load_config(ROOT / "configs" / name, schema, [
        f"model.name_or_path={model}", f"training.output_dir={out}", "training.num_threads=1",
        "logging.progress_bar=false", "logging.plots=false", "logging.doctor=false",
        *([f"dataset.path={task / 'train.jsonl'}", f"dataset.eval_path={task / 'test.jsonl'}"]
          if "dpo" not in name else []),
        *overrides])
    return cfg


def keep_rollouts(monkeypatch, trainer, edit=None) -> list:
    """The rollouts `trainer.run_update` (grpo's, rloo's...) is handed from now on, in
    order; each first goes through `edit(roll)` when given (what the update then sees)."""
    seen = []
    real_update = trainer.run_update

    def keep(run, roll, step):
        if edit is not None:
            edit(roll)
        seen.append(roll)
        return real_update(run, roll, step)

    monkeypatch.setattr(trainer, "run_update", keep)
    return seen
