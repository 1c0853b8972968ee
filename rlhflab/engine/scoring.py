"""Teacher-forced scoring of a rollout, without gradients: the sampling policy's
log-probs ("old" log-probs), the critic's values and the reference's log-probs.

Sampling produced the response tokens one at a time; here every token's log-prob comes
from one pass per micro-batch. The passes run whole groups when the rollout's rows
share prompts, so each prompt is computed once (`rlhflab.models.actor_critic`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rlhflab import cpu
from rlhflab.engine.dist import Dist
from rlhflab.engine.minibatch import MiniBatch, groups_share_prompt, select, token_micro_batches
from rlhflab.models import layout as layouts
from rlhflab.models.actor_critic import Reference, unwrap
from rlhflab.rollout import Rollout


def group_layout(roll: Rollout, model: nn.Module, layout: str = "padded", whole_groups: bool = True) -> tuple[str, int]:
    """(the layout a rollout's passes run with, the group size they take: 1 gives each row its
    own prompt). `layout` (`<method>.layout`): shared runs each group's prompt once where the
    rollout's rows come in groups asking one prompt (`whole_groups`: the passes never split a
    group), else packed; auto is shared on a CPU (`rlhflab.cpu.share_prompt`) where it can be,
    else padded; padded and packed as set."""
    k = roll.group_size
    grouped = whole_groups and k > 1 and groups_share_prompt(roll.prompt_ids, roll.prompt_mask, k)
    if layout == "auto":
        config = getattr(unwrap(model), "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        packs = config is None or layouts.refusal(config) is None
        on = grouped and packs and cpu.share_prompt(next(model.parameters()).device, "auto")
        return ("shared", k) if on else ("padded", 1)
    if layout == "shared":
        return ("shared", k) if grouped else ("packed", 1)
    return layout, 1


def row_order(roll: Rollout, k: int, by_length: bool) -> Tensor:
    """(B,) the rows in the order the micro-batches take them: as they are, or whole
    groups of k from the shortest to the longest (prompt plus response, real tokens), so
    that each micro-batch pads only to its own longest row."""
    b = len(roll)
    groups = torch.arange(b, device=roll.response_mask.device).view(-1, k)       # (B/k, k)
    if by_length and b > k:
        lengths = roll.prompt_mask.sum(1) + roll.response_mask.sum(1)              # (B,)
        groups = groups[lengths.view(-1, k).amax(1).argsort(stable=True)]
    return groups.reshape(-1)


def micro_batches(roll: Rollout, micro_batch: int, k: int, order: Tensor | None = None,
                  layout: str = "padded", mini_batch_tokens: int | None = None, dist: Dist | None = None,
                  ) -> list[MiniBatch]:
    """The rollout's rows in `order` (default: as they are), `micro_batch` rows at a time
    (whole groups of k), laid out as `layout` says. With `mini_batch_tokens`: instead, in
    that order, as many rows as fit in that many real tokens (`token_micro_batches`; a
    longer sequence alone); under several processes every rank makes as many passes as
    the rank that needs most (FSDP and ZeRO-3 passes communicate)."""
    mask = roll.response_mask
    if order is None:
        order = torch.arange(len(roll), device=mask.device)
    if mini_batch_tokens is not None:
        cut = token_micro_batches(roll, order, mini_batch_tokens, k, longest_first=False)
        if dist is not None and dist.distributed:
            n = int(dist.max(len(cut)))
            if n > len(cut):
                cut = token_micro_batches(roll, order, mini_batch_tokens, k, longest_first=False, parts=n)
        return [select(roll, rows, mask, k, layout) for rows in cut]
    micro = max(k, micro_batch - micro_batch % k)
    return [select(roll, order[s:s + micro], mask, k, layout) for s in range(0, len(roll), micro)]


def _pad_to(x: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


@torch.no_grad()
def score_rollout(actor, reference: Reference | None, roll: Rollout, *, temperature: float = 1.0,
                  micro_batch: int = 64, with_policy: bool = True, with_values: bool = False,
                  by_length: bool = True, old_logprobs: str = "recompute", layout: str = "padded",
                  mini_batch_tokens: int | None = None, dist: Dist | None = None) -> Rollout:
    """Fill roll.logprobs (the policy as it is now), roll.values (`with_values`) and
    roll.ref_logprobs (when a reference is given); each (B, T), 0 on padding.

    `old_logprobs="sampler"` (`generation.old_logprobs`): roll.logprobs are the sampler's
    own (`roll.sample_logprobs`) and the policy's pass is skipped; values, when asked,
    come from a pass without the LM head (or from the separate critic alone).

    With more rows than `micro_batch`, the passes take the rows from the shortest to the
    longest (`by_length`): one long answer then pads only its own micro-batch. The rows
    come back in the rollout's order; each row's numbers are those of a pass over it alone
    (to float rounding). `layout` (`<method>.layout`): padded, packed, shared (a group's
    prompt once) or auto decoder passes (`group_layout`), the same numbers to float rounding
    (`rlhflab.models.layout`). `mini_batch_tokens` (`<method>.mini_batch_tokens`):
    micro-batches of at most that many real tokens instead of `micro_batch` rows
    (`micro_batches`; `dist`, this rank's place, keeps the ranks' pass counts equal)."""
    from_sampler = with_policy and old_logprobs == "sampler"
    if from_sampler:
        if roll.sample_logprobs is None:
            from rlhflab.errors import UserError
            raise UserError("generation.old_logprobs: sampler, but the rollout came without the sampler's "
                            "log-probs; set generation.old_logprobs: recompute")
        with_policy = False
    layout, k = group_layout(roll, actor.policy, layout)
    width = roll.response_ids.shape[1]
    order = row_order(roll, k, by_length)
    lps, vals, refs = [], [], []
    for mb in micro_batches(roll, micro_batch, k, order, layout, mini_batch_tokens, dist):
        args = (mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.attend_mask, k)  # attention: context too
        if with_policy or with_values:
            values_only = {} if with_policy else {"with_logprobs": False}
            out = actor(*args, temperature=temperature, with_values=with_values, **values_only, **mb.layout_kw)
            if with_policy:
                lps.append(_pad_to(out.logprobs, width))
            if with_values:
                vals.append(_pad_to(out.values, width))
        if reference is not None:
            refs.append(_pad_to(reference.logprobs(*args, temperature=temperature, **mb.layout_kw), width))
    mask = roll.response_mask.float()

    def in_rollout_order(parts: list[Tensor]) -> Tensor:
        out = torch.empty_like(mask, dtype=parts[0].dtype)
        out[order] = torch.cat(parts)
        return out * mask

    if with_policy:
        roll.logprobs = in_rollout_order(lps)
    elif from_sampler:
        roll.logprobs = roll.sample_logprobs * mask
        roll.old_from_sampler = True
    if with_values:
        roll.values = in_rollout_order(vals)
    roll.ref_logprobs = in_rollout_order(refs) if reference is not None else None
    return roll
