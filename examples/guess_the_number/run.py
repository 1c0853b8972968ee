"""Guess-the-number, end to end: a tiny ChatML model, an SFT on a sloppy player's games,
then RL with `rlhflab grpo` from the YAML beside this script, which names the
environment; mean turns to solve (and the share solved within max_turns) on 100 held-out
games, before and after RL.

    python examples/guess_the_number/run.py        # about 5 minutes on a 2-core CPU

Outputs go to outputs/examples/guess_the_number/. The printed table is what
docs/environments.md quotes.
"""

from __future__ import annotations

import argparse
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
HIGH, MAX_TURNS = 10, 6
CARELESS = 0.5  # the sloppy player ignores the feedback this often (any number not yet guessed)


def games(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"game {seed}-{i}", "secret": rng.randint(1, HIGH)} for i in range(n)]


def sloppy_player(seed: int):
    rng = random.Random(seed)

    def reply(row: dict, messages: list[dict]) -> str:
        lo, hi, tried = 1, HIGH, set()
        for prev, answer in zip(messages, messages[1:]):
            if prev["role"] == "assistant":
                g = int(re.findall(r"\d+", prev["content"])[-1])
                tried.add(g)
                if answer["content"] == "higher":
                    lo = max(lo, g + 1)
                elif answer["content"] == "lower":
                    hi = min(hi, g - 1)
        pool = ([x for x in range(1, HIGH + 1) if x not in tried] if rng.random() < CARELESS
                else list(range(lo, hi + 1)))
        return f"My guess is {rng.choice(pool or [row['secret']])}."

    return reply


def measure(model, tok, rows) -> dict:
    cfg = EnvConfig(name="guess_env:GuessTheNumber", kwargs={"high": HIGH}, max_turns=MAX_TURNS, plugin_dir=str(HERE))
    eps = greedy_episodes(model, setup_episodes(cfg, tok), rows, max_turns=MAX_TURNS, max_new_tokens=8,
                          stop_ids=[tok.eos_token_id], env_kwargs={"high": HIGH})
    solved = [e for e in eps if e.done and e.turn_rewards and e.turn_rewards[-1] == 1.0]
    return {"solved": len(solved) / len(eps), "turns_solved": sum(e.num_turns for e in solved) / max(len(solved), 1),
            "turns": sum(e.num_turns for e in eps) / len(eps), "return": sum(e.total_reward for e in eps) / len(eps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--rl-steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse-sft", action="store_true", help="load the SFT model a previous run saved")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    from rlhflab.models.load import load_model
    from rlhflab.models.tiny import make_tiny_model

    train, test = games(2000, 0), games(100, 1)
    write_jsonl(train, OUT / "train.jsonl")
    write_jsonl(test, OUT / "test.jsonl")
    corpus = [f"I am thinking of a number from 1 to {HIGH}. Guess it.", "higher", "lower", "Say a number."] + \
             [f"My guess is {i}." for i in range(1, HIGH + 1)]
    base = OUT / "base" if args.reuse_sft else make_tiny_model(OUT / "base", hidden_size=128, num_layers=4, num_heads=4, vocab_size=512,
                           max_positions=320, corpus=corpus * 50, chat_template="chatml")
    model, tok = load_model(str(OUT / "sft" if args.reuse_sft else base))
    cfg = EnvConfig(name="guess_env:GuessTheNumber", kwargs={"high": HIGH}, max_turns=MAX_TURNS, plugin_dir=str(HERE))
    eps = demonstration_episodes(setup_episodes(cfg, tok), train, sloppy_player(0), max_turns=MAX_TURNS,
                                 env_kwargs={"high": HIGH})
    demo_turns = sum(e.num_turns for e in eps) / len(eps)
    if not args.reuse_sft:
        print(f"SFT on {len(eps)} games of a sloppy player (mean {demo_turns:.2f} turns)", flush=True)
        sft_on_episodes(model, eps, tok.pad_token_id, steps=args.sft_steps, batch_size=32, lr=3e-3, log=print)
        model.save_pretrained(OUT / "sft")
        tok.save_pretrained(OUT / "sft")
    before = measure(model, tok, test)
    print(f"RL: rlhflab grpo --config examples/guess_the_number/grpo.yaml ({args.rl_steps} steps)", flush=True)
    subprocess.run([sys.executable, "-m", "rlhflab", "grpo", "--config", str(HERE / "grpo.yaml"),
                    f"training.total_steps={args.rl_steps}", f"training.num_threads={args.threads}",
                    "logging.progress_bar=false", "training.overwrite=true"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    model, tok = load_model(str(OUT / "grpo" / "final"))
    after = measure(model, tok, test)

    print(f"\nguess-the-number (1 to {HIGH}, at most {MAX_TURNS} turns): {len(test)} held-out games, greedy, "
          f"tiny ChatML model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
    print(f"{'model':<36} {'solved':>7} {'turns to solve':>15} {'turns':>6} {'return':>7}")
    for label, r in ((f"SFT ({CARELESS:.0%}-careless player's games)", before),
                     (f"  then GRPO, {args.rl_steps} steps", after)):
        print(f"{label:<36} {r['solved']:>7.0%} {r['turns_solved']:>15.2f} {r['turns']:>6.2f} {r['return']:>7.2f}")
    print(f"(the demonstrations took {demo_turns:.2f} turns on average; {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
