"""A probe: one packed decoder pass per group, against the two passes of `grpo.share_prompt`.

    python bench/packed_prompt.py --model-dir outputs/models/smollm2-135m-instruct
    python bench/packed_prompt.py                  # the tiny model

`grpo.share_prompt` (models.actor_critic.response_hidden with group_size k) runs the
decoder twice per group: over the prompt with a cache, then over the k responses on it.
That halves the FLOPs of a group's prompt tokens and doubles the operators dispatched
(bench/op_counts.py), which is what a GPU pays for at a small model's size. The packed
pass puts a group in one row, [prompt, response 1, ..., response k], with a 4-D mask that
lets each response see the prompt and its own earlier tokens only, and position ids that
restart after the prompt for each response: the shared pass's FLOPs in one pass.

This script is a measurement, not a library path: it checks that the packed pass gives the
hidden states of the plain pass (group_size 1) within rounding, then times
forward + backward of the three ways on random token ids (G prompts x k responses, left-
padded prompts, right-padded responses) and counts the aten ops each dispatches. The last
line:

    packed_prompt: ms plain X / shared Y / packed Z, ops plain A / shared B / packed C
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


def packed_response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size: int):
    """Hidden states (B, T, H) that predict each response token, from one decoder pass over
    G rows of [prompt (P, left-padded), response inputs 1..k (T-1 each)]. Arguments as
    `response_hidden`'s with group_size k > 1: prompts (G, P), responses (B = G k, T)."""
    import torch

    from rlhflab.models.actor_critic import _last_hidden, decoder_and_head, last_layer_rows, position_ids_from

    decoder, _ = decoder_and_head(model)
    k, (g, p), t = group_size, prompt_ids.shape, response_ids.shape[1]
    r = t - 1                                                                # response inputs per row
    dev = prompt_ids.device
    ids = torch.cat([prompt_ids, response_ids[:, :-1].reshape(g, k * r)], 1)  # (G, L)
    n = p + k * r
    block = torch.cat([torch.full((p,), -1, device=dev), torch.arange(k, device=dev).repeat_interleave(r)])
    index = torch.cat([torch.arange(p, device=dev), torch.arange(r, device=dev).repeat(k)])
    valid = torch.cat([prompt_mask.bool(), response_mask[:, :-1].bool().reshape(g, k * r)], 1)  # (G, L)
    q_blk, kv_blk = block[:, None], block[None, :]
    q_idx, kv_idx = index[:, None], index[None, :]
    same = (q_blk == kv_blk) & (kv_idx <= q_idx)                             # causal inside a block
    to_prompt = (kv_blk == -1) & (q_blk >= 0)                                # a response sees the prompt
    allowed = (same | to_prompt)[None] & valid[:, None, :]                   # (G, L, L)
    allowed = allowed | torch.eye(n, dtype=torch.bool, device=dev)[None]    # padding rows see themselves
    pos = position_ids_from(prompt_mask)                                     # (G, P)
    rpos = pos[:, -1:] + 1 + torch.arange(r, device=dev).repeat(k)[None]    # (G, k r)
    with last_layer_rows(model, decoder, p - 1):
        hidden = _last_hidden(decoder(input_ids=ids, attention_mask=allowed[:, None], position_ids=torch.cat(
            [pos, rpos], 1), use_cache=False))                              # (G, L, H)
    first = hidden[:, p - 1:p].repeat_interleave(k, dim=0)                   # (B, 1, H): predicts token 0
    rest = hidden[:, p:].reshape(g * k, r, hidden.shape[-1])                 # (B, T-1, H)
    return torch.cat([first, rest], 1)


def batch(g: int, k: int, p: int, t: int, vocab: int, seed: int = 0):
    """Random ids: G left-padded prompts (pads of 0-p/4 tokens), G k right-padded responses
    (lengths t/2..t); the response mask is the rows' real tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (g, p), generator=gen)
    pad = torch.randint(0, p // 4 + 1, (g,), generator=gen)
    prompt_mask = (torch.arange(p)[None] >= pad[:, None]).long()
    response_ids = torch.randint(3, vocab, (g * k, t), generator=gen)
    lengths = torch.randint(t // 2, t + 1, (g * k,), generator=gen)
    response_mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return prompt_ids, prompt_mask, response_ids, response_mask


def ways(model, prompt_ids, prompt_mask, response_ids, response_mask, k: int):
    """name -> a function giving the (B, T, H) hidden states."""
    from rlhflab.models.actor_critic import response_hidden

    plain_p, plain_m = prompt_ids.repeat_interleave(k, 0), prompt_mask.repeat_interleave(k, 0)
    return {
        "plain": lambda: response_hidden(model, plain_p, plain_m, response_ids, response_mask, 1),
        "shared": lambda: response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, k),
        "packed": lambda: packed_response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, k),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="default: the tiny model, built in .bench/tiny-model")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=56)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no",
                    help="bf16: the passes under bfloat16 autocast (float32 weights), as training.mixed_precision")
    a = ap.parse_args(argv)
    from rlhflab.openmp import apply_default_wait

    apply_default_wait()
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    folder = a.model_dir or str(_common.ensure_tiny_model(_common.BENCH_DIR / "tiny-model"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.to(a.device).train()
    k = a.group_size
    inputs = [x.to(a.device) for x in batch(a.groups, k, a.prompt_len, a.response_len, model.config.vocab_size)]
    fns = ways(model, *inputs, k)
    mask_rows = inputs[3].bool()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def hidden(fn):  # the real response positions' states, under the run's precision
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.mixed_precision == "bf16"):
            return fn()[mask_rows].float()

    with torch.no_grad():
        out = {name: hidden(fn) for name, fn in fns.items()}
    scale = out["plain"].abs().max().item()
    gaps = {name: (out[name] - out["plain"]).abs().max().item() / scale for name in ("shared", "packed")}

    def fwd_bwd(fn):
        def run():
            model.zero_grad(set_to_none=True)
            hidden(fn).square().mean().backward()
        return run

    times = {name: [] for name in fns}
    for name, fn in fns.items():
        fwd_bwd(fn)()  # warm-up
    for _ in range(a.repeats):
        for name, fn in fns.items():  # interleaved: the machine's load falls on all alike
            sync()
            t0 = time.perf_counter()
            fwd_bwd(fn)()
            sync()
            times[name].append(time.perf_counter() - t0)
    ops = {name: count_ops(fwd_bwd(fn)) for name, fn in fns.items()}
    print(f"packed_prompt: {folder}, {a.groups} prompts x {k} responses, prompt {a.prompt_len} (left-padded), "
          f"response {a.response_len} tokens, forward + backward on {a.device} (mixed precision {a.mixed_precision}), "
          f"{a.threads} thread(s), {a.repeats} interleaved runs")
    print(f"largest gap to the plain pass, relative to its largest value: shared {gaps['shared']:.1e}, "
          f"packed {gaps['packed']:.1e}")
    print(f"{'pass':<8} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'aten ops':>9}")
    med = {}
    for name in fns:
        med[name] = statistics.median(times[name]) * 1e3
        print(f"{name:<8} {med[name]:>10.1f} {min(times[name]) * 1e3:>8.1f} {max(times[name]) * 1e3:>8.1f} "
              f"{ops[name]:>9}")
    print(f"packed_prompt: ms plain {med['plain']:.1f} / shared {med['shared']:.1f} / packed {med['packed']:.1f}, "
          f"ops plain {ops['plain']} / shared {ops['shared']} / packed {ops['packed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
