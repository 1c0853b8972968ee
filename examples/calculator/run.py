"""The calculator example, end to end: word problems, a tiny ChatML model, a small SFT on
tool-use demonstrations, then RL with `rlhflab grpo` (or ppo) from the YAML beside this
script, which names the tool; held-out accuracy with the tool beside a model trained to
answer without it.

    python examples/calculator/run.py                  # everything (about 15 minutes on a 2-core CPU)
    python examples/calculator/run.py --method ppo     # RL with PPO instead of GRPO

Outputs go to outputs/examples/calculator/. The printed table is what
docs/environments.md quotes.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rlhflab.data import wordproblems  # noqa: E402
from rlhflab.data.arith import write_jsonl  # noqa: E402
from rlhflab.envs import EnvConfig, setup_episodes  # noqa: E402
from rlhflab.envs.demos import demonstration_episodes, greedy_episodes, sft_on_episodes  # noqa: E402

OUT = ROOT / "outputs" / "examples" / "calculator"
KINDS = ("add", "sub", "mul", "div")  # one-step problems: one call answers them
SKIP_RATE = 0.4  # the sloppy demonstrator: this share of its demonstrations answers without the tool, off by one


def expression(row: dict) -> str:
    return row["answer"].split("=")[0].strip()  # "7 x 12 = 84\n#### 84" -> "7 x 12"


def make_data(n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    keep = lambda r: r["kind"] in KINDS  # noqa: E731
    test = [r for r in wordproblems.make_split(4 * n_test, 1) if keep(r)][:n_test]
    train = [r for r in wordproblems.make_split(4 * n_train, 0, exclude={r["question"] for r in test}) if keep(r)]
    return train[:n_train], test


def tool_reply(row: dict, messages: list[dict]) -> str:
    """The demonstrator: call the calculator, then give its result (or, SKIP_RATE of the
    time, answer at once, off by one)."""
    if row.get("_skip"):
        return f"The answer is {row['result'] + 1}."
    if messages[-1]["role"] != "tool":
        return f'CALL calculator(expression="{expression(row)}")'
    return f"The answer is {messages[-1]['content']}."


def direct_reply(row: dict, messages: list[dict]) -> str:
    """Without a tool: the worked line and the answer."""
    return f"{expression(row)} = {row['result']}. The answer is {row['result']}."


def evaluate(model, tok, rows, tools: bool) -> dict:
    cfg = EnvConfig(tools=["calc_tools:calculator"] if tools else [], tool_format="plain", max_turns=3,
                    plugin_dir=str(HERE))
    setup = setup_episodes(cfg, tok)
    eps = greedy_episodes(model, setup, [dict(r, prompt=r["question"]) for r in rows], max_turns=3,
                          max_new_tokens=24, stop_ids=[tok.eos_token_id])
    finals = [[m["content"] for m in e.messages if m["role"] == "assistant"][-1] for e in eps]
    acc = sum(wordproblems.correct("", f, r) for f, r in zip(finals, rows)) / len(rows)
    calls = sum(e.tool_calls for e in eps)
    return {"accuracy": acc, "calls": calls / len(eps), "errors": sum(e.tool_errors for e in eps) / max(calls, 1),
            "turns": sum(e.num_turns for e in eps) / len(eps)}


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=["grpo", "ppo"], default="grpo")
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--rl-steps", type=int, default=20)
    ap.add_argument("--rl-lr", type=float, default=None, help="the RL learning rate (default: the YAML's)")
    ap.add_argument("--skip-rate", type=float, default=SKIP_RATE,
                    help="share of demonstrations that answer without the tool, off by one (default: %(default)s)")
    ap.add_argument("--n-train", type=int, default=1500)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0,
                    help="seeds the model and the SFT; a non-zero seed also seeds the RL run (0: the YAML's)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for the RL run")
    ap.add_argument("--out", default=str(OUT), help="output folder (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse-sft", action="store_true", help="load the SFT models a previous run saved")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    OUT = Path(args.out).resolve()
    t0 = time.time()
    from rlhflab.models.load import load_model
    from rlhflab.models.tiny import make_tiny_model

    train, test = make_data(args.n_train, args.n_test)
    write_jsonl(train, OUT / "train.jsonl")
    write_jsonl(test, OUT / "test.jsonl")
    rng = random.Random(args.seed)
    demo_rows = [dict(r, prompt=r["question"], _skip=rng.random() < args.skip_rate) for r in train]
    corpus = [r["question"] for r in train] + [tool_reply(r, [{"role": "user"}]) for r in train[:200]]
    base = OUT / "base" if args.reuse_sft else make_tiny_model(
        OUT / "base", hidden_size=128, num_layers=4, num_heads=4, vocab_size=512, max_positions=320,
        seed=args.seed, corpus=corpus, chat_template="chatml")
    results = {}
    for name, tools, reply in (("sft_direct", False, direct_reply), ("sft_tool", True, tool_reply)):
        if args.reuse_sft and (OUT / name / "config.json").exists():
            model, tok = load_model(str(OUT / name))
            results[name] = evaluate(model, tok, test, tools)
            continue
        model, tok = load_model(str(base))
        cfg = EnvConfig(tools=["calc_tools:calculator"] if tools else [], tool_format="plain", max_turns=3,
                        plugin_dir=str(HERE))
        setup = setup_episodes(cfg, tok)
        eps = demonstration_episodes(setup, demo_rows, reply, max_turns=3)
        print(f"{name}: SFT on {len(eps)} demonstrations ({'with' if tools else 'without'} the tool)", flush=True)
        sft_on_episodes(model, eps, tok.pad_token_id, steps=args.sft_steps, batch_size=32, lr=3e-3, seed=args.seed,
                        log=print)
        model.save_pretrained(OUT / name)
        tok.save_pretrained(OUT / name)
        results[name] = evaluate(model, tok, test, tools)
    print(f"RL: rlhflab {args.method} --config examples/calculator/{args.method}.yaml ({args.rl_steps} steps)",
          flush=True)
    cmd = [sys.executable, "-m", "rlhflab", args.method, "--config", str(HERE / f"{args.method}.yaml"),
           f"training.total_steps={args.rl_steps}", f"training.eval_interval={args.rl_steps}",
           f"training.num_threads={args.threads}", "logging.progress_bar=false", "training.overwrite=true",
           f"model.name_or_path={OUT / 'sft_tool'}", f"dataset.path={OUT / 'train.jsonl'}",
           f"dataset.eval_path={OUT / 'test.jsonl'}", f"training.output_dir={OUT / args.method}"]
    if args.seed:
        cmd.append(f"training.seed={args.seed}")
    cmd += args.set
    if args.rl_lr is not None:
        cmd.append(f"{args.method}.learning_rate={args.rl_lr}")
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    model, tok = load_model(str(OUT / args.method / "final"))
    results["rl"] = evaluate(model, tok, test, True)

    print(f"\ncalculator example: {len(test)} held-out word problems (add, subtract, multiply, divide), "
          f"greedy, tiny ChatML model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
    print(f"{'model':<48} {'accuracy':>8} {'calls/ep':>8} {'tool errors':>11} {'turns':>6}")
    rows = [("SFT on worked answers, no tool", "sft_direct"),
            (f"SFT on tool demonstrations ({args.skip_rate:.0%} skip the tool)", "sft_tool"),
            (f"  then {args.method.upper()}, {args.rl_steps} steps, with the tool", "rl")]
    for label, key in rows:
        r = results[key]
        print(f"{label:<48} {r['accuracy']:>8.0%} {r['calls']:>8.2f} {r['errors']:>11.0%} {r['turns']:>6.2f}")
    print(f"({time.time() - t0:.0f} s)")
    results["args"] = vars(args)
    (OUT / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {OUT / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
