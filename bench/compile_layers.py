"""A probe: the policy's update step with its decoder layers compiled (torch.compile, one
layer at a time) against eager, where kernel launches set the pace (a small model on a GPU).

    python bench/compile_layers.py --model-dir outputs/models/smollm2-135m-instruct
    python bench/compile_layers.py --model-dir DIR --random-init --device cuda --mixed-precision bf16
    python bench/compile_layers.py                  # the tiny model

One step is what rlhflab's update does for one minibatch: the response positions' hidden
states (`models.actor_critic.response_hidden`, prompts and responses in one pass), the
chunked log-probs through the LM head, a masked mean as the loss, backward, one AdamW step
(fused on a GPU). "compiled" wraps every decoder layer but the last in `torch.compile`
(`--dynamic`: shapes marked dynamic, as a run's changing response lengths would need; the
last layer keeps the eager MLP hook `last_layer_rows` sets) and swaps them in for the same
weights, so the two ways alternate on one model. `--onednn` (a CPU) adds a third way, eager
on a copy of the model whose linear layers are oneDNN's (`model.cpu_matmul: onednn`, which
the compiled layers cannot take: inductor does not lower them). `--random-init` builds the folder's
architecture (config.json alone) with random weights: the speed is the same, and a GPU
machine needs no checkpoint. Before timing, the log-probs of both ways are compared on one
batch. The last line:

    compile_layers: step ms eager X / compiled Y (Zx), first compiled step S s, gap G[, eager with oneDNN linears O]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from op_counts import count_ops  # noqa: E402
from packed_prompt import batch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="default: the tiny model, built in .bench/tiny-model")
    ap.add_argument("--random-init", action="store_true", help="the folder's architecture with random weights")
    ap.add_argument("--rows", type=int, default=32, help="episodes in the minibatch")
    ap.add_argument("--prompt-len", type=int, default=56)
    ap.add_argument("--response-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dynamic", action=argparse.BooleanOptionalAction, default=True,
                    help="compile with dynamic shapes (default) or for this batch's shape only")
    ap.add_argument("--lean-mlp", action="store_true",
                    help="rlhflab's lean MLP (model.lean_mlp, a training run's default) in both ways' layers")
    ap.add_argument("--onednn", action="store_true", help="a CPU: also eager with oneDNN's linear layers (a copy)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no",
                    help="bf16: the passes under bfloat16 autocast (float32 weights), as training.mixed_precision")
    a = ap.parse_args(argv)
    if a.onednn and a.device != "cpu":
        ap.error("--onednn: oneDNN's linear layers are a CPU setting; leave it out with --device cuda")
    from rlhflab.openmp import apply_default_wait

    apply_default_wait()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhflab.models.actor_critic import decoder_and_head, response_hidden
    from rlhflab.models.compiled import compiled_list
    from rlhflab.ops.chunked import chunked_logprobs

    torch.set_num_threads(a.threads)
    folder = a.model_dir or str(_common.ensure_tiny_model(_common.BENCH_DIR / "tiny-model"))
    if a.random_init:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.to(a.device).train()
    if a.lean_mlp:  # what a run's model.lean_mlp: true does (rlhflab/models/lean.py)
        from rlhflab.models.lean import lean_mlp

        lean_mlp(model)
    decoder, head = decoder_and_head(model)
    prompt_ids, prompt_mask, response_ids, response_mask = (
        x.to(a.device) for x in batch(a.rows, 1, a.prompt_len, a.response_len, model.config.vocab_size))
    eager = decoder.layers
    compiled = compiled_list(eager, dynamic=a.dynamic)  # what model.compile_layers swaps in
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=a.device == "cuda")
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    mask = response_mask.float()
    other = None
    if a.onednn:  # its own copy and optimizer: the compiled layers keep torch's linears
        import copy

        from rlhflab.models.cpu_matmul import use_fast_linears

        other = copy.deepcopy(model)
        use_fast_linears(other)
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-7)

    def logprobs(m=model):
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.mixed_precision == "bf16"):
            hidden = response_hidden(m, prompt_ids, prompt_mask, response_ids, response_mask)
        return chunked_logprobs(hidden, decoder_and_head(m)[1].weight, None, response_ids).logprobs

    def step(m=model, o=opt):
        o.zero_grad(set_to_none=True)
        (-(logprobs(m) * mask).sum() / mask.sum()).backward()
        o.step()

    def timed(layers) -> float:
        sync()
        t0 = time.perf_counter()
        if layers is None:
            step(other, other_opt)
        else:
            decoder.layers = layers
            step()
        sync()
        return time.perf_counter() - t0

    with torch.no_grad():
        decoder.layers = eager
        ref = logprobs()
        decoder.layers = compiled
        t0 = time.perf_counter()
        got = logprobs()
        sync()
        compile_fwd = time.perf_counter() - t0
    gap = ((got - ref).abs() * mask).max().item()
    ways = [("eager", eager), ("compiled", compiled)] + ([("eager-onednn", None)] if other is not None else [])
    first = {name: timed(layers) for name, layers in ways}  # the compiled one builds its backward here
    times = {name: [] for name, _ in ways}
    for _ in range(a.repeats):  # interleaved: the machine's load falls on every way alike
        for name, layers in ways:
            times[name].append(timed(layers))
    decoder.layers = eager
    ops = count_ops(step)
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    print(f"compile_layers: {folder}{' (random weights)' if a.random_init else ''}, {a.rows} rows of prompt "
          f"{a.prompt_len} + response {a.response_len} tokens, forward + backward + AdamW on {a.device} (mixed "
          f"precision {a.mixed_precision}), {a.threads} thread(s), {len(eager) - 1} of {len(eager)} layers compiled "
          f"{'(lean MLPs) ' if a.lean_mlp else ''}"
          f"({'dynamic' if a.dynamic else 'static'} shapes), {a.repeats} interleaved runs; eager step {ops} aten ops")
    print(f"{'way':<12} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'first s':>8}")
    for name, ts in times.items():
        print(f"{name:<12} {med[name]:>10.1f} {min(ts) * 1e3:>8.1f} {max(ts) * 1e3:>8.1f} {first[name]:>8.2f}")
    print(f"largest log-prob gap, compiled against eager, on the response tokens: {gap:.1e} nats "
          f"(the compiled forward's first call {compile_fwd:.1f} s)")
    onednn = f", eager with oneDNN linears {med['eager-onednn']:.1f}" if other is not None else ""
    print(f"compile_layers: step ms eager {med['eager']:.1f} / compiled {med['compiled']:.1f} "
          f"({med['eager'] / med['compiled']:.2f}x), first compiled step {compile_fwd + first['compiled']:.1f} s, "
          f"gap {gap:.1e}{onednn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
