"""A checkpoint or final/ save that fails for a reason of the machine (a full disk, a
file-size limit, an I/O error) is one `UserError` line naming the folder and the cause,
whichever writer met it: Python (OSError), safetensors (its Rust `SafetensorError`,
"File too large (os error 27)") or torch.save (a RuntimeError "unexpected pos ..." that
says nothing of space). The previous checkpoint stays byte for byte, and no `.tmp`
folder is left.

The real errors come from a subprocess run under `RLIMIT_FSIZE` with SIGXFSZ ignored (the
kernel then fails the write with EFBIG instead of killing the process); the monkeypatched
ones cover each type's message on its own.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhflab.errors import UserError
from rlhflab.models import checkpoint
from rlhflab.models.checkpoint import check_resume, latest_checkpoint, save_checkpoint
from rlhflab.trainers.common import check_resume_dir

ROOT = Path(__file__).resolve().parents[1]

# Runs in a subprocess: for each fraction, save <base>/<fraction>/step_2/ freely, then under a
# file-size limit try step_4/ and final/ and print what each raised (one process for both
# writers: the soft limit is lifted again between them). `limit` is a fraction of
# model.safetensors' size: 0.5 stops safetensors' write of the weights; 1.5 lets the
# weights through and stops torch.save of trainer_state.pt (the AdamW moments make it
# about twice their size).
LIMITED_SAVE = r"""
import hashlib, json, resource, signal, sys, torch
from pathlib import Path
from types import SimpleNamespace
from transformers import AutoModelForCausalLM
from rlhflab.errors import UserError
from rlhflab.models.checkpoint import save_checkpoint

model_dir, base, fractions = Path(sys.argv[1]), Path(sys.argv[2]), [float(f) for f in sys.argv[3:]]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
results = {}
for fraction in fractions:
    run = base / str(fraction)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    actor = SimpleNamespace(policy=model, critic=None, value_head=None)  # a critic-free layout (GRPO)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    save_checkpoint(run / "step_2", actor, None, optimizer=opt, step=2, method="grpo")

    def digest():
        h = hashlib.sha256()
        for p in sorted((run / "step_2").rglob("*")):
            if p.is_file():
                h.update(p.name.encode() + p.read_bytes())
        return h.hexdigest()

    before = digest()
    weights = (run / "step_2" / "model.safetensors").stat().st_size
    state = (run / "step_2" / "trainer_state.pt").stat().st_size
    limit = int(weights * fraction)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    errors = {}
    for name in ("step_4", "final"):
        try:
            save_checkpoint(run / name, actor, None, optimizer=opt, step=4, method="grpo")
            errors[name] = None
        except UserError as exc:
            errors[name] = str(exc)
        except BaseException as exc:  # what the user would have seen: a traceback
            errors[name] = f"TRACEBACK {type(exc).__name__}: {exc}"
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    results[str(fraction)] = {"errors": errors, "same": digest() == before, "weights": weights, "state": state,
                              "limit": limit, "left": sorted(p.name for p in run.iterdir()), "run": str(run)}
print(json.dumps(results))
"""
FRACTIONS = {"safetensors": 0.5, "torch.save": 1.5}


@pytest.fixture(scope="module")
def limited_saves(tiny_model_dir, tmp_path_factory) -> dict:
    """What each save under each file-size limit raised (one subprocess for both writers)."""
    base = tmp_path_factory.mktemp("limited")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", LIMITED_SAVE, str(tiny_model_dir), str(base),
                           *(str(f) for f in FRACTIONS.values())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fraction, writer", [(0.5, "safetensors"), (1.5, "torch.save")])
def test_a_file_size_limit_is_one_line_whichever_writer_meets_it(limited_saves, fraction, writer):
    assert FRACTIONS[writer] == fraction
    got = limited_saves[str(fraction)]
    run = Path(got["run"])
    if writer == "torch.save":  # the limit sits between the weights and the trainer state
        assert got["weights"] < got["limit"] < got["state"], got
    else:
        assert got["limit"] < got["weights"], got
    step_4, final = got["errors"]["step_4"], got["errors"]["final"]
    if writer == "safetensors":  # what the kernel says (EFBIG, os error 27), in plain words
        assert step_4.startswith(f"cannot save the checkpoint {run / 'step_4'}: File too large (a file-size "
                                 f"limit, see `ulimit -f`, or the disk is full); free some disk space"), step_4
    else:  # torch's "unexpected pos 704 vs 598" becomes words about space
        assert step_4.startswith(f"cannot save the checkpoint {run / 'step_4'}: a file could not be written in "
                                 f"full (the disk is full or a file-size limit is set); free some disk space"), step_4
    assert step_4.endswith(f"; the previous checkpoint {run / 'step_2'} is intact") and "\n" not in step_4
    assert final.startswith(f"cannot save the checkpoint {run / 'final'}: ") and "\n" not in final
    assert final.endswith(f"the previous checkpoint {run / 'step_2'} is intact")
    assert got["same"]  # step_2/ byte for byte
    assert got["left"] == ["step_2"]  # no step_4/, no final/, no .tmp debris


@pytest.fixture(scope="module")
def tiny_actor(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters())
    return SimpleNamespace(policy=model, critic=None, value_head=None), opt


def _safetensor_error(message: str) -> Exception:
    from safetensors import SafetensorError

    return SafetensorError(message)


@pytest.mark.parametrize("target, make, cause", [
    ("policy", lambda: _safetensor_error("Error while serializing: I/O error: No space left on device (os error 28)"),
     "No space left on device; free some disk space"),
    ("policy", lambda: _safetensor_error("Error while serializing: I/O error: File too large (os error 27)"),
     "File too large (a file-size limit, see `ulimit -f`, or the disk is full); free some disk space"),
    ("state", lambda: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7301056 vs 7300944"),
     "a file could not be written in full (the disk is full or a file-size limit is set); free some disk space"),
    ("state", lambda: RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed"),
     "a file could not be written in full (the disk is full or a file-size limit is set); free some disk space"),
    ("state", lambda: OSError(errno.EIO, "Input/output error"),
     "Input/output error (the disk or network file system failed); check the disk and run again"),
    ("policy", lambda: OSError(errno.EROFS, "Read-only file system"),
     "Read-only file system; make the folder writable"),
], ids=["safetensors-ENOSPC", "safetensors-EFBIG", "torch-unexpected-pos", "torch-stream-writer", "EIO", "EROFS"])
def test_each_writers_failure_is_one_line_and_keeps_the_previous_checkpoint(tiny_actor, tmp_path, monkeypatch,
                                                                           target, make, cause):
    actor, opt = tiny_actor
    run = tmp_path / "run"
    save_checkpoint(run / "step_2", actor, None, optimizer=opt, step=2, method="grpo")
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}

    def fail(*args, **kwargs):
        raise make()

    if target == "policy":
        monkeypatch.setattr(checkpoint, "save_policy", fail)
    else:
        monkeypatch.setattr(checkpoint.torch, "save", fail)
    for name in ("step_4", "step_2", "final"):  # a new step, the same step again, the final model
        with pytest.raises(UserError) as err:
            save_checkpoint(run / name, actor, None, optimizer=opt, step=4, method="grpo")
        msg = str(err.value)
        assert msg.startswith(f"cannot save the checkpoint {run / name}: {cause}"), msg
        kept = "the previous step_2/" if name == "step_2" else f"the previous checkpoint {run / 'step_2'}"
        assert msg.endswith(f"; {kept} is intact") and "\n" not in msg
        assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
        assert sorted(p.name for p in run.iterdir()) == ["step_2"]


def test_a_bug_in_a_save_keeps_its_traceback_and_leaves_no_debris(tiny_actor, tmp_path, monkeypatch):
    actor, opt = tiny_actor

    def bug(*args, **kwargs):
        raise RuntimeError("size mismatch for lm_head.weight")  # not a write failure: a bug to see in full

    monkeypatch.setattr(checkpoint.torch, "save", bug)
    with pytest.raises(RuntimeError, match="size mismatch"):
        save_checkpoint(tmp_path / "step_1", actor, None, optimizer=opt, step=1, method="grpo")
    assert list(tmp_path.iterdir()) == []


def test_resume_from_an_unfinished_save_is_refused(tiny_actor, tmp_path):
    # A SIGKILL after torch.save but before the rename leaves step_3.tmp/ holding a trainer
    # state: it looks resumable and is not (files may be missing).
    actor, opt = tiny_actor
    run = tmp_path / "run"
    save_checkpoint(run / "step_2", actor, None, optimizer=opt, step=2, method="grpo")
    save_checkpoint(run / "step_3", actor, None, optimizer=opt, step=3, method="grpo")
    (run / "step_3").rename(run / "step_3.tmp")
    assert latest_checkpoint(run) == run / "step_2"
    for check in (lambda p: check_resume_dir(p, method="grpo", lora=False),
                  lambda p: check_resume(p, method="grpo", lora=False, critic="none")):
        with pytest.raises(UserError) as err:
            check(run / "step_3.tmp")
        assert str(err.value) == (f"--resume {run / 'step_3.tmp'}: this is an unfinished save that a crash cut "
                                  f"short, not a checkpoint; resume from another checkpoint, e.g. --resume "
                                  f"{run / 'step_2'}")
