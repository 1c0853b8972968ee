"""Checkpoints: a Hugging Face folder anyone can load, plus what a resume needs.

A checkpoint folder (``step_N/`` or ``final/``) holds:
- the policy in Hugging Face format (``config.json``, ``model.safetensors``), loadable
  with ``AutoModelForCausalLM.from_pretrained`` and no rlhflab code; under LoRA the
  adapter is merged into a copy for this, and the adapter itself goes to ``adapter/``;
- the tokenizer;
- ``value_head.safetensors`` (shared-base layout) or ``critic/`` (separate critic), so a
  resumed run does not start with a fresh critic; neither for a critic-free trainer
  (GRPO, RLOO, DPO: a `PolicyOnly` with no critic and no value head);
- ``trainer_state.pt`` when resumable: optimizer, scheduler, RNG states and step;
- ``rlhflab.json``: the step and the layout a resume must match (method, LoRA, critic
  layout, world size), also kept in the trainer state under ``layout``.

It is written to a temporary sibling folder and renamed into place, so a crash mid-save
never leaves a half-written ``step_N/`` (a leftover ``step_N.tmp/`` is debris, never a
checkpoint, and ``--resume`` refuses it). A write that fails for a reason of the machine
(a full disk, a file-size limit, a read-only folder, an I/O error) is one line naming the
folder and the cause, whether Python (OSError), safetensors (``SafetensorError ... (os
error 27)``) or torch.save (``RuntimeError: ... unexpected pos``) met it (`save_failure`).

`check_resume` reads a checkpoint before a resumed run touches anything: the trainer
state loads, the files the config needs are there, and the recorded layout matches the
config. A checkpoint saved before the layout was recorded is checked on its files
(``adapter/``, ``value_head.safetensors``, ``critic/``).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from rlhflab.errors import UserError
from rlhflab.models.actor_critic import save_value_head, unwrap

STATE_FILE = "trainer_state.pt"
META_FILE = "rlhflab.json"
VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_LAYOUTS = ("value_head", "separate", "none")  # "none": a critic-free trainer (GRPO, RLOO, DPO)


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


def save_policy(policy: torch.nn.Module, tokenizer, folder: Path, state: dict | None = None) -> None:
    """The policy as a plain HF folder; a LoRA adapter is saved beside it and merged in.
    `state`: the policy's full state dict when the module itself holds shards (FSDP)."""
    if state is not None and hasattr(policy, "peft_config"):
        policy.save_pretrained(folder / "adapter", state_dict=state)  # peft keeps the adapter's entries
        base = unwrap(policy)
        base.save_pretrained(folder, state_dict=untied(base, merged_lora_state(policy, state)))
    elif state is not None:
        unwrap(policy).save_pretrained(folder, state_dict=untied(unwrap(policy), state))
    elif hasattr(policy, "peft_config"):
        policy.save_pretrained(folder / "adapter")
        import copy
        merged = copy.deepcopy(policy).merge_and_unload()
        merged.save_pretrained(folder)
    else:
        unwrap(policy).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def checkpoint_steps(run_dir: str | Path) -> list[Path]:
    """The run's ``step_N/`` checkpoint folders, oldest first; ``step_N.tmp/`` debris and
    any other name are not checkpoints."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    steps = [p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest resumable ``step_N/`` (one holding trainer_state.pt), or None."""
    resumable = [p for p in checkpoint_steps(run_dir) if (p / STATE_FILE).is_file()]
    return resumable[-1] if resumable else None


def save_debris(run_dir: str | Path) -> list[Path]:
    """``step_N.tmp/`` and ``final.tmp/`` folders: saves that a crash cut short."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.endswith(".tmp")
                  and (p.name[:-4] == "final" or (p.name.startswith("step_") and p.name[5:-4].isdigit())))


def usual_modes(folder: str | Path) -> None:
    """Give the files under `folder` the mode every other file gets (0644 under umask 022).

    safetensors 0.8 writes each file to a private temporary (created 0600, as temporary
    files are) and renames it into place, so every model.safetensors that `save_pretrained`
    or `save_file` writes stays 0600 where the config and tokenizer files beside it are 0644:
    another user (or a container with another uid) cannot read the weights."""
    mask = os.umask(0o022)
    os.umask(mask)
    want = 0o666 & ~mask
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            if path.stat().st_mode & 0o777 == 0o600 != want:  # only the private temporary's mode
                path.chmod(want)


@contextmanager
def atomic_folder(folder: str | Path, what: str = "save the checkpoint") -> Iterator[Path]:
    """Yield an empty temporary sibling of `folder` to fill; when the block ends without an
    error it replaces `folder` in one rename. On any error the temporary folder is removed
    and `folder` (an earlier save) is left as it was. A write that fails for a reason of the
    machine (a full disk, a file-size limit, no write permission, an I/O error), whether
    Python, safetensors or torch.save met it, becomes a one-line `UserError` naming the
    folder, the cause and what is still intact (`save_failure`)."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    old = folder.with_name(folder.name + ".old")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        yield tmp
        usual_modes(tmp)
        if folder.exists():
            if old.exists():
                shutil.rmtree(old)
            folder.rename(old)
        tmp.rename(folder)
    except BaseException as exc:  # a failed save (disk full, Ctrl-C) leaves no half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not folder.exists():  # the rename into place failed: the earlier save goes back
            old.rename(folder)
        error = save_failure(exc, folder, what)
        if error is not None:
            raise error from None
        raise
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


# torch.save's writer (inline_container.cc) reports a short write as a RuntimeError that
# says nothing of space: "[enforce fail at inline_container.cc:672] . unexpected pos 7301056
# vs 7300944" on a full disk, "PytorchStreamWriter failed writing file ..." elsewhere.
_TORCH_WRITE_FAILURES = ("inline_container", "unexpected pos", "PytorchStreamWriter", "file write failed")
_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


def _cause(exc: BaseException) -> tuple[str, int | None] | None:
    """What went wrong in plain words and its errno (None when unknown), for an exception
    a save raised; None when it is not a failure of the machine (a bug, Ctrl-C)."""
    if isinstance(exc, OSError):
        code = exc.errno
        text = exc.strerror or str(exc) or type(exc).__name__
    elif type(exc).__name__ == "SafetensorError":  # safetensors' Rust writer: "... (os error 27)"
        found = re.search(r"os error (\d+)", str(exc))
        if found is None:
            return None  # not an I/O error (a tensor it cannot write): a bug, with its traceback
        code = int(found.group(1))
        text = os.strerror(code)
    elif isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TORCH_WRITE_FAILURES):
        return "a file could not be written in full (the disk is full or a file-size limit is set)", errno.ENOSPC
    else:
        return None
    if code == errno.EFBIG:
        text += " (a file-size limit, see `ulimit -f`, or the disk is full)"
    elif code == errno.EIO:
        text += " (the disk or network file system failed)"
    return text, code


def save_failure(exc: BaseException, folder: str | Path, what: str = "save the checkpoint") -> UserError | None:
    """The one-line `UserError` for a save of `folder` that failed with `exc` (an OSError,
    safetensors' SafetensorError, torch.save's short-write RuntimeError): the folder, the
    cause in plain words, the fix and what is still intact; None for any other exception."""
    found = _cause(exc)
    if found is None:
        return None
    cause, code = found
    folder = Path(folder)
    if code in _SPACE:
        fix = "free some disk space (or point training.output_dir at a larger disk) and run again"
    elif code in _PERMISSION:
        fix = "make the folder writable (or choose another training.output_dir) and run again"
    else:
        fix = "check the disk and run again"
    kept = _kept(folder)
    tail = f"; {kept} is intact" if kept else ""
    return UserError(f"cannot {what} {folder}: {cause}; {fix}{tail}")


def _kept(folder: Path) -> str | None:
    """What a failed save of `folder` left intact, for the error message."""
    if folder.exists():
        return f"the previous {folder.name}/"
    earlier = [p for p in checkpoint_steps(folder.parent) if p != folder]
    return f"the previous checkpoint {earlier[-1]}" if earlier else None


def merged_lora_state(policy: torch.nn.Module, state: dict) -> dict:
    """The plain model's state dict from a peft LoRA model's full state dict (names as the
    peft model gives them): each adapted weight W + scaling · B @ A (transposed for a
    fan-in-fan-out layer), what `merge_and_unload` computes in place, without the adapter
    factors. For a state gathered from shards (FSDP), where the module holds no whole
    weights to merge."""
    prefix = "base_model.model."
    out = {k: v for k, v in state.items() if ".lora_" not in k}
    for name, module in policy.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer")):
            continue
        weight = state[f"{name}.base_layer.weight"]
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            a, b = state[f"{name}.lora_A.{adapter}.weight"], state[f"{name}.lora_B.{adapter}.weight"]
            delta = (b.float() @ a.float()) * module.scaling[adapter]
            if getattr(module, "fan_in_fan_out", False):
                delta = delta.T
            weight = weight + delta.to(weight.dtype)
        out[f"{name}.base_layer.weight"] = weight
    return {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in out.items()}


def untied(model: torch.nn.Module, state: dict) -> dict:
    """`state` without the second name of a tied parameter (a tied LM head): a gathered
    state dict holds a copy under each name, where the model's own holds one tensor."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    drop = {extra for group in names.values() for extra in group[1:]}
    return {k: v for k, v in state.items() if k not in drop}


def checkpoint_layout(actor_critic, method: str | None = None, world_size: int | None = None,
                      fsdp: bool = False, deepspeed: bool = False) -> dict[str, Any]:
    """What a resume must match: the method, LoRA on or off, the critic layout
    (value_head, separate, or none for a critic-free trainer), the process count and
    whether FSDP (its optimizer state keyed by parameter name) or DeepSpeed (its own
    checkpoint in deepspeed/) saved it."""
    if world_size is None:
        dist = torch.distributed
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    critic = ("separate" if actor_critic.critic is not None else
              "value_head" if actor_critic.value_head is not None else "none")
    return {"method": method, "lora": hasattr(actor_critic.policy, "peft_config"), "critic": critic,
            "world_size": world_size, "fsdp": fsdp, "deepspeed": deepspeed}


def save_checkpoint(folder: str | Path, actor_critic, tokenizer, *, optimizer=None,
                    scheduler=None, step: int | None = None, extra: dict | None = None,
                    rank_rng: list | None = None, method: str | None = None,
                    state: dict | None = None, optimizer_state: dict | None = None,
                    engine_state: Path | None = None, more: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint atomically (temporary folder, then rename); `more(folder)` writes
    a caller's own files into it before the rename (the rollout producer's weights).

    `actor_critic` needs `.policy`, `.critic` and `.value_head`; with both of the last two
    None (a `PolicyOnly`) only the policy and the trainer state are written. `rank_rng`
    holds every rank's random state under several processes. `method` (ppo, grpo, rloo,
    dpo, ...) is recorded with the layout, so that `check_resume` can tell a run of
    another method that it cannot continue this one.

    Under FSDP the modules hold shards: `state` is `actor_critic`'s full state dict and
    `optimizer_state` the optimizer's, keyed by parameter name (`Dist.full_state`); the
    folders written are the same as one process writes. `engine_state`: DeepSpeed's own
    checkpoint, staged by every rank (`Dist.stage_engine_state`), moved in as deepspeed/.
    """
    folder = Path(folder)
    method = method or (extra or {}).get("method")
    layout = checkpoint_layout(actor_critic, method, world_size=len(rank_rng) if rank_rng else None,
                               fsdp=optimizer_state is not None and engine_state is None,
                               deepspeed=engine_state is not None)
    try:
        with atomic_folder(folder) as tmp:
            _write_checkpoint(tmp, actor_critic, tokenizer, optimizer, scheduler, step, extra, layout, rank_rng,
                              state, optimizer_state)
            if engine_state is not None:
                shutil.move(str(engine_state), str(tmp / "deepspeed"))
            if more is not None:
                more(tmp)
    finally:
        if engine_state is not None and Path(engine_state).exists():  # a failed save leaves no staging behind
            shutil.rmtree(engine_state, ignore_errors=True)
    return folder


def state_part(state: dict | None, prefix: str) -> dict | None:
    """The entries of a full state dict under `prefix` ("policy.", "critic.base.", ...), renamed."""
    if state is None:
        return None
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _save_head(head: torch.nn.Module, folder: Path, state: dict | None) -> None:
    if state is None:
        save_value_head(head, folder)
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / VALUE_HEAD_FILE))


def _write_checkpoint(tmp: Path, actor_critic, tokenizer, optimizer, scheduler, step, extra, layout,
                      rank_rng=None, full: dict | None = None, optimizer_state: dict | None = None) -> None:
    save_policy(actor_critic.policy, tokenizer, tmp, state_part(full, "policy."))
    if actor_critic.critic is not None:
        critic_dir = tmp / "critic"
        critic_dir.mkdir()
        base, part = unwrap(actor_critic.critic.base), state_part(full, "critic.base.")
        base.save_pretrained(critic_dir, state_dict=untied(base, part) if part is not None else None)
        if tokenizer is not None:  # critic/ loads on its own (load_model wants a tokenizer)
            tokenizer.save_pretrained(critic_dir)
        _save_head(actor_critic.critic.value_head, critic_dir, state_part(full, "critic.value_head."))
    elif actor_critic.value_head is not None:
        _save_head(actor_critic.value_head, tmp, state_part(full, "value_head."))
    if optimizer is not None:
        state = {"step": step, "optimizer": optimizer_state if optimizer_state is not None else optimizer.state_dict(),
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "rng": rng_state(), "extra": extra or {}, "layout": layout}
        if rank_rng is not None:  # several processes: every rank's random state, in rank order
            state["rank_rng"] = rank_rng
        torch.save(state, tmp / STATE_FILE)
    (tmp / META_FILE).write_text(json.dumps({"step": step, **layout, **(extra or {})}, indent=2))


def no_state_message(folder: str | Path) -> str:
    """What --resume says of a folder without trainer_state.pt: a checkpoint saved with
    `training.save_only_model` (its rlhflab.json is there) or not a checkpoint at all."""
    folder = Path(folder)
    if (folder / META_FILE).is_file():
        return (f"--resume {folder}: this checkpoint was saved with training.save_only_model=true (no {STATE_FILE}: "
                f"no optimizer, scheduler or random state), so it cannot be resumed; start a new run from its "
                f"weights with model.name_or_path={folder}")
    return f"--resume {folder}: no {STATE_FILE} there; point it at a step_N/ folder"


def load_trainer_state(folder: str | Path) -> dict[str, Any]:
    """The trainer state of a checkpoint; a truncated or corrupt file is a `UserError`."""
    path = Path(folder) / STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise UserError(no_state_message(folder)) from None
    except Exception as exc:  # EOFError, UnpicklingError, RuntimeError (zip archive): a cut file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--resume {folder}: {STATE_FILE} cannot be read ({first[:120]}); it is truncated or "
                        f"corrupt (a crash or a full disk during the save?): {_other_checkpoint(folder)}") from None
    if not isinstance(state, dict) or not {"step", "optimizer", "rng"} <= set(state):
        raise UserError(f"--resume {folder}: {STATE_FILE} is not rlhflab trainer state (no step/optimizer/rng); "
                        f"{_other_checkpoint(folder)}")
    return state


def check_not_debris(folder: str | Path) -> None:
    """A `step_N.tmp/` folder (a save that a crash cut short) given to --resume is a
    `UserError`: it may hold a trainer state and still lack files, so it is never a
    checkpoint."""
    folder = Path(folder)
    if folder.suffix == ".tmp" and folder.name.startswith(("step_", "final")):
        raise UserError(f"--resume {folder}: this is an unfinished save that a crash cut short, not a checkpoint; "
                        f"{_other_checkpoint(folder)}")


def _other_checkpoint(folder: str | Path) -> str:
    folder = Path(folder)
    older = [p for p in checkpoint_steps(folder.parent) if p != folder and (p / STATE_FILE).is_file()]
    if older:
        return f"resume from another checkpoint, e.g. --resume {older[-1]}"
    return "resume from another step_N/ folder, or start over with training.overwrite=true"


def recorded_layout(folder: str | Path, state: dict | None = None) -> dict[str, Any]:
    """The layout a checkpoint was saved with: recorded (trainer state, rlhflab.json), and
    for a checkpoint from before the layout was recorded, read off its files."""
    folder = Path(folder)
    sources: list[Any] = []  # later ones win: rlhflab.json, the state's extra, the state's layout
    meta = folder / META_FILE
    if meta.is_file():
        try:
            sources.append(json.loads(meta.read_text(encoding="utf-8")))
        except (ValueError, UnicodeDecodeError):
            pass  # the trainer state below, or the files, still say it
    if state is not None:
        sources += [state.get("extra"), state.get("layout")]
    layout: dict[str, Any] = {}
    for source in sources:
        if isinstance(source, dict):
            layout.update({k: source[k] for k in ("method", "lora", "critic", "world_size", "fsdp", "deepspeed")
                           if source.get(k) is not None})
    if layout.get("lora") is None:
        layout["lora"] = (folder / "adapter").is_dir()
    if layout.get("critic") is None:
        layout["critic"] = ("separate" if (folder / "critic").is_dir() else
                            "value_head" if (folder / VALUE_HEAD_FILE).is_file() else "none")
    return layout


def _describe_critic(critic: str) -> str:
    return {"value_head": "a value head on the shared base (model.critic=value_head)",
            "separate": "a separate critic (model.critic=separate)",
            "none": "no critic (a critic-free method: grpo, rloo, dpo)"}.get(critic, repr(critic))


def check_resume(folder: str | Path, *, method: str, lora: bool, critic: str,
                 world_size: int | None = None, fsdp: bool | None = None, deepspeed: bool | None = None) -> None:
    """Check a checkpoint before a resumed run touches anything; a `UserError` names the problem.

    - the folder and its ``trainer_state.pt`` exist and the state loads (a truncated file
      is named as such, with an earlier checkpoint to use instead);
    - the checkpoint was saved by the same `method` (ppo, grpo, rloo, dpo), with LoRA on
      or off as `lora` says, with the `critic` layout the config asks for (value_head,
      separate, or none for a critic-free method) and, when given, as many processes as
      `world_size`: otherwise the error names the differing setting and how to proceed;
    - the files that layout needs are there: the policy (config.json and its weights),
      ``adapter/`` under LoRA, ``value_head.safetensors``, or ``critic/`` with its head.
    """
    if critic not in CRITIC_LAYOUTS:
        raise ValueError(f"critic must be one of {CRITIC_LAYOUTS}, got {critic!r}")
    folder = Path(folder)
    check_not_debris(folder)
    if not folder.is_dir():
        raise UserError(f"--resume {folder}: no such folder; point it at a step_N/ folder of a run")
    state = load_trainer_state(folder)
    rec = recorded_layout(folder, state)
    start_new = f"or start a new run from its weights with model.name_or_path={folder}"
    if rec.get("method") and rec["method"] != method:
        raise UserError(f"--resume {folder}: this is a {rec['method']} checkpoint and `rlhflab {method}` cannot "
                        f"continue it (another optimizer state and model layout); resume it with "
                        f"`rlhflab {rec['method']} --resume {folder}`, {start_new}")
    if bool(rec["lora"]) != bool(lora):
        raise UserError(f"--resume {folder}: the checkpoint was trained with lora.enabled={str(rec['lora']).lower()} "
                        f"but the config says lora.enabled={str(lora).lower()}; set lora.enabled="
                        f"{str(rec['lora']).lower()} to resume, {start_new}")
    if rec["critic"] != critic:
        if "none" in (rec["critic"], critic):
            hint = (f"resume it with the method that saved it, {start_new}" if critic == "none" else
                    f"a critic-free run cannot be resumed as one with a critic; {start_new}")
        else:
            hint = f"set model.critic={rec['critic']} to resume, {start_new}"
        raise UserError(f"--resume {folder}: the checkpoint holds {_describe_critic(rec['critic'])} but this run "
                        f"needs {_describe_critic(critic)}; {hint}")
    if world_size is not None and rec.get("world_size") not in (None, world_size):
        raise UserError(f"--resume {folder}: the checkpoint was saved by a run of {rec['world_size']} processes and "
                        f"this run has {world_size}; resume it with {rec['world_size']} processes (its optimizer "
                        f"and data order are per process), {start_new}")
    for key, name, now in (("fsdp", "an FSDP", fsdp), ("deepspeed", "a DeepSpeed", deepspeed)):
        if now is not None and bool(rec.get(key, False)) != now:
            how = f"under {name}" if rec.get(key) else f"without {name}"
            raise UserError(f"--resume {folder}: the checkpoint was saved {how} accelerate config and this run is "
                            f"{'' if now else 'not '}under {name.split()[-1]}; resume it with the config that saved it (the "
                            f"optimizer state is kept differently), {start_new}")
    _check_files(folder, lora, critic)


def _has_weights(folder: Path) -> bool:
    return any((folder / n).is_file() for n in ("model.safetensors", "pytorch_model.bin",
                                                   "model.safetensors.index.json", "pytorch_model.bin.index.json"))


def _check_files(folder: Path, lora: bool, critic: str) -> None:
    missing = []
    if not (folder / "config.json").is_file() or not _has_weights(folder):
        missing.append("the policy (config.json and model.safetensors)")
    if lora and not (folder / "adapter" / "adapter_config.json").is_file():
        missing.append("adapter/adapter_config.json (the LoRA adapter)")
    if critic == "value_head" and not (folder / VALUE_HEAD_FILE).is_file():
        missing.append(f"{VALUE_HEAD_FILE} (the value head)")
    if critic == "separate":
        if not (folder / "critic" / "config.json").is_file() or not _has_weights(folder / "critic"):
            missing.append("critic/ (the separate critic model)")
        if not (folder / "critic" / VALUE_HEAD_FILE).is_file():
            missing.append(f"critic/{VALUE_HEAD_FILE} (the critic's value head)")
    if missing:
        raise UserError(f"--resume {folder}: {', '.join(missing)} missing; the checkpoint is incomplete (copied "
                        f"in part?): restore the file(s), or {_other_checkpoint(folder)}")


def restore_trainer_state(folder: str | Path, optimizer, scheduler, rank: int = 0, load_optimizer=None) -> int:
    """Load a checkpoint's optimizer, scheduler and RNG states in place; returns its step.
    Under several processes rank r takes its own saved random state. `load_optimizer(state)`
    replaces `optimizer.load_state_dict` (FSDP: `Dist.load_optimizer`)."""
    state = load_trainer_state(folder)
    (load_optimizer or optimizer.load_state_dict)(state["optimizer"])
    if state.get("scheduler"):
        scheduler.load_state_dict(state["scheduler"])
    ranks = state.get("rank_rng")
    set_rng_state(ranks[rank] if ranks and rank < len(ranks) else state["rng"])
    return int(state["step"])


def prune_checkpoints(run_dir: str | Path, keep: int | None) -> None:
    """Keep only the newest `keep` step_N/ folders."""
    if not keep:
        return
    for p in checkpoint_steps(run_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
