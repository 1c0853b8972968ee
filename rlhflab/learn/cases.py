"""Inputs the grader feeds to the learner's functions.

Two kinds: small cases worked by hand (the numbers are in the comments, and
tests/test_learn_grader.py checks the library reproduces them), and random batches
with right padding. Padding positions always hold large non-zero junk, the way a
buggy upstream could leave them, so any leak of padding into a result changes it.
Masks are `long`, as the trainer's `response_mask` is.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from rlhflab.models.actor_critic import ResponseOutput


def right_mask(lengths: list[int], t: int) -> Tensor:
    """(B, T) long: 1 for the first `lengths[b]` positions of row b, 0 after."""
    return (torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()


def with_junk(x: Tensor, mask: Tensor, junk: Tensor | float) -> Tensor:
    """`x` on real positions, `junk` on padding."""
    junk = torch.as_tensor(junk, dtype=x.dtype).expand_as(x)
    return torch.where(mask.bool(), x, junk)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


RANDOM_LENGTHS = [6, 4, 2, 5]  # B = 4, T = 6: every row but the first is padded


# ---------------------------------------------------------------- exercise 1
def policy_hand() -> dict:
    """One row, four real tokens and one padding position; clip_eps = 0.2.

    token  A   ratio  -A*r   -A*clip(r)  loss_t = max   clipped branch?
      0   +1   1.5   -1.5      -1.2        -1.2          yes
      1   -1   0.5    0.5       0.8         0.8          yes
      2   +2   0.9   -1.8      -1.8        -1.8          no (inside the clip)
      3   -1   1.5    1.5       1.2         1.5          no (moved the wrong way)
    loss = (-1.2 + 0.8 - 1.8 + 1.5) / 4 = -0.175;  clip_frac = 2 / 4 = 0.5
    The padding position (ratio e, A = 3) would give -3.6 if it leaked in.
    """
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -1.0]])
    ratio = torch.tensor([[1.5, 0.5, 0.9, 1.5, math.e]])
    return dict(logprobs=old + ratio.log(), old_logprobs=old,
                advantages=torch.tensor([[1.0, -1.0, 2.0, -1.0, 3.0]]),
                response_mask=torch.tensor([[1, 1, 1, 1, 0]]), clip_eps=0.2)


def policy_random(seed: int = 1, clip_eps: float = 0.2) -> dict:
    """B = 4, T = 6; ratios spread around 1 so both sides of the clip are hit."""
    g = _gen(seed)
    mask = right_mask(RANDOM_LENGTHS, 6)
    logprobs = -3.0 * torch.rand(4, 6, generator=g)                    # (B, T)
    old = logprobs + 0.4 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    return dict(logprobs=with_junk(logprobs, mask, 0.5), old_logprobs=with_junk(old, mask, -4.0),
                advantages=with_junk(adv, mask, 5.0), response_mask=mask, clip_eps=clip_eps)


# ---------------------------------------------------------------- exercise 2
def value_hand() -> dict:
    """One row, three real tokens and one padding position; clip_range c = 0.2.

    token  V    V_old  R    V_clip  (V-R)^2  (V_clip-R)^2  max   clipped larger?
      0   1.0   1.0   2.0   1.0      1.0       1.0        1.0   no (equal)
      1   2.0   1.5   1.0   1.7      1.0       0.49       1.0   no
      2   0.5   1.0   0.0   0.8      0.25      0.64       0.64  yes
    loss = 1/2 * (1.0 + 1.0 + 0.64) / 3 = 0.44;  clip_frac = 1/3
    Without the clip: 1/2 * (1 + 1 + 0.25) / 3 = 0.375. Without the 1/2: 0.88.
    """
    return dict(values=torch.tensor([[1.0, 2.0, 0.5, 4.0]]),
                old_values=torch.tensor([[1.0, 1.5, 1.0, 0.0]]),
                returns=torch.tensor([[2.0, 1.0, 0.0, -3.0]]),
                response_mask=torch.tensor([[1, 1, 1, 0]]), clip_range=0.2)


def value_random(seed: int = 2, clip_range: float | None = 0.2) -> dict:
    g = _gen(seed)
    mask = right_mask(RANDOM_LENGTHS, 6)
    old = torch.randn(4, 6, generator=g)
    values = old + 0.5 * torch.randn(4, 6, generator=g)                 # often beyond the clip
    returns = old + torch.randn(4, 6, generator=g)
    return dict(values=with_junk(values, mask, 3.0), old_values=with_junk(old, mask, -2.0),
                returns=with_junk(returns, mask, 6.0), response_mask=mask, clip_range=clip_range)


# ---------------------------------------------------------------- exercise 3
def entropy_hand() -> dict:
    """One row, two real tokens and one padding position, vocabulary V = 4.

    token 0: logits [0, 0, 0, 0]     p uniform          H = ln 4 = 1.386294
    token 1: logits [ln 2, 0, 0, 0]  p = [.4, .2, .2, .2]
             H = -(.4 ln .4 + 3 * .2 ln .2) = 0.366516 + 0.965663 = 1.332179
    mean H = (1.386294 + 1.332179) / 2 = 1.359237;  loss = -1.359237
    The padding position ([6, -6, 0, 0], H about 0.02) would drag the mean to about 0.91.
    """
    ln2 = math.log(2.0)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [ln2, 0.0, 0.0, 0.0], [6.0, -6.0, 0.0, 0.0]]])
    return dict(logits=logits, response_mask=torch.tensor([[1, 1, 0]]))


def entropy_random(seed: int = 3, scale: float = 2.0, vocab: int = 7) -> dict:
    g = _gen(seed)
    mask = right_mask(RANDOM_LENGTHS, 6)
    logits = scale * torch.randn(4, 6, vocab, generator=g)                 # (B, T, V)
    junk = torch.zeros(vocab)
    junk[0] = 3.0 * scale  # padding: a sharper distribution than the real tokens
    logits = torch.where(mask.bool().unsqueeze(-1), logits, junk)
    return dict(logits=logits, response_mask=mask)


# ---------------------------------------------------------------- exercise 4
def gae_hand() -> dict:
    """The worked example of docs/advantages.md, right-padded with junk.

    gamma = 0.9, lam = 0.95, r = [1, 0, 2], V = [2, 2.5, 3] (then two padding positions
    holding r = 5, V = 7, which must be ignored; V after the last real token is 0)
    delta = [1 + 0.9*2.5 - 2, 0 + 0.9*3 - 2.5, 2 + 0 - 3] = [1.25, 0.2, -1.0]
    A_2 = -1.0;  A_1 = 0.2 + 0.855*(-1.0) = -0.655;  A_0 = 1.25 + 0.855*(-0.655) = 0.689975
    returns = A + V = [2.689975, 1.845, 2.0], and 0 on padding
    """
    return dict(rewards=torch.tensor([[1.0, 0.0, 2.0, 5.0, 5.0]]),
                values=torch.tensor([[2.0, 2.5, 3.0, 7.0, 7.0]]),
                response_mask=torch.tensor([[1, 1, 1, 0, 0]]), gamma=0.9, lam=0.95)


def gae_random(seed: int = 4, gamma: float = 0.99, lam: float = 0.9, extra_pad: int = 0) -> dict:
    g = _gen(seed)
    t = 6 + extra_pad
    mask = right_mask(RANDOM_LENGTHS, t)
    rewards = 0.1 * torch.randn(4, t, generator=g)
    last = torch.tensor(RANDOM_LENGTHS) - 1
    rewards[torch.arange(4), last] += torch.tensor([1.0, -1.0, 2.0, 0.5])  # the score at the end
    values = torch.randn(4, t, generator=g)
    return dict(rewards=with_junk(rewards, mask, 4.0), values=with_junk(values, mask, -3.0),
                response_mask=mask, gamma=gamma, lam=lam)


def whiten_hand() -> dict:
    """The whitening table of docs/advantages.md: A = [0.689975, -0.655, -1.0, pad].

    mean = (0.689975 - 0.655 - 1.0) / 3 = -0.321675
    var  = ((1.01165)^2 + (-0.333325)^2 + (-0.678325)^2) / 3 = 0.52032
    whitened = (A - mean) / sqrt(var) = [1.388, -0.457, -0.930], and 0 on padding.
    The padding holds 0 here, as in the docs' table, where whitening over every
    position (wrong) gives [1.440, -0.640, -1.173, 0.373].
    """
    return dict(advantages=torch.tensor([[0.689975, -0.655, -1.0, 0.0]]),
                response_mask=torch.tensor([[1, 1, 1, 0]]))


def whiten_random(seed: int = 5) -> dict:
    g = _gen(seed)
    mask = right_mask(RANDOM_LENGTHS, 6)
    adv = 2.0 + 1.5 * torch.randn(4, 6, generator=g)   # not centred, not unit scale
    return dict(advantages=with_junk(adv, mask, 9.0), response_mask=mask)


# ---------------------------------------------------------------- exercise 5
class ToyActorCritic(nn.Module):
    """A model small enough to grade exercise 5 on, with the `ActorCritic` interface.

    Each position sees only the previous token (an embedding, tanh, then an LM head
    and a value head), which is enough for a forward pass with gradients to every
    parameter. Vocabulary 11, hidden size 8.
    """

    def __init__(self, vocab: int = 11, hidden: int = 8, seed: int = 0):
        super().__init__()
        g = _gen(seed)
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.lm_head = nn.Parameter(0.7 * torch.randn(hidden, vocab, generator=g))
        self.value_head = nn.Parameter(0.5 * torch.randn(hidden, generator=g))

    def forward_response(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                         with_values: bool = True) -> ResponseOutput:
        h = torch.tanh(self.embed[input_ids])                          # (B, L, H)
        h = h[:, prompt_len - 1 : input_ids.shape[1] - 1]              # (B, T, H) states before each response token
        values = h @ self.value_head if with_values else None          # (B, T)
        return ResponseOutput(h @ self.lm_head, values)

    has_values = True

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                group_size: int = 1, temperature: float = 1.0, with_values: bool = True,
                with_entropy: bool = False, entropy_grad: bool = True):
        """The trainer's forward (`ActorCritic.forward`): log-probs, values, entropy."""
        from rlhflab import ops
        from rlhflab.models.actor_critic import ForwardOutput
        ids = torch.cat([prompt_ids, response_ids], 1)
        am = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], 1)
        out = self.forward_response(ids, am, prompt_ids.shape[1], with_values)
        logits = out.logits / temperature
        entropy = None
        if with_entropy:
            entropy = ops.entropy_from_logits(logits if entropy_grad else logits.detach())
        return ForwardOutput(ops.logprobs_from_logits(logits, response_ids), out.values, entropy)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def toy_minibatches(seed: int = 6, lengths: tuple[list[int], ...] = ([5, 3, 5], [1, 2])) -> list[dict]:
    """Minibatch dicts in the full-sequence layout (`MiniBatch`'s mapping view, engine/minibatch.py).

    The default group holds 13 and 3 real tokens, so weighting minibatches equally
    instead of by tokens changes the result. old_logprobs and old_values are the toy
    model's own, perturbed, so ratios and values sit on both sides of the clips.
    """
    g = _gen(seed)
    model = ToyActorCritic()
    out = []
    for lens in lengths:
        b, t, p = len(lens), max(lens), 2
        mask = right_mask(lens, t)
        prompt_ids = torch.randint(1, 11, (b, p), generator=g)
        response_ids = torch.randint(1, 11, (b, t), generator=g)
        input_ids = torch.cat([prompt_ids, response_ids], 1)
        attention_mask = torch.cat([torch.ones(b, p, dtype=torch.long), mask], 1)
        with torch.no_grad():
            fwd = model.forward_response(input_ids, attention_mask, p)
            lp = torch.log_softmax(fwd.logits, -1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
            old_lp = lp + 0.3 * torch.randn(b, t, generator=g)
            old_v = fwd.values + 0.4 * torch.randn(b, t, generator=g)
        out.append({
            "input_ids": input_ids, "attention_mask": attention_mask, "prompt_len": p,
            "response_ids": response_ids, "response_mask": mask,
            "old_logprobs": with_junk(old_lp, mask, -3.0),
            "advantages": with_junk(torch.randn(b, t, generator=g), mask, 4.0),
            "returns": with_junk(old_v + torch.randn(b, t, generator=g), mask, -5.0),
            "old_values": with_junk(old_v, mask, 2.0),
            "ref_logprobs": None,
        })
    return out


def toy_settings(max_grad_norm: float | None = 0.05):
    """The `ppo:` section the grader uses for exercise 5: coefficients that are not 1
    (so a missing one shows), an active gradient clip, everything else the default."""
    from rlhflab.trainers.ppo import PPOSection
    return PPOSection(clip_eps=0.2, value_clip=0.2, vf_coeff=0.5, entropy_coeff=0.05,
                      max_grad_norm=max_grad_norm)
