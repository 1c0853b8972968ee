"""What the examples' run.py scripts share when they run a real chat model (`--model DIR`)
in place of the tiny one: the command-line options, the model loaded on the chosen device,
and the GRPO run from the example's grpo_real.yaml with the model read back after it.

Imported by examples/calculator/run.py and examples/guess_the_number/run.py (each puts
this folder on sys.path).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SFT_BATCH = 8  # demonstrations per SFT step for a real chat model (the tiny models take 32)


def add_model_options(ap: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """--model, --device, --no-zero-shot and --max-new-tokens."""
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="a real chat model's folder: evaluate it zero-shot (no tiny model); with --sft-steps N an SFT "
                         "on the demonstrations first, with --rl-steps N GRPO from the example's grpo_real.yaml")
    ap.add_argument("--device", default="cpu",
                    help="with --model: where the model runs, its SFT and its RL run included (default: %(default)s)")
    ap.add_argument("--no-zero-shot", action="store_true", help="with --model: skip the zero-shot evaluation")
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                    help="tokens per turn at most (default: %(default)s; a real chat model needs more)")


def load(path, device: str):
    """(model, tokenizer) from a folder, on `device`."""
    from rlhflab.models.load import load_model

    return load_model(str(path), device=device)


def save(model, tok, path: Path) -> Path:
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_grpo(config: Path, overrides: list[str], output_dir: Path, device: str, more: list[str] = ()):
    """`rlhflab grpo --config config` with `overrides` (then `more`, the user's --set), on
    `device`, writing to `output_dir`; returns (model, tokenizer) of its final folder."""
    cmd = [sys.executable, "-m", "rlhflab", "grpo", "--config", str(config), *overrides,
           f"training.output_dir={output_dir}", f"training.device={device}", *more]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return load(output_dir / "final", device)


def run_real(args, train: list[dict], test: list[dict], out: Path, real_model, print_real, seconds) -> int:
    """The `--model DIR` branch of an example's main(): evaluate (and train) the real model,
    print its table and write `results.json` with the arguments beside the numbers."""
    results = real_model(args, train, test)
    print_real(results, args, test, seconds())
    results["args"] = vars(args)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {out / 'results.json'}")
    return 0
