"""Guess-the-number, end to end: a tiny ChatML model, an SFT on the games of a player who
reads the feedback but mostly counts up from the lowest number still possible, then RL
with `rlhflab grpo` from the YAML beside this script, which names the environment; the
share of 100 held-out games solved within max_turns (4: enough for bisection, not for
counting up past 4) and the mean turns, before and after RL.

    python examples/guess_the_number/run.py        # about 4 minutes on one free CPU core

Outputs go to outputs/examples/guess_the_number/. The printed table is what
docs/environments.md quotes.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rlhflab.data.arith import write_jsonl  # noqa: E402
from rlhflab.envs import EnvConfig, setup_episodes  # noqa: E402
from rlhflab.envs.demos import demonstration_episodes, greedy_episodes, sft_on_episodes  # noqa: E402

OUT = ROOT / "outputs" / "examples" / "guess_the_number"
HIGH, MAX_TURNS = 10, 4  # bisection finds any number from 1 to 10 in 4 guesses; counting up, only 1 to 4
HALVE = 0.3  # the demonstrator halves the range this often, else it counts up


def games(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"game {seed}-{i}", "secret": rng.randint(1, HIGH)} for i in range(n)]


def interval(messages: list[dict]) -> tuple[int, int]:
    """The numbers still possible after the feedback so far: (lowest, highest)."""
    lo, hi = 1, HIGH
    for prev, answer in zip(messages, messages[1:]):
        if prev["role"] == "assistant":
            g = int(re.findall(r"\d+", prev["content"])[-1])
            if answer["content"] == "higher":
                lo = max(lo, g + 1)
            elif answer["content"] == "lower":
                hi = min(hi, g - 1)
    return lo, hi


def counting_player(seed: int, halve: float):
    """The demonstrator: it reads the feedback, but most turns it guesses the lowest number
    still possible (counting up); `halve` of its turns it guesses the middle (bisection)."""
    rng = random.Random(seed)

    def reply(row: dict, messages: list[dict]) -> str:
        lo, hi = interval(messages)
        return f"My guess is {(lo + hi) // 2 if rng.random() < halve else lo}."

    return reply


def env_config() -> EnvConfig:
    return EnvConfig(name="guess_env:GuessTheNumber", kwargs={"high": HIGH}, max_turns=MAX_TURNS, plugin_dir=str(HERE))


def make_base(out: Path, seed: int, hidden_size: int = 128, num_layers: int = 4) -> Path:
    """The tiny ChatML model (1.12M parameters at the default sizes), its BPE trained on the game's phrases."""
    from rlhflab.models.tiny import make_tiny_model

    corpus = [f"I am thinking of a number from 1 to {HIGH}. Guess it.", "higher", "lower", "Say a number."] + \
             [f"My guess is {i}." for i in range(1, HIGH + 1)]
    return make_tiny_model(out, hidden_size=hidden_size, num_layers=num_layers, num_heads=4, vocab_size=512,
                           max_positions=320, seed=seed, corpus=corpus * 50, chat_template="chatml")


def demonstrations(tok, rows: list[dict], seed: int, halve: float):
    """The demonstrator's games (`counting_player`) as episodes, laid out as RL lays them out."""
    return demonstration_episodes(setup_episodes(env_config(), tok), rows, counting_player(seed, halve),
                                  max_turns=MAX_TURNS, env_kwargs={"high": HIGH})


def measure(model, tok, rows) -> dict:
    """Greedy games on `rows`: the share solved, mean turns of the solved games and of all,
    the mean return."""
    eps = greedy_episodes(model, setup_episodes(env_config(), tok), rows, max_turns=MAX_TURNS, max_new_tokens=8,
                          stop_ids=[tok.eos_token_id], env_kwargs={"high": HIGH})
    solved = [e for e in eps if e.done and e.turn_rewards and e.turn_rewards[-1] == 1.0]
    return {"solved": len(solved) / len(eps), "turns_solved": sum(e.num_turns for e in solved) / max(len(solved), 1),
            "turns": sum(e.num_turns for e in eps) / len(eps), "return": sum(e.total_reward for e in eps) / len(eps)}


def rl_overrides(out: Path, steps: int, threads: int, seed: int) -> list[str]:
    """The RL run's settings beyond grpo.yaml: the SFT model, the games and the output folder under `out`."""
    return [f"training.total_steps={steps}", f"training.num_threads={threads}", "logging.progress_bar=false",
            "training.overwrite=true", f"training.seed={seed}", f"model.name_or_path={out / 'sft'}",
            f"dataset.path={out / 'train.jsonl'}", f"dataset.eval_path={out / 'test.jsonl'}",
            f"training.output_dir={out / 'grpo'}", f"env.max_turns={MAX_TURNS}"]


def main() -> int:
    global OUT, MAX_TURNS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--rl-steps", type=int, default=30)
    ap.add_argument("--rl-lr", type=float, default=None, help="the RL learning rate (default: the YAML's)")
    ap.add_argument("--halve", type=float, default=HALVE, help="share of the demonstrator's turns that halve the range")
    ap.add_argument("--max-turns", type=int, default=MAX_TURNS)
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, the demonstrations, the SFT and the RL run")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for the RL run")
    ap.add_argument("--out", default=str(OUT), help="output folder (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse-sft", action="store_true", help="load the SFT model a previous run saved")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    OUT, MAX_TURNS = Path(args.out).resolve(), args.max_turns
    t0 = time.time()
    from rlhflab.models.load import load_model

    train, test = games(2000, 0), games(100, 1)
    write_jsonl(train, OUT / "train.jsonl")
    write_jsonl(test, OUT / "test.jsonl")
    base = OUT / "base" if args.reuse_sft else make_base(OUT / "base", args.seed)
    model, tok = load_model(str(OUT / "sft" if args.reuse_sft else base))
    eps = demonstrations(tok, train, args.seed, args.halve)
    demo_turns = sum(e.num_turns for e in eps) / len(eps)
    if not args.reuse_sft:
        print(f"SFT on {len(eps)} games of a player who mostly counts up (mean {demo_turns:.2f} turns)", flush=True)
        sft_on_episodes(model, eps, tok.pad_token_id, steps=args.sft_steps, batch_size=32, lr=3e-3, seed=args.seed,
                        log=print)
        model.save_pretrained(OUT / "sft")
        tok.save_pretrained(OUT / "sft")
    before = measure(model, tok, test)
    print(f"RL: rlhflab grpo --config examples/guess_the_number/grpo.yaml ({args.rl_steps} steps)", flush=True)
    cmd = [sys.executable, "-m", "rlhflab", "grpo", "--config", str(HERE / "grpo.yaml"),
           *rl_overrides(OUT, args.rl_steps, args.threads, args.seed), *args.set]
    if args.rl_lr is not None:
        cmd.append(f"grpo.learning_rate={args.rl_lr}")
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    model, tok = load_model(str(OUT / "grpo" / "final"))
    after = measure(model, tok, test)

    print(f"\nguess-the-number (1 to {HIGH}, at most {MAX_TURNS} turns): {len(test)} held-out games, greedy, "
          f"tiny ChatML model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
    print(f"{'model':<36} {'solved':>7} {'turns to solve':>15} {'turns':>6} {'return':>7}")
    for label, r in ((f"SFT (a player halving {args.halve:.0%} of turns)", before),
                     (f"  then GRPO, {args.rl_steps} steps", after)):
        print(f"{label:<36} {r['solved']:>7.0%} {r['turns_solved']:>15.2f} {r['turns']:>6.2f} {r['return']:>7.2f}")
    print(f"(the demonstrations took {demo_turns:.2f} turns on average; {time.time() - t0:.0f} s)")
    (OUT / "results.json").write_text(json.dumps({"sft": before, "grpo": after, "demo_turns": demo_turns,
                                                  "args": vars(args)}, indent=1) + "\n")
    print(f"results: {OUT / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
