"""The calculator example, end to end: word problems, a tiny ChatML model, a small SFT on
tool-use demonstrations, then RL with `rlhflab grpo` (or ppo) from the YAML beside this
script, which names the tool; held-out accuracy with the tool beside a model trained to
answer without it.

    python examples/calculator/run.py                  # everything (a few minutes on one CPU core)
    python examples/calculator/run.py --method ppo     # RL with PPO instead of GRPO
    python examples/calculator/run.py --model outputs/models/smollm2-135m-instruct --rl-steps 0
                                                       # a real chat model, zero-shot, no SFT

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
sys.path.insert(0, str(HERE.parent))  # examples/real_chat.py

import torch  # noqa: E402

from rlhflab.data import wordproblems  # noqa: E402
from rlhflab.data.arith import write_jsonl  # noqa: E402
from rlhflab.envs import EnvConfig, setup_episodes  # noqa: E402
from rlhflab.envs.demos import demonstration_episodes, greedy_episodes, sft_on_episodes  # noqa: E402
from real_chat import SFT_BATCH, add_model_options, load, run_grpo, run_real, save  # noqa: E402

OUT = ROOT / "outputs" / "examples" / "calculator"
KINDS = ("add", "sub", "mul", "div")  # one-step problems: one call answers them
LEVEL = "easy"        # operands to 30 (wordproblems.LEVELS: sums to 24, take-aways from 20, times tables to 6 x 6,
                      # dividends to 30): short numbers the tiny model learns to copy
SKIP_RATE = 0.7       # the demonstrator answers this share of its products and quotients in its head, off by one,
SKIP_KINDS = ("mul", "div")  # without the tool; sums and differences it always works out with the calculator
MAX_TURNS, MAX_NEW_TOKENS = 3, 24
TOOLS = ["calc_tools:calculator"]

# ChatML that lists the tools in one short system line ("Tools: calculator(expression)"),
# as the tool templates of real chat models render them. Without it the tokenizer has no
# tool template, and rlhflab puts its generic tools message (about 150 tokens with this
# 512-token tokenizer) in front of every episode; the tiny model learns far slower then.
TOOLS_LINE = ("{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}"
              "{{- ' ' + tool['function']['name'] + '(' + (tool['function']['parameters']['properties'] | list "
              "| join(', ')) + ')' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}")


def expression(row: dict) -> str:
    return row["answer"].split("=")[0].strip()  # "7 x 12 = 84\n#### 84" -> "7 x 12"


def make_data(n_train: int, n_test: int, level: str = LEVEL) -> tuple[list[dict], list[dict]]:
    keep = lambda r: r["kind"] in KINDS  # noqa: E731
    test = [r for r in wordproblems.make_split(4 * n_test, 1, level=level) if keep(r)][:n_test]
    train = [r for r in wordproblems.make_split(4 * n_train, 0, exclude={r["question"] for r in test}, level=level)
             if keep(r)]
    return train[:n_train], test


def tool_reply(row: dict, messages: list[dict]) -> str:
    """The demonstrator: call the calculator, then give its result (or, on the rows marked
    `_skip`, answer at once, off by one)."""
    if row.get("_skip"):
        return f"The answer is {row['result'] + 1}."
    if messages[-1]["role"] != "tool":
        return f'CALL calculator(expression="{expression(row)}")'
    return f"The answer is {messages[-1]['content']}."


def direct_reply(row: dict, messages: list[dict]) -> str:
    """Without a tool: the worked line and the answer."""
    return f"{expression(row)} = {row['result']}. The answer is {row['result']}."


def env_config(tools: bool, tool_format: str = "plain") -> EnvConfig:
    return EnvConfig(tools=TOOLS if tools else [], tool_format=tool_format, max_turns=MAX_TURNS, plugin_dir=str(HERE))


def make_base(out: Path, train: list[dict], seed: int, hidden_size: int = 128, num_layers: int = 4) -> Path:
    """The tiny ChatML model (1.12M parameters at the default sizes), its BPE trained on the
    task's text, and a chat template that lists the tools in one line."""
    from transformers import AutoTokenizer

    from rlhflab.models.tiny import CHAT_TEMPLATES, make_tiny_model

    corpus = [r["question"] for r in train] + [tool_reply(r, [{"role": "user"}]) for r in train[:200]]
    base = make_tiny_model(out, hidden_size=hidden_size, num_layers=num_layers, num_heads=4, vocab_size=512,
                           max_positions=320, seed=seed, corpus=corpus, chat_template="chatml")
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.chat_template = TOOLS_LINE + CHAT_TEMPLATES["chatml"]["template"]
    tok.save_pretrained(str(base))
    return base


def demonstrations(rows: list[dict], seed: int, skip_rate: float, skip_kinds=SKIP_KINDS) -> list[dict]:
    rng = random.Random(seed)
    return [dict(r, prompt=r["question"], _skip=r["kind"] in skip_kinds and rng.random() < skip_rate) for r in rows]


def sft(base: Path, demo_rows: list[dict], tools: bool, steps: int, seed: int, log=None, batch_size: int = 32,
        lr: float = 3e-3, device: str = "cpu"):
    """The base model after `steps` SFT steps of `batch_size` demonstrations (with the tool or without)."""
    model, tok = load(base, device)
    eps = demonstration_episodes(setup_episodes(env_config(tools), tok), demo_rows,
                                 tool_reply if tools else direct_reply, max_turns=MAX_TURNS)
    sft_on_episodes(model, eps, tok.pad_token_id, steps=steps, batch_size=batch_size, lr=lr, seed=seed, log=log)
    return model, tok


def evaluate(model, tok, rows, tools: bool, tool_format: str = "plain", max_new_tokens: int = MAX_NEW_TOKENS
             ) -> dict:
    """Greedy held-out episodes: accuracy of the last reply, tool calls per episode, the
    share of calls that failed, turns per episode; the share of episodes with at least one
    call the tool answered (`well_formed`), the share of calls that could not be read at
    all (`malformed`), and of episodes cut off at `max_new_tokens` (`cut_off`)."""
    from rlhflab.envs.tools import parse_calls

    setup = setup_episodes(env_config(tools, tool_format), tok)
    eps = greedy_episodes(model, setup, [dict(r, prompt=r["question"]) for r in rows],
                          max_turns=MAX_TURNS, max_new_tokens=max_new_tokens, stop_ids=[tok.eos_token_id])
    finals = [[m["content"] for m in e.messages if m["role"] == "assistant"][-1] for e in eps]
    acc = sum(wordproblems.correct("", f, r) for f, r in zip(finals, rows)) / len(rows)
    calls = sum(e.tool_calls for e in eps)
    answered = sum(any(m["role"] == "tool" and not m["content"].startswith("error:") for m in e.messages)
                   for e in eps)
    malformed = sum(c.error is not None for e in eps for m in e.messages if m["role"] == "assistant" and tools
                    for c in parse_calls(m["content"], setup.tool_format))
    return {"accuracy": acc, "calls": calls / len(eps), "errors": sum(e.tool_errors for e in eps) / max(calls, 1),
            "turns": sum(e.num_turns for e in eps) / len(eps), "well_formed": answered / len(eps),
            "malformed": malformed / max(calls, 1), "cut_off": sum(e.hit_limit for e in eps) / len(eps),
            "sample": eps[0].messages}


def rl_overrides(out: Path, method: str, steps: int, threads: int, seed: int) -> list[str]:
    """The RL run's settings beyond `<method>.yaml`: the SFT model with the tool, the data and
    the output folder under `out`."""
    return [f"training.total_steps={steps}", f"training.eval_interval={steps}", f"training.num_threads={threads}",
            "logging.progress_bar=false", "training.overwrite=true", f"training.seed={seed}",
            f"model.name_or_path={out / 'sft_tool'}", f"dataset.path={out / 'train.jsonl'}",
            f"dataset.eval_path={out / 'test.jsonl'}", f"training.output_dir={out / method}"]


REAL_SETTINGS = (("no tool", "direct", False, "plain"),
                 ("tool offered, plain form (CALL calculator(...))", "plain", True, "plain"),
                 ("tool offered, Hermes form (<tool_call>{...})", "hermes", True, "hermes"))


def real_model(args, train: list[dict], test: list[dict]) -> dict:
    """A real chat model (a Hugging Face folder), zero-shot: the held-out rows greedy without
    the tool and with it in both call forms; with `--sft-steps`, an SFT on the tool
    demonstrations (plain form, batch 8) and the same evaluation; then, with `--rl-steps`,
    `rlhflab grpo` from grpo_real.yaml (from the SFT model when there is one) in the plain
    form and the same evaluation after."""
    from rlhflab.envs.tools import load_tools, template_renders_tools

    model, tok = load(args.model, args.device)
    renders = template_renders_tools(tok, load_tools(TOOLS, HERE))
    print(f"{args.model}: its chat template {'renders' if renders else 'does not render'} the tools' schemas "
          f"(tools=); {'they are in the template' if renders else 'rlhflab puts its tools system message first'}",
          flush=True)
    results = {"template_renders_tools": renders}
    for label, key, tools, fmt in () if args.no_zero_shot else REAL_SETTINGS:
        results[key] = evaluate(model, tok, test, tools, fmt, args.max_new_tokens)
        print(f"  {label}: {results[key]['accuracy']:.0%}", flush=True)
    start = Path(args.model).resolve()
    if args.sft_steps:
        print(f"SFT on {len(train)} tool demonstrations ({args.sft_steps} steps of {SFT_BATCH}, learning rate "
              f"{args.sft_lr:g})", flush=True)
        t0 = time.time()
        model, tok = sft(start, demonstrations(train, args.seed, args.skip_rate, args.skip_kinds), True,
                         args.sft_steps, args.seed, log=print, batch_size=SFT_BATCH, lr=args.sft_lr,
                         device=args.device)
        results["sft_seconds"] = time.time() - t0
        start = save(model, tok, OUT / "sft_tool")
        results["sft"] = evaluate(model, tok, test, True, "plain", args.max_new_tokens)
        print(f"  after the SFT, plain form: {results['sft']['accuracy']:.0%}", flush=True)
    if args.rl_steps:
        print(f"RL: rlhflab grpo --config examples/calculator/grpo_real.yaml ({args.rl_steps} steps)", flush=True)
        overrides = [*rl_overrides(OUT, "grpo", args.rl_steps, args.threads, args.seed),
                     f"model.name_or_path={start}", "training.eval_interval=0"]
        lr = [] if args.rl_lr is None else [f"grpo.learning_rate={args.rl_lr}"]
        t0 = time.time()
        model, tok = run_grpo(HERE / "grpo_real.yaml", overrides, OUT / "grpo", args.device, [*args.set, *lr])
        results["rl_seconds"] = time.time() - t0
        results["rl"] = evaluate(model, tok, test, True, "plain", args.max_new_tokens)
        print(f"  after GRPO, plain form: {results['rl']['accuracy']:.0%}", flush=True)
    return results


def print_real(results: dict, args, test: list[dict], seconds: float) -> None:
    how = "zero-shot" if not args.sft_steps else f"after {args.sft_steps} SFT steps"
    where = "" if args.device == "cpu" else f", on {args.device}"
    print(f"\ncalculator example, a real chat model {how}: {Path(args.model).name}, {len(test)} held-out word "
          f"problems ({args.level} level), greedy, at most {args.max_new_tokens} new tokens a turn{where}")
    print(f"{'setting':<50} {'accuracy':>8} {'ep. w/ call':>11} {'calls/ep':>8} {'malformed':>9} "
          f"{'tool err':>8} {'turns':>5} {'cut off':>7}")
    rows = [(label, key) for label, key, _, _ in REAL_SETTINGS]
    rows.append((f"SFT, {args.sft_steps} steps on tool demonstrations, plain form", "sft"))
    rows.append((f"  then GRPO, {args.rl_steps} steps, plain form", "rl"))
    for label, key in rows:
        if key in results:
            r = results[key]
            print(f"{label:<50} {r['accuracy']:>8.0%} {r['well_formed']:>11.0%} {r['calls']:>8.2f} "
                  f"{r['malformed']:>9.0%} {r['errors']:>8.0%} {r['turns']:>5.2f} {r['cut_off']:>7.0%}")
    print(f"(ep. w/ call: episodes with at least one call the tool answered; malformed: calls that could not be "
          f"read, of all calls; tool err: calls answered with an error, malformed ones included; {seconds:.0f} s)")


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=["grpo", "ppo"], default="grpo")
    ap.add_argument("--level", choices=list(wordproblems.LEVELS), default=LEVEL,
                    help="number sizes (default: %(default)s)")
    ap.add_argument("--sft-steps", type=int, default=None,
                    help="SFT steps (default: 300; with --model 0, no SFT)")
    ap.add_argument("--sft-lr", type=float, default=None,
                    help="SFT learning rate (default: 3e-3; with --model 1e-5), batch 32 (with --model 8)")
    ap.add_argument("--rl-steps", type=int, default=30, help="RL steps (0: the SFT models only)")
    ap.add_argument("--rl-lr", type=float, default=None, help="the RL learning rate (default: the YAML's)")
    ap.add_argument("--skip-rate", type=float, default=SKIP_RATE,
                    help="share of demonstrations that answer without the tool, off by one (default: %(default)s)")
    ap.add_argument("--skip-kinds", nargs="*", default=list(SKIP_KINDS), choices=KINDS,
                    help="kinds of problem the demonstrator may skip the tool on (default: %(default)s)")
    ap.add_argument("--n-train", type=int, default=1500)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, the demonstrations, the SFT and the RL run")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for the RL run")
    ap.add_argument("--out", default=str(OUT), help="output folder (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-direct", action="store_true", help="skip the SFT without a tool")
    ap.add_argument("--reuse-sft", action="store_true", help="load the SFT models a previous run saved")
    add_model_options(ap, MAX_NEW_TOKENS)
    args = ap.parse_args()
    if args.sft_steps is None:
        args.sft_steps = 0 if args.model else 300
    if args.sft_lr is None:
        args.sft_lr = 1e-5 if args.model else 3e-3
    torch.set_num_threads(args.threads)
    OUT = Path(args.out).resolve()
    t0 = time.time()
    from rlhflab.models.load import load_model

    train, test = make_data(args.n_train, args.n_test, args.level)
    write_jsonl(train, OUT / "train.jsonl")
    write_jsonl(test, OUT / "test.jsonl")
    if args.model:
        return run_real(args, train, test, OUT, real_model, print_real, lambda: time.time() - t0)
    demo_rows = demonstrations(train, args.seed, args.skip_rate, args.skip_kinds)
    base = OUT / "base" if args.reuse_sft else make_base(OUT / "base", train, args.seed)
    results = {}
    for name, tools in (("sft_direct", False), ("sft_tool", True)):
        if name == "sft_direct" and args.no_direct:
            continue
        if args.reuse_sft and (OUT / name / "config.json").exists():
            model, tok = load_model(str(OUT / name))
        else:
            print(f"{name}: SFT on {len(demo_rows)} demonstrations ({'with' if tools else 'without'} the tool)",
                  flush=True)
            model, tok = sft(base, demo_rows, tools, args.sft_steps, args.seed, log=print, lr=args.sft_lr)
            model.save_pretrained(OUT / name)
            tok.save_pretrained(OUT / name)
        results[name] = evaluate(model, tok, test, tools)
        print(f"  {name}: {results[name]['accuracy']:.0%}", flush=True)
    if args.rl_steps:
        print(f"RL: rlhflab {args.method} --config examples/calculator/{args.method}.yaml ({args.rl_steps} steps)",
              flush=True)
        cmd = [sys.executable, "-m", "rlhflab", args.method, "--config", str(HERE / f"{args.method}.yaml"),
               *rl_overrides(OUT, args.method, args.rl_steps, args.threads, args.seed)]
        cmd += args.set
        if args.rl_lr is not None:
            cmd.append(f"{args.method}.learning_rate={args.rl_lr}")
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        model, tok = load_model(str(OUT / args.method / "final"))
        results["rl"] = evaluate(model, tok, test, True)

    print(f"\ncalculator example: {len(test)} held-out word problems (add, subtract, multiply, divide; "
          f"{args.level} level), greedy, tiny ChatML model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          "parameters)")
    print(f"{'model':<56} {'accuracy':>8} {'calls/ep':>8} {'tool errors':>11} {'turns':>6}")
    skipped = " and ".join(args.skip_kinds)
    rows = [("SFT on worked answers, no tool", "sft_direct"),
            (f"SFT on tool demonstrations ({args.skip_rate:.0%} of {skipped} skip it)", "sft_tool"),
            (f"  then {args.method.upper()}, {args.rl_steps} steps, with the tool", "rl")]
    for label, key in rows:
        if key in results:
            r = results[key]
            print(f"{label:<56} {r['accuracy']:>8.0%} {r['calls']:>8.2f} {r['errors']:>11.0%} {r['turns']:>6.2f}")
    print(f"({time.time() - t0:.0f} s)")
    results["args"] = vars(args)
    (OUT / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {OUT / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
