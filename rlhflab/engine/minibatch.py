"""A minibatch: rows of a rollout ready for one forward and backward pass.

Columns that are padding in every selected row are dropped (prompts are left-padded,
responses right-padded), so a minibatch of short responses costs what they cost.
When the rows come in whole groups of ``group_size`` answers to one prompt (GRPO,
RLOO) and the layout is shared, the prompt is kept once per group and the forward pass
runs it once (`models.layout.shared_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.rollout import Rollout


def groups_share_prompt(prompt_ids: Tensor, prompt_mask: Tensor, k: int) -> bool:
    """True when rows [g·k, (g+1)·k) hold the same prompt for every g. (B, P) each."""
    b = prompt_ids.shape[0]
    if k < 2 or b % k:
        return False
    ids, mask = prompt_ids.view(b // k, k, -1), prompt_mask.view(b // k, k, -1)
    return bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())


def loss_mask_of(roll: Rollout, mask_truncated: bool) -> Tensor:
    """response_mask, with every token of a truncated (no EOS) response set to 0 when asked. (B, T)."""
    mask = roll.response_mask
    if mask_truncated:
        mask = mask * (~roll.hit_limit).to(mask.dtype).unsqueeze(1).to(mask.device)
    return mask


@dataclass
class MiniBatch:
    """Rows of a rollout, trimmed. Every (b, T') tensor is aligned with `response_ids`."""

    prompt_ids: Tensor             # (b, P'), or (b/k, P') with one row per group when group_size k > 1
    prompt_mask: Tensor            # same shape as prompt_ids
    response_ids: Tensor           # (b, T')
    response_mask: Tensor          # (b, T') 1 on real response tokens
    loss_mask: Tensor              # (b, T') response_mask, truncated responses zeroed when asked
    group_size: int = 1
    advantages: Tensor | None = None
    old_logprobs: Tensor | None = None     # None: the update's own detached log-probs (one optimizer step)
    ref_logprobs: Tensor | None = None
    returns: Tensor | None = None
    old_values: Tensor | None = None
    sample_logprobs: Tensor | None = None  # the sampler's own log-probs (vLLM), for the mismatch correction
    measure_gap: bool = False              # a pass on the sampling weights: log rollout/logprob_gap from it
    lm_batch: dict | None = None           # PPO-ptx: an LM batch whose loss joins this minibatch's
    lm_weight: float = 0.0                 # ... with this weight (its share of the group's mean)
    response_attention_mask: Tensor | None = None  # (b, T') multi-turn: context tokens attended too
    layout: str = "padded"                 # the decoder's layout: padded, packed or shared (`models.layout`)

    @property
    def layout_kw(self) -> dict:
        """The forward's `layout` keyword: empty for padded (every forward's default)."""
        return {} if self.layout == "padded" else {"layout": self.layout}

    @property
    def attend_mask(self) -> Tensor:
        """(b, T') the response part's attention mask for the forward: multi-turn episodes
        attend to the environment's tokens, which `response_mask` (the action mask) leaves
        out; single-turn it is `response_mask` itself."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    # The full-sequence view (prompt repeated for each row): what learner mode's exercises read.
    @property
    def _row_prompts(self) -> tuple[Tensor, Tensor]:
        k = self.group_size
        if k == 1:
            return self.prompt_ids, self.prompt_mask
        return self.prompt_ids.repeat_interleave(k, 0), self.prompt_mask.repeat_interleave(k, 0)

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self._row_prompts[0], self.response_ids], 1)                  # (b, P'+T')

    @property
    def attention_mask(self) -> Tensor:
        pm = self._row_prompts[1]
        return torch.cat([pm, self.attend_mask.to(pm.dtype)], 1)

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    def __getitem__(self, key: str):
        """`mb["advantages"]`: the mapping view learner-mode code uses."""
        if key.startswith("_") or not hasattr(self, key):
            raise KeyError(key)
        return getattr(self, key)

    @classmethod
    def from_mapping(cls, mb) -> "MiniBatch":
        """A MiniBatch from the full-sequence mapping view (input_ids, attention_mask,
        prompt_len, response_ids, response_mask, old_logprobs, advantages, ...), as
        learner mode's exercises and cases write it; a MiniBatch is returned as it is."""
        if isinstance(mb, cls):
            return mb
        p = mb["prompt_len"]
        get = mb.get
        return cls(prompt_ids=mb["input_ids"][:, :p], prompt_mask=mb["attention_mask"][:, :p],
                   response_ids=mb["response_ids"], response_mask=mb["response_mask"],
                   loss_mask=get("loss_mask") if get("loss_mask") is not None else mb["response_mask"],
                   advantages=get("advantages"), old_logprobs=get("old_logprobs"),
                   ref_logprobs=get("ref_logprobs"), returns=get("returns"), old_values=get("old_values"))

    def keys(self) -> list[str]:
        return ["input_ids", "attention_mask", "prompt_len", "response_ids", "response_mask", "loss_mask",
                "advantages", "old_logprobs", "ref_logprobs", "returns", "old_values"]


def select(roll: Rollout, rows: Tensor, loss_mask: Tensor, group_size: int = 1, layout: str = "padded") -> MiniBatch:
    """`rows` of `roll` as a MiniBatch; with `group_size` k > 1 the rows must be whole
    groups in order (k consecutive rows per prompt) and each prompt is kept once.
    `layout`: how its forward lays the rows out (padded or packed)."""
    prompt_rows = rows[::group_size] if group_size > 1 else rows
    pm = roll.prompt_mask[prompt_rows]
    rm = roll.response_mask[rows]
    p_keep = int(pm.sum(0).nonzero().min()) if pm.any() else pm.shape[1] - 1
    t_keep = int(rm.sum(0).nonzero().max()) + 1 if rm.any() else 1

    def cut(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[rows, :t_keep]

    return MiniBatch(
        prompt_ids=roll.prompt_ids[prompt_rows, p_keep:], prompt_mask=pm[:, p_keep:],
        response_ids=cut(roll.response_ids), response_mask=rm[:, :t_keep], loss_mask=cut(loss_mask),
        group_size=group_size, advantages=cut(roll.advantages), old_logprobs=cut(roll.logprobs),
        ref_logprobs=cut(roll.ref_logprobs), returns=cut(roll.returns), old_values=cut(roll.values),
        sample_logprobs=cut(getattr(roll, "sample_logprobs", None)),
        response_attention_mask=cut(getattr(roll, "response_attention_mask", None)), layout=layout)


# --------------------------------------------------------------------------------------
# Token budgets: micro-batches of at most `mini_batch_tokens` real tokens
# --------------------------------------------------------------------------------------
def sequence_tokens(roll: Rollout, rows: Tensor, group_size: int = 1) -> list[int]:
    """The real tokens (prompt plus response, no padding) of each unit of `rows`: a row, or
    with `group_size` k > 1 a group of k consecutive rows, whose shared prompt counts once
    (the pass computes it once). Multi-turn rows count the environment's tokens too (the
    pass attends to them)."""
    plen = roll.prompt_mask[rows].sum(1)                                            # (n,)
    rlen = roll.attend_mask[rows].sum(1)                                            # (n,)
    if group_size == 1:
        return (plen + rlen).tolist()
    k = group_size
    return (plen.view(-1, k)[:, 0] + rlen.view(-1, k).sum(1)).tolist()            # (n/k,)


def cut_by_tokens(tokens: list[int], budget: int, parts: int = 0) -> list[list[int]]:
    """Units 0..n-1 in this order, in consecutive micro-batches of at most `budget` tokens:
    a unit joins the current micro-batch while the sum stays within the budget, else it
    starts the next one; a unit longer than the budget gets a micro-batch of its own.

    `parts`: then split the micro-batch of most tokens (of two units or more) in two, at
    the unit that halves its tokens best, until there are `parts`: every rank of a
    distributed run must make the same number of passes (`Dist.max` of the counts)."""
    cut: list[list[int]] = []
    held = budget + 1  # no micro-batch open yet
    for u, n in enumerate(tokens):
        if held + n > budget:
            cut.append([])
            held = 0
        cut[-1].append(u)
        held += n
    while len(cut) < parts:
        splittable = [i for i, mb in enumerate(cut) if len(mb) > 1]
        if not splittable:
            raise ValueError(f"cut_by_tokens: {len(tokens)} units cannot make {parts} micro-batches")
        i = max(splittable, key=lambda i: (sum(tokens[u] for u in cut[i]), -i))
        mb = cut[i]
        total, prefix, best, where = sum(tokens[u] for u in mb), 0, None, 1
        for j in range(1, len(mb)):
            prefix += tokens[mb[j - 1]]
            gap = abs(2 * prefix - total)
            if best is None or gap < best:
                best, where = gap, j
        cut[i : i + 1] = [mb[:where], mb[where:]]
    return cut


def token_micro_batches(roll: Rollout, rows: Tensor, budget: int, group_size: int = 1, *,
                        longest_first: bool = True, parts: int = 0) -> list[Tensor]:
    """`rows` (whole groups of `group_size` in order) as micro-batches of at most `budget`
    real tokens each (`sequence_tokens`, `cut_by_tokens`): the units from the longest to the
    shortest (stable), so that each micro-batch holds sequences of like lengths and a padded
    pass pads little, or in the order given (`longest_first=False`). Groups stay whole."""
    k = group_size
    units = rows.view(-1, k)                                                        # (n/k, k)
    tokens = sequence_tokens(roll, rows, k)
    order = sorted(range(len(tokens)), key=lambda u: -tokens[u]) if longest_first else list(range(len(tokens)))
    cut = cut_by_tokens([tokens[u] for u in order], budget, parts)
    return [units[torch.tensor([order[j] for j in mb], device=rows.device)].reshape(-1) for mb in cut]
