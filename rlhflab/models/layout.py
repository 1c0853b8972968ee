"""How a batch of prompt+response sequences is laid out for the decoder: `padded` or `packed`.

``padded`` (the default, what `actor_critic.response_hidden` has always run): one row per
sequence, prompts left-padded and responses right-padded, so every row pays for the
longest sequence of its batch.

``packed``: each sequence's real tokens (prompt, then response, no padding) are
concatenated into rows of at most a token budget (first-fit, longest first; `plan`'s
default and floor is the longest sequence; `response_hidden` asks for `row_budget`:
`ROW_TOKENS` under SDPA), position ids restart at 0 for every sequence, and attention
stays inside each sequence. Every packed pass hands the attention layers an explicit
block-diagonal causal mask (R, 1, W, W): boolean under SDPA, additive (0 / the dtype's
minimum) under eager; transformers 5 passes a 4D mask on as it is
(`masking_utils._preprocess_mask_arguments` returns early). Under eager that mask is what
runs. Under SDPA `attention(decoder)` runs each sequence's attention on its own instead
(`_per_sequence_sdpa`, registered in transformers' AttentionInterface: the sequences'
queries, keys and values gathered into a right-padded batch, causal SDPA, the same
numbers to rounding), so wide rows cost no attention work between sequences; the mask is
its fallback (a sliding layer whose window cuts, a recomputation outside the context).
The shared layout (a group's prompt once, its responses after it; `shared_plan`) runs
the same way: each response is a sequence of its group's prompt and its own tokens.
The all-ones 2D mask is never passed: with it transformers skips its own packed-sequence
detection (it only looks at position ids when no 2D mask is given) and packed sequences
would attend to each other.

The decoder's output is mapped back to (B, T, H): row b, column t holds the state that
predicts response token t (that of the sequence's token before it), zeros on padding, so
everything after the decoder (the heads, `ops/`, the losses) sees the padded shapes; the
LM head runs on the real response tokens only (`actor_critic.stats_for`).

Under FlashAttention (`flash_attention_2`/`_3`) no mask is built: the decoder gets the
sequences' boundaries (`cu_seq_lens_q/k`, `max_length_q/k`, the keywords transformers'
FlashAttention integration reads) and its varlen kernel keeps each sequence to itself,
sliding windows and soft caps included; the shared layout's tree is not a set of
contiguous sequences, so under FlashAttention it runs packed (each row its own prompt).
Other kernels (flex attention, hub kernels) are refused in one line. Attention sinks and
recurrent or linear-attention layers cannot be bounded to a sequence by a mask: refused. A sliding window is exact when
every sequence fits in it (the window then cuts nothing). Past it, a model whose decoder
takes a mask per layer type (transformers' ``{layer type: mask}`` mapping, as Gemma 3's
does) gets both: full-attention layers the block-diagonal causal mask, sliding layers the
same cut to the window (a position sees the last `window` positions of its own sequence);
any other model (one mask for all its layers, Mistral's) runs such a batch padded, with a
one-line note.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

LAYOUTS = ("padded", "packed")
FLASH = ("flash_attention_2", "flash_attention_3")  # varlen kernels: the boundaries, no mask
_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
_NOTED: set[str] = set()


@dataclass
class Packing:
    """A packed batch: the decoder's inputs and the map back to (B, T)."""

    input_ids: Tensor     # (R, W) the sequences' real tokens, each row left to right, 0 after its last
    position_ids: Tensor  # (R, W) 0 at each sequence's first token
    segments: Tensor      # (R, W) the sequence (row of the batch) each position holds, -1 on padding
    gather: Tensor        # (B, T) index into the R·W decoder states; R·W (a zero state) on padding

    def mask(self, kind: str, dtype: torch.dtype) -> Tensor:
        """(R, 1, W, W) block-diagonal causal mask: position i sees j <= i of its own
        sequence. A padding position sees itself only (a finite state no one reads).
        `kind` "bool" (SDPA: True = attend) or "additive" (eager: 0 or the dtype's minimum)."""
        seg = self.segments
        w = seg.shape[1]
        causal = torch.ones(w, w, dtype=torch.bool, device=seg.device).tril()
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
        own = torch.eye(w, dtype=torch.bool, device=seg.device) & (seg[:, :, None] < 0)
        allowed = ((same & causal) | own).unsqueeze(1)                              # (R, 1, W, W)
        if kind == "bool":
            return allowed
        zero = torch.zeros((), dtype=dtype, device=seg.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)

    def unpack(self, hidden: Tensor) -> Tensor:
        """(R, W, H) decoder states -> (B, T, H) states predicting each response token."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])                 # the zero state last
        return flat[self.gather]                                                    # (B, T, H)


def contiguous(prompt_mask: Tensor, response_mask: Tensor) -> bool:
    """True when every prompt's real tokens are a suffix of its row (left padding) and every
    response's a prefix (right padding): what packing reads. A multi-turn episode's
    `response_attention_mask` is a prefix (its action mask, with holes at the tools' and
    environment's tokens, is not): the engine passes the attention mask to the decoder
    pass and the losses read the action mask, so episodes pack."""
    p, t = prompt_mask.shape[1], response_mask.shape[1]
    plen, rlen = prompt_mask.sum(1, keepdim=True), response_mask.sum(1, keepdim=True)
    left = torch.arange(p, device=prompt_mask.device) >= p - plen
    right = torch.arange(t, device=response_mask.device) < rlen
    return bool((left == prompt_mask.bool()).all() and (right == response_mask.bool()).all())


def first_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Sequence indices in rows of at most `budget` tokens: longest first, each into the
    first row with room (first-fit decreasing). A sequence longer than the budget takes a
    row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(budget - lengths[i])
    return rows


def place(lengths: list[int], budget: int | None) -> tuple[int, int, Tensor, Tensor]:
    """Where each sequence (its token count in `lengths`; 0: left out) goes in rows of at most
    `budget` tokens (`first_fit`; default and floor: the longest): (rows, width, (B,) row of
    each, (B,) offset of each in its row)."""
    kept = [i for i, n in enumerate(lengths) if n > 0]
    rows = first_fit([lengths[i] for i in kept], max(budget or 0, max(lengths, default=0), 1))
    rows = [[kept[j] for j in row] for row in rows]
    width = max([sum(lengths[i] for i in row) for row in rows] or [1])
    row_of = torch.zeros(len(lengths), dtype=torch.long)
    off_of = torch.zeros(len(lengths), dtype=torch.long)
    for r, row in enumerate(rows):
        off = 0
        for i in row:
            row_of[i], off_of[i] = r, off
            off += lengths[i]
    return max(len(rows), 1), width, row_of, off_of


def plan(prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
         budget: int | None = None) -> Packing:
    """The packed layout of (B, P) left-padded prompts and (B, T) right-padded responses.

    Sequence b's input is its prompt's real tokens and its response's but the last (the
    last predicts nothing we use): plen_b + rlen_b - 1 positions; a sequence with an empty
    response is left out (no state of it is read). `budget`: the most tokens per row
    (default and floor: the longest sequence)."""
    b, p = prompt_ids.shape
    t = response_ids.shape[1]
    dev = prompt_ids.device
    plen, rlen = prompt_mask.sum(1).long(), response_mask.sum(1).long()             # (B,)
    if bool(((plen == 0) & (rlen > 0)).any()):
        raise ValueError("packed layout: a sequence with an empty prompt has no state to predict its first token")
    length = torch.where(rlen > 0, plen + rlen - 1, 0)                              # (B,)
    n_rows, width, row_of, off_of = place(length.tolist(), budget)
    row_of, off_of = row_of.to(dev), off_of.to(dev)
    seq = torch.repeat_interleave(torch.arange(b, device=dev), length)              # (N,) a sequence per slot
    first = torch.repeat_interleave(length.cumsum(0) - length, length)
    j = torch.arange(seq.numel(), device=dev) - first                               # position within its sequence
    dst = row_of[seq] * width + off_of[seq] + j
    src = seq * (p + t) + (p - plen)[seq] + j  # prompt real tokens then response tokens are contiguous
    tokens = torch.cat([prompt_ids, response_ids.to(prompt_ids.dtype)], 1).reshape(-1)
    ids = torch.zeros(n_rows * width, dtype=prompt_ids.dtype, device=dev)
    ids[dst] = tokens[src]
    pos = torch.zeros(n_rows * width, dtype=torch.long, device=dev)
    pos[dst] = j
    segments = torch.full((n_rows * width,), -1, dtype=torch.long, device=dev)
    segments[dst] = seq
    tt = torch.arange(t, device=dev)
    at = (row_of * width + off_of + plen - 1)[:, None] + tt                         # (B, T) state before token t
    gather = torch.where(tt < rlen[:, None], at, n_rows * width)
    return Packing(ids.view(n_rows, width), pos.view(n_rows, width), segments.view(n_rows, width), gather)


def note_once(key: str, text: str) -> None:
    """A one-line warning, once per process for each `key`."""
    if key not in _NOTED:
        _NOTED.add(key)
        warnings.warn(text, stacklevel=3)


def refusal(config) -> str | None:
    """Why a model with this (text) config cannot take the packed layout, in one line, or None."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager", *FLASH):
        return (f"layout: packed runs with attn_implementation sdpa, eager or flash_attention_2/3, not {impl}; "
                "set layout: padded or model.attn_implementation: sdpa")
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - _ATTENTION_LAYERS:
        return (f"layout: packed cannot bound {', '.join(sorted(kinds - _ATTENTION_LAYERS))} layers to one "
                f"sequence ({config.model_type}); set layout: padded")
    if getattr(config, "model_type", "") in ("gpt_oss",) or getattr(config, "attention_sinks", None):
        return f"layout: packed cannot keep attention sinks within a sequence ({config.model_type}); set layout: padded"
    return None


def sliding_window_of(config) -> int | None:
    """The model's attention window where some layer slides, else None."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return int(window) if "sliding_attention" in kinds else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def choose(model_config, layout: str, prompt_mask: Tensor, response_mask: Tensor) -> str:
    """The layout this batch runs with: `layout`, or padded where packing would not be exact
    (with a one-line note). An architecture that cannot take packing raises `UserError`."""
    if layout == "padded":
        return layout
    if layout != "packed":
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    why = refusal(model_config)
    if why is not None:
        from rlhflab.errors import UserError
        raise UserError(why)
    window = sliding_window_of(model_config)
    if window is not None:
        longest = int((prompt_mask.sum(1) + response_mask.sum(1)).max()) if len(prompt_mask) else 0
        if longest > window and not layer_masks_accepted(model_config):
            note_once(f"window{window}", f"layout: packed: a sequence of {longest} tokens is longer than the "
                      f"{window}-token sliding window and {model_config.model_type} takes one mask for all its "
                      "layers; such batches run padded")
            return "padded"
    if not contiguous(prompt_mask, response_mask):
        note_once("holes", "layout: packed: a batch whose masks are not left-padded prompts and right-padded "
                  "responses runs padded")
        return "padded"
    return "packed"


_MAPPING_CHECK = re.compile(r"isinstance\(\s*(\w+\s*:=\s*)?attention_mask\s*,\s*dict\s*\)")


@functools.lru_cache(maxsize=None)
def _forward_takes_mapping(cls: type) -> bool:
    try:
        return bool(_MAPPING_CHECK.search(inspect.getsource(cls.forward)))
    except (OSError, TypeError):
        return False


def layer_masks_accepted(config) -> bool:
    """Whether the decoder of this (text) config takes `attention_mask` as a {layer type:
    mask} mapping (its forward uses a dict as it is, one mask per `config.layer_types`
    entry: Gemma 2/3, Qwen2, Cohere 2... in transformers 5)."""
    if not getattr(config, "layer_types", None):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING
        cls = MODEL_MAPPING[type(config)]
    except (ImportError, KeyError, ValueError):
        return False
    return _forward_takes_mapping(cls)


def windowed(mask: Tensor, position_ids: Tensor, window: int) -> Tensor:
    """`mask` (R, 1, W, W), bool or additive, cut to the sliding window: position i keeps
    key j only where pos_i - pos_j < window (transformers' sliding-window rule). Within a
    sequence the positions count its tokens, so this works for any plan's mask."""
    near = (position_ids[:, :, None] - position_ids[:, None, :] < window).unsqueeze(1)   # (R, 1, W, W)
    if mask.dtype == torch.bool:  # the diagonal stays: pos_i - pos_i = 0 < window
        return mask & near
    return torch.where(near, mask, torch.finfo(mask.dtype).min)


# --------------------------------------------------------------------------------------
# Per-sequence attention under SDPA (registered with transformers' AttentionInterface)
# --------------------------------------------------------------------------------------
PER_SEQUENCE = "rlhflab_per_sequence_sdpa"


def sequence_index(packing: Packing) -> tuple[Tensor, Tensor, Tensor]:
    """The packed rows' sequences, right-padded, for attention one sequence at a time:
    (S, L) the slot in the flat R·W positions of each sequence's position l (0 past its end),
    (S, L) True on its real positions, and (S, L) True where its output is the slot's (each
    slot written once). Packed: a sequence per segment. Shared: a sequence per response row,
    its group's prompt then its own tokens; a prompt slot takes the output of its group's
    first row (every row of the group computes the same, from the same keys and values)."""
    seg, pos = packing.segments.reshape(-1), packing.position_ids.reshape(-1)
    slots = torch.arange(seg.numel(), device=seg.device)
    if isinstance(packing, SharedPacking):
        grp, prm = packing.group.reshape(-1), packing.prompt.reshape(-1)
        b, k = packing.gather.shape[0], packing.group_size
        resp = (seg >= 0) & ~prm
        rin = torch.bincount(seg[resp], minlength=b)                                # (B,) response inputs
        plen = torch.bincount(grp[prm], minlength=b // k)                           # (G,) 0: group left out
        row_plen = plen.repeat_interleave(k)                                        # (B,)
        lengths = torch.where(row_plen > 0, row_plen + rin, 0)
        index = torch.zeros(b, max(int(lengths.max()), 1), dtype=torch.long, device=seg.device)
        index[seg[resp], pos[resp]] = slots[resp]
        rows = (grp[prm][:, None] * k + torch.arange(k, device=seg.device)).reshape(-1)  # every row of its group
        index[rows, pos[prm].repeat_interleave(k)] = slots[prm].repeat_interleave(k)
        col = torch.arange(index.shape[1], device=seg.device)
        real = col < lengths[:, None]
        first_row = (torch.arange(b, device=seg.device) % k == 0)[:, None]
        return index, real, real & ((col >= row_plen[:, None]) | first_row)
    real = seg >= 0
    lengths = torch.bincount(seg[real], minlength=int(seg.max()) + 1 if bool(real.any()) else 1)
    index = torch.zeros(len(lengths), max(int(lengths.max()), 1), dtype=torch.long, device=seg.device)
    index[seg[real], pos[real]] = slots[real]
    real = torch.arange(index.shape[1], device=seg.device) < lengths[:, None]
    return index, real, real


def _per_sequence_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       packed_index=None, **kwargs):
    """transformers' attention-function signature. Each sequence's queries, keys and values
    are gathered from the packed rows into (S, heads, L, d), right-padded, and attend with
    causal SDPA (a right-padded sequence's real positions see only real ones), then go back
    to their slots: the block-diagonal mask's attention, without the work of the masked
    blocks between sequences. Without `packed_index`, or on a layer with a sliding window
    or a soft cap, the model's own SDPA with the given 4D mask runs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    window = kwargs.get("sliding_window")
    if packed_index is None or (window and packed_index[0].shape[1] > window) or kwargs.get("softcap"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    index, real, write = packed_index                                               # (S, L)
    r, heads, w, d = query.shape
    s, n = index.shape
    flat = index.reshape(-1)

    def gather(x: Tensor) -> Tensor:                                                # (R, h, W, d) -> (S, h, L, d)
        h = x.shape[1]
        return x.transpose(1, 2).reshape(r * w, h, d).index_select(0, flat).view(s, n, h, d).transpose(1, 2)

    q, k, v = gather(query), gather(key), gather(value)
    # grouped-query attention: query head i reads K/V head i // (heads / kv heads), which
    # SDPA does itself (`enable_gqa`), so K and V are not repeated (nor kept for the backward)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                           scale=scaling, enable_gqa=k.shape[1] != heads)  # (S, h, L, d)
    keep = write.reshape(-1)
    out = out.transpose(1, 2).reshape(s * n, heads, d)[keep]
    back = out.new_zeros(r * w, heads, d).index_copy(0, flat[keep], out)            # padding slots: zeros
    return back.view(r, w, heads, d), None


@contextmanager
def attention(decoder: nn.Module) -> Iterator[None]:
    """While inside, an SDPA decoder's attention layers run `_per_sequence_sdpa` (under our
    own name in transformers' AttentionInterface; every other implementation unchanged).
    Only the attention function's lookup changes: a pass without `packed_index` (padded, or
    a recomputation outside this context) runs SDPA with its mask, the same numbers."""
    config = decoder.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    from transformers import AttentionInterface

    if PER_SEQUENCE not in AttentionInterface._global_mapping:
        AttentionInterface.register(PER_SEQUENCE, _per_sequence_sdpa)
    config._attn_implementation_internal = PER_SEQUENCE  # the plain attribute: sub-configs untouched
    try:
        yield
    finally:
        config._attn_implementation_internal = "sdpa"


ROW_TOKENS = 2048  # per-sequence attention: rows this wide cost no attention work, a 4 MiB mask each


def row_budget(config) -> int | None:
    """The default row width of a packed pass: `ROW_TOKENS` where attention runs per
    sequence (SDPA, FlashAttention's varlen kernel), else None (the longest sequence: under
    eager the mask's (W, W) scores of every row are computed and kept, so rows stay short)."""
    return ROW_TOKENS if getattr(config, "_attn_implementation", None) in ("sdpa", *FLASH) else None


def flash_inputs(packing: Packing) -> dict:
    """FlashAttention's varlen keywords for the packed rows read as one flat sequence of R·W
    positions: every sequence a run of its own, and each row's padding tail one more (its
    states are never read)."""
    seg = packing.segments.reshape(-1)
    n = seg.numel()
    cut = torch.ones(n, dtype=torch.bool, device=seg.device)
    cut[1:] = seg[1:] != seg[:-1]
    cut[::packing.segments.shape[1]] = True                                          # every row starts a run
    starts = cut.nonzero().view(-1)
    cu = torch.cat([starts, starts.new_tensor([n])]).to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def decoder_inputs(decoder: nn.Module, packing: Packing, dtype: torch.dtype) -> dict:
    """The keyword inputs of a packed decoder pass: ids, restarting positions, the 4D mask;
    a {layer type: mask} mapping where some layer slides over a window shorter than a
    sequence (`layer_masks_accepted`; `choose` runs other such models padded)."""
    config = decoder.config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    impl = "sdpa" if impl == PER_SEQUENCE else impl  # inside `attention(decoder)`
    if impl in FLASH:
        if isinstance(packing, SharedPacking):
            raise ValueError("shared layout: FlashAttention's varlen kernel cannot run its tree (response_hidden "
                             "runs such a batch packed)")
        return {"input_ids": packing.input_ids, "position_ids": packing.position_ids, **flash_inputs(packing)}
    mask = packing.mask("bool" if impl == "sdpa" else "additive", dtype)
    window = sliding_window_of(config)
    if window is not None and packing.input_ids.numel() and int(packing.position_ids.max()) >= window:
        if not layer_masks_accepted(config):
            raise ValueError(f"packed layout: a sequence is longer than the {window}-token sliding window of a "
                             "model that takes one mask (choose() runs such a batch padded)")
        cut = windowed(mask, packing.position_ids, window)
        mask = {kind: cut if kind == "sliding_attention" else mask for kind in set(config.layer_types)}
    inputs = {"input_ids": packing.input_ids, "position_ids": packing.position_ids, "attention_mask": mask}
    if impl == "sdpa":
        inputs["packed_index"] = sequence_index(packing)  # read inside `attention(decoder)`, ignored by plain SDPA
    return inputs


# --------------------------------------------------------------------------------------
# shared: a group's prompt once, its k responses after it in the same packed row
# --------------------------------------------------------------------------------------
@dataclass
class SharedPacking(Packing):
    """A packed batch whose groups of k responses share one prompt (`shared_plan`).

    `segments` holds the response row b on its response tokens and B + g on group g's
    prompt tokens; `group` the group of every position (-1 on padding). The mask is a tree:
    a prompt token sees its prompt's earlier tokens, a response token the whole prompt of its
    group and its own earlier tokens, never another response's."""

    group: Tensor = None   # (R, W) the group each position belongs to, -1 on padding
    prompt: Tensor = None  # (R, W) True on prompt tokens
    group_size: int = 1    # k: responses [g·k, (g+1)·k) answer prompt g

    def mask(self, kind: str, dtype: torch.dtype) -> Tensor:
        """(R, 1, W, W) the tree mask; `kind` as in `Packing.mask`."""
        seg, grp = self.segments, self.group
        w = seg.shape[1]
        causal = torch.ones(w, w, dtype=torch.bool, device=seg.device).tril()
        same = seg[:, :, None] == seg[:, None, :]
        its_prompt = (grp[:, :, None] == grp[:, None, :]) & self.prompt[:, None, :]
        real = (seg >= 0)[:, :, None]
        own = torch.eye(w, dtype=torch.bool, device=seg.device) & ~real
        allowed = (((same | its_prompt) & causal & real) | own).unsqueeze(1)        # (R, 1, W, W)
        if kind == "bool":
            return allowed
        zero = torch.zeros((), dtype=dtype, device=seg.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)


def shared_plan(prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                k: int, budget: int | None = None) -> SharedPacking:
    """The shared layout of (G, P) left-padded prompts and (G·k, T) right-padded responses,
    rows [g·k, (g+1)·k) answering prompt g.

    Group g is one span of a row: its prompt's real tokens (positions 0..plen-1), then each
    response's tokens but the last (positions plen.. onwards, as if it followed the prompt
    alone). Response token 0 of every row of the group is predicted by the prompt's last
    state, token t > 0 by the response's own token t-1: the prompt is computed once and its
    gradient sums over its k responses (the gather reads that state k times). A group whose
    responses are all empty is left out. Spans go into rows of at most `budget` tokens
    (first-fit decreasing; default and floor: the longest group). k = 1 is `plan`'s layout."""
    g, p = prompt_ids.shape
    b, t = response_ids.shape
    if b != g * k:
        raise ValueError(f"shared layout: {b} responses are not {g} groups of {k}")
    dev = prompt_ids.device
    plen, rlen = prompt_mask.sum(1).long(), response_mask.sum(1).long()             # (G,), (B,)
    grp = torch.arange(b, device=dev) // k                                          # (B,) each row's group
    if bool(((plen[grp] == 0) & (rlen > 0)).any()):
        raise ValueError("shared layout: a sequence with an empty prompt has no state to predict its first token")
    rin = (rlen - 1).clamp(min=0)                                                   # (B,) response inputs
    used = (rlen > 0).view(g, k).any(1)                                             # (G,) a group read at all
    glen = torch.where(used, plen + rin.view(g, k).sum(1), 0)                       # (G,) tokens of its span
    n_rows, width, row_of, off_of = place(glen.tolist(), budget)
    start = (row_of * width + off_of).to(dev)                                       # (G,) flat slot of its span
    n = n_rows * width
    ids = torch.zeros(n, dtype=prompt_ids.dtype, device=dev)
    pos = torch.zeros(n, dtype=torch.long, device=dev)
    segments = torch.full((n,), -1, dtype=torch.long, device=dev)
    group = torch.full((n,), -1, dtype=torch.long, device=dev)
    prompt = torch.zeros(n, dtype=torch.bool, device=dev)
    # the prompts: group g's real tokens at start_g + j, positions j
    plen_used = torch.where(used, plen, 0)
    pg = torch.repeat_interleave(torch.arange(g, device=dev), plen_used)            # (Np,) a group per slot
    pj = torch.arange(pg.numel(), device=dev) - torch.repeat_interleave(plen_used.cumsum(0) - plen_used, plen_used)
    dst = start[pg] + pj
    ids[dst] = prompt_ids[pg, p - plen[pg] + pj]
    pos[dst], segments[dst], group[dst], prompt[dst] = pj, b + pg, pg, True
    # the responses: row i's inputs after its prompt and its group's earlier responses
    before = rin.view(g, k).cumsum(1).view(-1) - rin                               # (B,) inputs of earlier rows
    first = start[grp] + plen[grp] + before                                         # (B,) slot of its token 0
    rs = torch.repeat_interleave(torch.arange(b, device=dev), rin)                 # (Nr,) a row per slot
    rj = torch.arange(rs.numel(), device=dev) - torch.repeat_interleave(rin.cumsum(0) - rin, rin)
    dst = first[rs] + rj
    ids[dst] = response_ids[rs, rj].to(ids.dtype)
    pos[dst], segments[dst], group[dst] = plen[grp][rs] + rj, rs, grp[rs]
    tt = torch.arange(t, device=dev)
    last = (start + plen - 1)[grp]                                                  # (B,) the prompt's last slot
    at = torch.where(tt == 0, last[:, None], first[:, None] + tt - 1)               # (B, T) state before token t
    gather = torch.where(tt < rlen[:, None], at, n)
    return SharedPacking(ids.view(n_rows, width), pos.view(n_rows, width), segments.view(n_rows, width), gather,
                         group.view(n_rows, width), prompt.view(n_rows, width), k)


def plan_sequences(input_ids: Tensor, attention_mask: Tensor, budget: int | None = None) -> Packing:
    """The packed layout of (B, L) whole sequences (no prompt|response split: SFT, the reward
    model, PPO-ptx's LM rows), each row's real tokens one contiguous run (right padding, as
    `choose(config, layout, mask[:, :0], mask)` checks).

    Every real token is an input (the reward model reads the last one's state), first-fit
    into rows of at most `budget` tokens (default and floor: the longest sequence). The
    `gather` of the result is (B, L): row b, column l holds the state of token l, the zero
    state on padding, so `Packing.unpack` gives the padded pass's (B, L, H) states."""
    b, width_in = input_ids.shape
    dev = input_ids.device
    real = attention_mask.bool()
    length = real.sum(1).long()                                                     # (B,)
    start = (real.long().cumsum(1) == 0).sum(1)                                     # (B,) first real column
    n_rows, width, row_of, off_of = place(length.tolist(), budget)
    row_of, off_of = row_of.to(dev), off_of.to(dev)
    seq = torch.repeat_interleave(torch.arange(b, device=dev), length)              # (N,) a sequence per slot
    j = torch.arange(seq.numel(), device=dev) - torch.repeat_interleave(length.cumsum(0) - length, length)
    dst = row_of[seq] * width + off_of[seq] + j
    src = seq * width_in + start[seq] + j
    ids = torch.zeros(n_rows * width, dtype=input_ids.dtype, device=dev)
    ids[dst] = input_ids.reshape(-1)[src]
    pos = torch.zeros(n_rows * width, dtype=torch.long, device=dev)
    pos[dst] = j
    segments = torch.full((n_rows * width,), -1, dtype=torch.long, device=dev)
    segments[dst] = seq
    col = torch.arange(width_in, device=dev) - start[:, None]                       # (B, L) index within its sequence
    at = (row_of * width + off_of)[:, None] + col
    gather = torch.where(real, at, n_rows * width)
    return Packing(ids.view(n_rows, width), pos.view(n_rows, width), segments.view(n_rows, width), gather)


def choose_sequences(model_config, layout: str, attention_mask: Tensor) -> str:
    """`choose` for (B, L) whole right-padded sequences: the layout this batch runs with."""
    return choose(model_config, layout, attention_mask[:, :0], attention_mask)


def packed_states(decoder: nn.Module, packing: Packing) -> Tensor:
    """The decoder's last hidden states (R, W, H) on a packed batch (the 4D mask, restarting positions)."""
    dtype = next(decoder.parameters()).dtype
    out = decoder(**decoder_inputs(decoder, packing, dtype), use_cache=False)
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


def flat_states(hidden: Tensor) -> Tensor:
    """(R, W, H) packed states -> (R·W + 1, H), the zero state last: what `Packing.gather` indexes."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])
