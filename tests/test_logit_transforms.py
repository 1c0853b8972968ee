"""The training log-probs are those of the model's own logits in every transformers family
that transforms them after the LM head (issue 47): Gemma 2/3, VaultGemma and NanoChat soft-cap
them, Cohere multiplies by logit_scale, Granite divides by logits_scaling, HyperCLOVAX
multiplies by the same key, MiniCPM3 divides its hidden state before a bias-free head,
Falcon-H1 multiplies by lm_head_multiplier.

For each, a tiny random model (its head's weight x 20, so the logits are large and the
transform moves the distribution far: in the issue's reproduction the raw head's log-probs
were up to 2.6 nats off Cohere's own) gives `token_stats` (the chunked op),
`PolicyOnly.forward_response`, `PolicyOnly.forward` and the reference's log-probs and
logits, compared with log_softmax of `model(ids).logits`. The two sides are float32 passes
of different shapes over the same weights, the transform's scale and cap one product here
and two there: they agree to float rounding (seen <= 1e-6), so a 1e-5 tolerance.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from rlhflab.errors import UserError
from rlhflab.models.actor_critic import PolicyOnly, Reference, decoder_and_head, lm_loss, response_hidden, token_stats
from rlhflab.models.head import linear_lm_head, logit_transform
from rlhflab.ops import LogitTransform

V, P, T = 64, 3, 4  # vocabulary, prompt and response lengths
SMALL = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8)

# family: (config class, its keyword arguments, the transform transformers 5.19's forward applies)
FAMILIES = {
    "gemma2": ("Gemma2Config", dict(SMALL, final_logit_softcapping=2.0), LogitTransform(softcap=2.0)),
    "gemma3": ("Gemma3TextConfig", dict(SMALL, final_logit_softcapping=2.0), LogitTransform(softcap=2.0)),
    "vaultgemma": ("VaultGemmaConfig", dict(SMALL, final_logit_softcapping=2.0), LogitTransform(softcap=2.0)),
    "nanochat": ("NanoChatConfig", dict(SMALL, final_logit_softcapping=2.0), LogitTransform(softcap=2.0)),
    "cohere": ("CohereConfig", dict(SMALL, logit_scale=0.0625), LogitTransform(scale=0.0625)),
    "granite": ("GraniteConfig", dict(SMALL, logits_scaling=8.0), LogitTransform(scale=0.125)),
    "hyperclovax": ("HyperCLOVAXConfig", dict(SMALL, logits_scaling=0.25), LogitTransform(scale=0.25)),
    # logits_scaling = hidden_size / dim_model_base = 16 / 2, dividing the hidden state
    "minicpm3": ("MiniCPM3Config", dict(SMALL, num_key_value_heads=2, dim_model_base=2), LogitTransform(scale=0.125)),
    "falcon_h1": ("FalconH1Config", dict(SMALL, lm_head_multiplier=0.0625, mamba_d_ssm=16, mamba_n_heads=2,
                                         mamba_d_state=8, mamba_chunk_size=8), LogitTransform(scale=0.0625)),
}


def _model(family: str):
    name, kwargs, _ = FAMILIES[family]
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"this transformers has no {name}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**kwargs)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def _own_logprobs(model, ids, temperature=1.0):
    """log_softmax of the model's own logits / temperature at the response positions (B, T, V):
    what HF generate samples from."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()  # (B, P+T, V)
    return torch.log_softmax(logits[:, P - 1 : -1] / temperature, -1)


def _picked(logp, targets):
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy(logp):
    return -(logp.exp() * logp).sum(-1)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, P + T), generator=g)
    ones = torch.ones(2, P + T, dtype=torch.long)
    return ids, ids[:, :P], ones[:, :P], ids[:, P:], ones[:, P:]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_logprobs_equal_the_models_own(family):
    model = _model(family)
    assert logit_transform(model) == FAMILIES[family][2]
    assert linear_lm_head(model).transform == FAMILIES[family][2]  # the chunked op's path
    ids, pi, pm, ri, rm = _batch()
    own = _own_logprobs(model, ids)
    own_hot = _own_logprobs(model, ids, temperature=0.7)
    tol = dict(rtol=1e-5, atol=1e-5)  # see the module docstring
    with torch.no_grad():
        hidden = response_hidden(model, pi, pm, ri, rm)
        lp, ent = token_stats(hidden, decoder_and_head(model)[1], ri, 0.7, with_entropy=True, model=model)
        torch.testing.assert_close(lp, _picked(own_hot, ri), **tol)
        torch.testing.assert_close(ent, _entropy(own_hot), **tol)
        actor = PolicyOnly(model)
        torch.testing.assert_close(actor(pi, pm, ri, rm).logprobs, _picked(own, ri), **tol)
        logits = actor.forward_response(ids, torch.ones_like(ids), P, with_values=False).logits
        torch.testing.assert_close(torch.log_softmax(logits, -1), own, **tol)
        ref = Reference.frozen_copy(model)
        torch.testing.assert_close(ref.logprobs(pi, pm, ri, rm, temperature=0.7), _picked(own_hot, ri), **tol)
        torch.testing.assert_close(torch.log_softmax(ref.response_logits(ids, torch.ones_like(ids), P), -1),
                                   own, **tol)


def test_gradients_and_lm_loss_through_a_soft_cap_equal_the_models_own():
    # The chunked op's backward under a cap against autograd through the model's own logits,
    # and the PPO-ptx / SFT LM loss (chunked cross-entropy) against the model's own NLL.
    ids, pi, pm, ri, rm = _batch()
    grads = []
    for path in ("chunked", "own"):
        model = _model("gemma2").train()
        if path == "chunked":
            lp = PolicyOnly(model)(pi, pm, ri, rm).logprobs
        else:
            lp = _picked(torch.log_softmax(model(input_ids=ids).logits[:, P - 1 : -1].float(), -1), ri)
        lp.sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[1]:  # sums over rows in another order: float32 rounding
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5)
    model = _model("granite")
    labels = ids.clone()
    labels[:, :P] = -100
    with torch.no_grad():
        got = lm_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        want = model(input_ids=ids, labels=labels).loss  # transformers' own token-mean NLL of its logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_lora_adapter_on_the_head_keeps_the_transform():
    # No linear head to chunk (LoRA wraps it): the full-logits path applies the transform.
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model("cohere"), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert linear_lm_head(model) is None
    ids, pi, pm, ri, rm = _batch()
    with torch.no_grad():
        torch.testing.assert_close(PolicyOnly(model)(pi, pm, ri, rm).logprobs, _picked(_own_logprobs(model, ids), ri),
                                   rtol=1e-5, atol=1e-5)


def test_a_class_that_ignores_the_key_is_left_alone():
    # transformers' MPT has logit_scale in its config but its forward never reads it.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers.MptConfig(
        vocab_size=V, d_model=16, n_heads=2, n_layers=1, expansion_ratio=2, logit_scale=0.5)).eval()
    assert logit_transform(model) == LogitTransform()
    ids, pi, pm, ri, rm = _batch()
    with torch.no_grad():
        torch.testing.assert_close(PolicyOnly(model)(pi, pm, ri, rm).logprobs, _picked(_own_logprobs(model, ids), ri),
                                   rtol=1e-5, atol=1e-5)


class RemoteCodeLM(transformers.LlamaForCausalLM):
    """Stands in for a trust_remote_code class: defined outside transformers, so rlhflab cannot
    know what it does with a transform key its config sets."""


def test_a_transform_rlhflab_cannot_map_is_refused_in_one_line():
    config = transformers.LlamaConfig(**SMALL)
    config.logit_scale = 0.5
    model = RemoteCodeLM(config)
    with pytest.raises(UserError) as exc:
        logit_transform(model)
    msg = str(exc.value)
    assert "\n" not in msg and "RemoteCodeLM" in msg and "logit_scale=0.5" in msg
    assert linear_lm_head(model) is None  # SFT/DPO callers use the model's own logits there (exact)
    ids, pi, pm, ri, rm = _batch()
    with pytest.raises(UserError):  # the hidden-state paths cannot: refused, not approximated
        PolicyOnly(model)(pi, pm, ri, rm)
    # Inkling cuts its logits to unpadded_vocab_size: refused too.
    inkling = type("InklingForCausalLM", (torch.nn.Module,), {"__module__": "transformers.models.inkling"})()
    inkling.config = transformers.LlamaConfig(**SMALL)
    inkling.config.unpadded_vocab_size = V - 4
    with pytest.raises(UserError, match="unpadded_vocab_size=60"):
        logit_transform(inkling)


def test_build_models_refuses_it_before_any_step(monkeypatch):
    from pathlib import Path

    from rlhflab.config import load_config
    from rlhflab.models import setup
    from rlhflab.trainers import ppo

    config = transformers.LlamaConfig(**SMALL)
    config.logit_scale = 0.5
    monkeypatch.setattr(setup, "load_model", lambda *a, **k: (RemoteCodeLM(config), None))
    root = Path(__file__).resolve().parents[1]
    cfg, _ = load_config(root / "configs" / "ppo_debug.yaml", ppo.PPORunConfig, ["training.device=cpu"])
    with pytest.raises(UserError, match="RemoteCodeLM may change its logits by config logit_scale=0.5"):
        ppo.build_models(cfg)
