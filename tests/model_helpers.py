"""Pieces several test modules share: a model's logits with the gradients of a fixed loss,
what a layer's forward keeps for backward before and after a lean switch, one
minibatch of a separate-critic PPO run, and a token made likely in a random model."""

from __future__ import annotations


def favour_token(model, tok, prompts, token_id: int, scale: float) -> None:
    """Point `token_id`'s output row along the model's mean last hidden state over `prompts`
    (after the final norm), so that a random model draws it often (`scale` 3: a few percent a
    token on the tiny test model, 4.5: tens of percent): responses or turns of different lengths."""
    import torch

    enc = tok(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        h = model(**enc, output_hidden_states=True).hidden_states[-1]
        m = model.model.norm(h).mean((0, 1))
        model.get_output_embeddings().weight[token_id] = scale * m / m.norm() ** 2


def logits_and_grads(model, ids):
    """(logits, {name: gradient}) of mean(logits²) for `ids`, gradients cleared first."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, use_cache=False).logits
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def held_own_and_lean(module, x, switch) -> dict[str, int]:
    """{"own", "lean"}: the bytes a forward of `module` on `x` leaves for backward, as it is
    and after `switch(module)` (a `models.lean` switch, which must switch exactly one layer)."""
    from memory_helpers import tensor_bytes

    held = {}
    for name in ("own", "lean"):
        if name == "lean":
            assert switch(module) == 1
        keep = []
        held[name] = tensor_bytes(lambda: keep.append(module(x)))[1]
    return held


def separate_critic_minibatch(cfg):
    """(cfg, the actor, one minibatch of all 16 rollout rows, its response-token count) of
    a separate-critic PPO run built from `cfg` (seeded: the same each call)."""
    import torch

    from rlhflab.data.prompts import load_prompts, step_prompts
    from rlhflab.engine.minibatch import loss_mask_of, select
    from rlhflab.trainers import ppo
    from rlhflab.trainers.common import Timer
    from rlhflab.trainers.loop import build_run

    torch.manual_seed(0)
    run = build_run(cfg, ppo.method(cfg))
    examples = step_prompts(load_prompts(cfg.dataset, run.models.tokenizer, "train"), 16, cfg.training.seed, 1)
    roll = ppo.collect_rollout(run, examples, Timer())
    mb = select(roll, torch.arange(len(roll)), loss_mask_of(roll, False))
    return cfg, run.models.actor, mb, float(mb.loss_mask.sum())
