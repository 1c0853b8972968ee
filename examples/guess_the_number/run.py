"""Guess-the-number, end to end: a tiny ChatML model, an SFT on the games of a player who
reads the feedback and plays most games by counting up from the lowest number still
possible, the others by halving the range, then RL with `rlhflab grpo` from the YAML
beside this script, which names the environment; the share of 100 held-out games solved
within max_turns (4: enough for bisection, not for counting up past 4) and the mean
turns, before and after RL.

    python examples/guess_the_number/run.py --threads 1

With --threads 1 on a 2-core machine shared with other jobs, seeds 0 and 1 printed 182 s and
177 s of wall time (docs/environments.md); expect about 3 minutes.

A real chat model in place of the tiny one (its folder; zero-shot, then with --sft-steps N
an SFT on the same demonstrator's games, then with --rl-steps N GRPO from grpo_real.yaml):

    python examples/guess_the_number/run.py --model outputs/models/smollm2-135m-instruct \
        --max-new-tokens 32 --sft-steps 30 --rl-steps 20

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
sys.path.insert(0, str(HERE.parent))  # examples/real_chat.py

import torch  # noqa: E402

from rlhflab.data.arith import write_jsonl  # noqa: E402
from rlhflab.envs import EnvConfig, setup_episodes  # noqa: E402
from rlhflab.envs.demos import demonstration_episodes, greedy_episodes, sft_on_episodes  # noqa: E402
from real_chat import SFT_BATCH, add_model_options, load, run_grpo, run_real, save  # noqa: E402

OUT = ROOT / "outputs" / "examples" / "guess_the_number"
HIGH, MAX_TURNS = 10, 4  # bisection finds any number from 1 to 10 in 4 guesses; counting up, only 1 to 4
HALVE = 0.3  # the share of the demonstrator's games played by halving the range; the rest it counts up
SFT_LR = 1e-3  # at 3e-3 (constant AdamW) a 2-layer model's 150-step SFT (seed 2) ended at loss 0.26, at 1e-3 0.04


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


def counting_player(row: dict, messages: list[dict]) -> str:
    """The demonstrator: it reads the feedback, and plays each game one way throughout: by
    halving what is left (the rows marked `_halve`) or by guessing the lowest number still
    possible (counting up).

    One way per game, not a coin per turn: with a coin per turn the turns after a halving
    move are a mix of both ways, which a small model learned poorly (about a fifth of its
    sampled guesses fell outside the range still open), so opening with the middle number
    paid hardly more than counting up and RL had little reason to prefer it. Sampled games
    of a 2-layer model after 150 SFT steps at lr 1e-3 (seed 2), mean return after opening
    with 5 and after opening with 1: 0.14 and 0.12 with a coin per turn, 0.76 and 0.11 one
    way per game. Then RL has one clear choice to learn: the opening move."""
    lo, hi = interval(messages)
    return f"My guess is {(lo + hi) // 2 if row.get('_halve') else lo}."


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
    """The demonstrator's games (`counting_player`) as episodes, laid out as RL lays them out;
    a share `halve` of them (drawn with `seed`) played by halving."""
    rng = random.Random(seed)
    rows = [dict(r, _halve=rng.random() < halve) for r in rows]
    return demonstration_episodes(setup_episodes(env_config(), tok), rows, counting_player,
                                  max_turns=MAX_TURNS, env_kwargs={"high": HIGH})


def measure(model, tok, rows, max_new_tokens: int = 8) -> dict:
    """Greedy games on `rows`: the share solved, mean turns of the solved games and of all,
    the mean return; the share of games ended by a turn cut off at `max_new_tokens`
    (`cut_off`), and the first game's messages (`sample`)."""
    eps = greedy_episodes(model, setup_episodes(env_config(), tok), rows, max_turns=MAX_TURNS,
                          max_new_tokens=max_new_tokens, stop_ids=[tok.eos_token_id], env_kwargs={"high": HIGH})
    solved = [e for e in eps if e.done and e.turn_rewards and e.turn_rewards[-1] == 1.0]
    return {"solved": len(solved) / len(eps), "turns_solved": sum(e.num_turns for e in solved) / max(len(solved), 1),
            "turns": sum(e.num_turns for e in eps) / len(eps), "return": sum(e.total_reward for e in eps) / len(eps),
            "cut_off": sum(e.hit_limit for e in eps) / len(eps), "sample": eps[0].messages}


def rl_overrides(out: Path, steps: int, threads: int, seed: int) -> list[str]:
    """The RL run's settings beyond grpo.yaml: the SFT model, the games and the output folder under `out`."""
    return [f"training.total_steps={steps}", f"training.num_threads={threads}", "logging.progress_bar=false",
            "training.overwrite=true", f"training.seed={seed}", f"model.name_or_path={out / 'sft'}",
            f"dataset.path={out / 'train.jsonl'}", f"dataset.eval_path={out / 'test.jsonl'}",
            f"training.output_dir={out / 'grpo'}", f"env.max_turns={MAX_TURNS}"]


def real_model(args, train: list[dict], test: list[dict]) -> dict:
    """A real chat model (a Hugging Face folder) on the held-out games, greedy: zero-shot;
    with `--sft-steps`, after an SFT on the demonstrator's games (batch 8); with
    `--rl-steps`, after `rlhflab grpo` from grpo_real.yaml (from the SFT model when there is one)."""
    model, tok = load(args.model, args.device)
    results = {}
    if not args.no_zero_shot:
        results["zero_shot"] = measure(model, tok, test, args.max_new_tokens)
        print(f"  zero-shot: {results['zero_shot']['solved']:.0%} solved", flush=True)
    start = Path(args.model).resolve()
    if args.sft_steps:
        eps = demonstrations(tok, train, args.seed, args.halve)
        results["demo_turns"] = sum(e.num_turns for e in eps) / len(eps)
        print(f"SFT on {len(eps)} games of the demonstrator ({args.sft_steps} steps of {SFT_BATCH}, learning rate "
              f"{args.sft_lr:g})", flush=True)
        t0 = time.time()
        sft_on_episodes(model, eps, tok.pad_token_id, steps=args.sft_steps, batch_size=SFT_BATCH, lr=args.sft_lr,
                        seed=args.seed, log=print)
        results["sft_seconds"] = time.time() - t0
        start = save(model, tok, OUT / "sft")
        results["sft"] = measure(model, tok, test, args.max_new_tokens)
        print(f"  after the SFT: {results['sft']['solved']:.0%} solved", flush=True)
    if args.rl_steps:
        print(f"RL: rlhflab grpo --config examples/guess_the_number/grpo_real.yaml ({args.rl_steps} steps)",
              flush=True)
        overrides = [*rl_overrides(OUT, args.rl_steps, args.threads, args.seed), f"model.name_or_path={start}",
                     f"generation.max_new_tokens={args.max_new_tokens}"]
        lr = [] if args.rl_lr is None else [f"grpo.learning_rate={args.rl_lr}"]
        t0 = time.time()
        model, tok = run_grpo(HERE / "grpo_real.yaml", overrides, OUT / "grpo", args.device, [*args.set, *lr])
        results["rl_seconds"] = time.time() - t0
        results["grpo"] = measure(model, tok, test, args.max_new_tokens)
    return results


def print_real(results: dict, args, test: list[dict], seconds: float) -> None:
    where = "" if args.device == "cpu" else f", on {args.device}"
    print(f"\nguess-the-number (1 to {HIGH}, at most {MAX_TURNS} turns), a real chat model: {Path(args.model).name}, "
          f"{len(test)} held-out games, greedy, at most {args.max_new_tokens} new tokens a turn{where}")
    print(f"{'model':<52} {'solved':>7} {'turns to solve':>15} {'turns':>6} {'return':>7} {'cut off':>7}")
    rows = (("zero-shot", "zero_shot"),
            (f"SFT, {args.sft_steps} steps on the demonstrator (halving {args.halve:.0%})", "sft"),
            (f"  then GRPO, {args.rl_steps} steps", "grpo"))
    for label, key in rows:
        if key in results:
            r = results[key]
            print(f"{label:<52} {r['solved']:>7.0%} {r['turns_solved']:>15.2f} {r['turns']:>6.2f} {r['return']:>7.2f} "
                  f"{r['cut_off']:>7.0%}")
    demo = f"the demonstrations took {results['demo_turns']:.2f} turns on average; " if "demo_turns" in results else ""
    print(f"(cut off: games that ended on a turn cut off at the token limit; {demo}{seconds:.0f} s)")


def main() -> int:
    global OUT, MAX_TURNS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: 200; with --model 0)")
    ap.add_argument("--rl-steps", type=int, default=30)
    ap.add_argument("--rl-lr", type=float, default=None, help="the RL learning rate (default: the YAML's)")
    ap.add_argument("--halve", type=float, default=HALVE, help="share of the demonstrator's games played by halving")
    ap.add_argument("--sft-lr", type=float, default=None,
                    help=f"SFT learning rate (default: {SFT_LR:g}, batch 32; with --model 3e-5, batch {SFT_BATCH})")
    ap.add_argument("--max-turns", type=int, default=MAX_TURNS)
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, the demonstrations, the SFT and the RL run")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for the RL run")
    ap.add_argument("--out", default=str(OUT), help="output folder (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse-sft", action="store_true", help="load the SFT model a previous run saved")
    add_model_options(ap, 8)
    args = ap.parse_args()
    if args.sft_steps is None:
        args.sft_steps = 0 if args.model else 200
    if args.sft_lr is None:
        args.sft_lr = 3e-5 if args.model else SFT_LR
    torch.set_num_threads(args.threads)
    OUT, MAX_TURNS = Path(args.out).resolve(), args.max_turns
    t0 = time.time()
    from rlhflab.models.load import load_model

    train, test = games(2000, 0), games(100, 1)
    write_jsonl(train, OUT / "train.jsonl")
    write_jsonl(test, OUT / "test.jsonl")
    if args.model:
        return run_real(args, train, test, OUT, real_model, print_real, lambda: time.time() - t0)
    base = OUT / "base" if args.reuse_sft else make_base(OUT / "base", args.seed)
    model, tok = load_model(str(OUT / "sft" if args.reuse_sft else base))
    eps = demonstrations(tok, train, args.seed, args.halve)
    demo_turns = sum(e.num_turns for e in eps) / len(eps)
    if not args.reuse_sft:
        print(f"SFT on {len(eps)} games of a player who mostly counts up (mean {demo_turns:.2f} turns)", flush=True)
        sft_on_episodes(model, eps, tok.pad_token_id, steps=args.sft_steps, batch_size=32, lr=args.sft_lr,
                        seed=args.seed, log=print)
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
    print(f"{'model':<40} {'solved':>7} {'turns to solve':>15} {'turns':>6} {'return':>7}")
    for label, r in ((f"SFT (a player halving in {args.halve:.0%} of games)", before),
                     (f"  then GRPO, {args.rl_steps} steps", after)):
        print(f"{label:<40} {r['solved']:>7.0%} {r['turns_solved']:>15.2f} {r['turns']:>6.2f} {r['return']:>7.2f}")
    print(f"(the demonstrations took {demo_turns:.2f} turns on average; {time.time() - t0:.0f} s)")
    (OUT / "results.json").write_text(json.dumps({"sft": before, "grpo": after, "demo_turns": demo_turns,
                                                  "args": vars(args)}, indent=1) + "\n")
    print(f"results: {OUT / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
