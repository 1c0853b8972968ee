"""llama.cpp as the judge: the held-out accuracy of an exported GGUF file, measured by the
runtime itself, next to `rlhflab eval`'s on the trained folder.

    python scripts/check_runtime.py --gguf smol-f16.gguf --model outputs/run/final \
        --data outputs/arith/test.jsonl [--template T] [--correct module:function] [--limit 200] \
        [--max-new-tokens 32] [--build]

The runtime is llama-cpp-python (llama.cpp's Python binding, the `llama-cpp` extra). It
is looked for first; `--build` installs it (`pip install llama-cpp-python==0.3.36`, which
builds llama.cpp from source: minutes) when it is missing. Each held-out question is
shown as `rlhflab eval` shows it (the task's template, in one user turn) and the file's
own chat template renders the turn (llama.cpp's `create_chat_completion`); decoding is
greedy (temperature 0, top_k 1), stopping at the file's end-of-turn token. The answers
are graded by the rule `rlhflab eval` uses (--correct, else the GSM8K-style final number).

The script prints both accuracies and their difference in points, and how many of the
rendered prompts equal the ones rlhflab renders (they should all). Exit status 0 when
the two are within --tolerance points (default 2), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP = "llama-cpp-python==0.3.36"


def find_llama_cpp(build: bool):
    try:
        import llama_cpp
        return llama_cpp
    except ImportError:
        if not build:
            sys.exit(f"llama-cpp-python is not installed; pip install {LLAMA_CPP} (it builds llama.cpp: minutes), "
                     f"or run this script with --build")
    print(f"building {LLAMA_CPP} (llama.cpp from source; minutes)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", LLAMA_CPP], check=True)
    import llama_cpp
    return llama_cpp


def folder_accuracy(args) -> float:
    cmd = [sys.executable, "-m", "rlhflab", "eval", "--model", args.model, "--data", args.data, "--template",
           args.template, "--max-new-tokens", str(args.max_new_tokens), "--max-prompt-length", "256"]
    cmd += (["--limit", str(args.limit)] if args.limit else []) + (["--correct", args.correct] if args.correct else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    m = re.search(r"^accuracy\s+([0-9.]+)", out.stdout, re.M)
    if out.returncode != 0 or m is None:
        sys.exit(f"rlhflab eval failed:\n{out.stdout}\n{out.stderr}")
    return float(m.group(1))


def runtime_accuracy(llama_cpp, args) -> tuple[float, int, int]:
    from transformers import AutoTokenizer

    from rlhflab.evaluate import EvalChecks, judge, load_function

    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    rows = rows[:args.limit] if args.limit else rows
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=512, n_threads=args.threads, verbose=False, seed=0)
    tok = AutoTokenizer.from_pretrained(args.model)  # only to compare the rendered prompts
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    meta = llm.metadata
    eos = llm._model.token_get_text(llm.token_eos())
    bos = llm._model.token_get_text(llm.token_bos())
    fmt = Jinja2ChatFormatter(template=meta["tokenizer.chat_template"], eos_token=eos, bos_token=bos)
    same_prompt, prompts, answers = 0, [], []
    for row in rows:
        msgs = [{"role": "user", "content": args.template.replace("{prompt}", row["question"])}]
        same_prompt += fmt(messages=msgs).prompt == tok.apply_chat_template(msgs, tokenize=False,
                                                                            add_generation_prompt=True)
        out = llm.create_chat_completion(messages=msgs, max_tokens=args.max_new_tokens, temperature=0.0, top_k=1,
                                         seed=0)
        prompts.append(msgs[0]["content"])
        answers.append(out["choices"][0]["message"]["content"] or "")
    checks = EvalChecks(load_function(args.correct), args.correct) if args.correct else None
    right = judge(checks, prompts, answers, rows)  # rlhflab eval's rule: --correct, else the GSM8K checker
    return sum(right) / len(rows), same_prompt, len(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True, help="the exported .gguf file")
    p.add_argument("--model", required=True, help="the trained folder it was exported from")
    p.add_argument("--data", required=True, help="held-out rows (jsonl with question and answer)")
    p.add_argument("--limit", type=int, default=None, help="first N rows only")
    from rlhflab.data.arith import PROMPT_TEMPLATE

    p.add_argument("--template", default=PROMPT_TEMPLATE, help="how a question is shown, as rlhflab eval's --template")
    p.add_argument("--correct", default=None, help="module:function grading an answer, as rlhflab eval's --correct")
    p.add_argument("--max-new-tokens", type=int, default=32, help="longest answer, as rlhflab eval's (default 32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=2.0, help="points (default 2)")
    p.add_argument("--build", action="store_true", help=f"pip install {LLAMA_CPP} when it is missing")
    args = p.parse_args(argv)
    llama_cpp = find_llama_cpp(args.build)
    runtime, same, n = runtime_accuracy(llama_cpp, args)
    folder = folder_accuracy(args)
    gap = 100 * (runtime - folder)
    print(f"held-out accuracy ({n} prompts, greedy, {args.max_new_tokens} new tokens)")
    print(f"  llama.cpp {llama_cpp.__version__} on {Path(args.gguf).name}: {100 * runtime:.1f}%")
    print(f"  rlhflab's eval on {args.model}: {100 * folder:.1f}%")
    print(f"  difference: {gap:+.1f} points; prompts rendered alike by the file's chat template: {same} of {n}")
    return 0 if abs(gap) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
