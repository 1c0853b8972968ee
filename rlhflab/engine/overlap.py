"""The separate critic's pass beside the policy's, on a CPU: two threads, half the rows at a time.

With `model.critic: separate` a minibatch takes two forward+backward passes that share
nothing: the critic's (values, value loss) and the policy's (log-probs, policy loss).
On a GPU they queue on one device anyway. On a CPU each pass is a long chain of small
operators (norms, rotary embeddings, attention over a few dozen positions, residual
adds): every one of them is split over torch's threads, and the threads meet at the end
of each, so for the small operators the second core mostly waits. Run instead one pass
on each core, one thread each, and both cores compute all the time.

`side_by_side(first, second)` runs `second` in a worker thread and `first` in the
calling thread, torch's intra-op threads divided between them (n → n − n//2 and n//2),
and restores the caller's thread count afterwards. `split_rows(mb)` cuts a minibatch
into two row halves (whole groups of `group_size` rows). The engine
(`engine.update`) runs, for each half in turn, the policy's pass in the calling
thread and the critic's in the worker:

    policy(h₁) ∥ critic(h₁)   then   policy(h₂) ∥ critic(h₂)

Each loss is divided by the whole accumulation group's count (as for any minibatch), so
the two halves' gradients sum to the minibatch's: the same gradients up to float
rounding. Peak memory: at most half a minibatch of each model's activations alive at
once, as much as one model's whole minibatch when they run one after the other
(`engine.update.critic_pass`), not both.

It applies (`applies`) where it can only help: a CPU, a separate critic in one process
(the condition of `critic_pass`), at least 2 torch threads, at least 2 groups of rows,
and `model.critic_overlap: true` (the default). bench/ppo_throughput.py measures it
(docs/actor_critic.md has the figures). On a real model it earns its default: with
SmolLM2-135M-Instruct's separate critic (configs/ppo_smollm2_critic.yaml, 8 episodes a
step, 2 threads, the Intel Xeon of docs/cpu_matmul.md under load) a PPO step took 0.775 of
the time it takes with the passes one after the other, for 7% more peak resident memory
(bench/cpu_tricks.py; docs/cpu_matmul.md, "Each CPU trick on a real model").

Dropout: rlhflab sets every model dropout to 0; a LoRA adapter's dropout (`lora.dropout`)
draws from torch's global generator, and draws from two threads interleave in no fixed
order, so a policy with LoRA dropout keeps the one-after-the-other order (`draws_random`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Callable, TypeVar

import torch
from torch import Tensor, nn

from rlhflab.engine.minibatch import MiniBatch

A = TypeVar("A")
B = TypeVar("B")

_worker: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (the process id, its pool)


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread for the process, started at the first use and kept (its OpenMP
    team, if it has one, is then made once). A forked child, which has no copy of the
    thread, starts its own."""
    global _worker
    if _worker is None or _worker[0] != os.getpid():
        _worker = (os.getpid(), concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlhflab-critic"))
    return _worker[1]


def draws_random(module: nn.Module) -> bool:
    """True when a forward pass of `module` in training mode draws random numbers: a
    dropout layer (a LoRA adapter's included) with p > 0."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in module.modules())


def applies(actor, mb: MiniBatch) -> bool:
    """Whether the critic's pass runs beside the policy's for this minibatch (module
    docstring); the caller has checked `engine.update.critic_apart`."""
    critic = getattr(actor, "critic", None)
    return (bool(getattr(actor, "critic_overlap", False)) and critic is not None
            and mb.response_ids.device.type == "cpu" and torch.get_num_threads() >= 2
            and len(mb) >= 2 * mb.group_size
            and not draws_random(actor.policy) and not draws_random(critic))


def split_rows(mb: MiniBatch, parts: int = 2) -> list[MiniBatch]:
    """`mb` cut into `parts` row blocks of whole groups, as equal as they come; every
    (b, T') tensor is cut along its rows, the prompt tensors (one row per group when
    group_size > 1) along theirs. Columns are kept (the halves stay padded to the
    minibatch's width, which changes no result: padding is masked). The LM batch of
    PPO-ptx, when there is one, goes with the first block at its full weight."""
    k = mb.group_size
    groups = len(mb) // k
    if groups < parts:
        raise ValueError(f"split_rows: {groups} group(s) of rows cannot make {parts} parts")
    bounds = [round(i * groups / parts) for i in range(parts + 1)]
    out = []
    for i in range(parts):
        g0, g1 = bounds[i], bounds[i + 1]
        rows = slice(g0 * k, g1 * k)
        prompt_rows = slice(g0, g1) if k > 1 else rows
        fields = {}
        for f in dataclasses.fields(mb):
            v = getattr(mb, f.name)
            if isinstance(v, Tensor):
                v = v[prompt_rows] if f.name in ("prompt_ids", "prompt_mask") else v[rows]
            fields[f.name] = v
        if i > 0:
            fields["lm_batch"], fields["lm_weight"] = None, 0.0
        out.append(MiniBatch(**fields))
    return out


def side_by_side(first: Callable[[], A], second: Callable[[], B]) -> tuple[A, B]:
    """(first(), second()), `second` in the worker thread while `first` runs here, with
    torch's intra-op threads divided between the two (this thread keeps n − n//2, the
    worker takes n//2) and this thread's count restored after. Both have finished when
    this returns; an exception of `first` wins over one of `second`. Grad mode is carried
to the worker; other thread-local state (autocast, the profiler) is not."""
    n = torch.get_num_threads()
    mine, theirs = n - n // 2, max(1, n // 2)
    grad = torch.is_grad_enabled()  # thread-local, as autocast is (the critic enters its own)

    def run_second() -> B:
        torch.set_num_threads(theirs)  # the worker thread's own count (OpenMP keeps one per thread)
        with torch.set_grad_enabled(grad):
            return second()

    torch.set_num_threads(mine)
    try:
        future = _pool().submit(run_second)
        try:
            a = first()
        finally:
            concurrent.futures.wait([future])  # never leave the worker computing on shared state
        return a, future.result()
    finally:
        torch.set_num_threads(n)
