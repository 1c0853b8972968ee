"""The memory-lean gated MLP (`models.lean`): the model's own function and gradients, in
about half the saved activations, on the four architectures, under autocast, and never
on a LoRA-adapted projection."""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import held_own_and_lean, logits_and_grads
from torch import nn

from rlhflab.models.lean import GatedMLP, is_gated_mlp, lean_mlp
from rlhflab.models.tiny import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_same_output_and_gradients_as_the_models_own_mlp(arch, tiny_arch_dirs):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dirs[arch], dtype=torch.float32)
    ids = torch.randint(3, 300, (3, 11))
    out0, grads0 = logits_and_grads(model, ids)
    assert lean_mlp(model) == 2                                     # one MLP per layer
    out1, grads1 = logits_and_grads(model, ids)
    assert torch.equal(out0, out1)                                  # the same operations in the same order
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradcheck_in_float64_both_activations():
    torch.manual_seed(0)
    for kind in ("silu", "gelu_tanh"):
        x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
        ws = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((6, 4), (6, 4), (4, 6))]
        assert torch.autograd.gradcheck(lambda *t: GatedMLP.apply(*t, kind), (x, *ws))


def test_keeps_two_of_the_four_intermediate_tensors():
    # N = 256 rows, H = 16, I = 512: one (N, I) float32 tensor is 256 x 512 x 4 = 524,288
    # bytes. Autograd's MLP keeps gate(x), act(gate(x)), up(x) and their product (four);
    # GatedMLP keeps gate(x) and up(x) (two), plus x and the output in both.
    torch.manual_seed(0)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(16, 512, bias=False), nn.Linear(16, 512, bias=False)
    mlp.down_proj, mlp.act_fn = nn.Linear(512, 16, bias=False), nn.SiLU()
    mlp.forward = lambda x: mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    held = held_own_and_lean(mlp, torch.randn(256, 16, requires_grad=True), lean_mlp)
    chunk = 256 * 512 * 4
    assert held["own"] - held["lean"] == 2 * chunk, held
    assert held["lean"] == 2 * chunk + 256 * 16 * 4, held                 # gate(x), up(x) and the output


def test_lora_on_a_projection_keeps_the_models_own_forward(tiny_arch_dirs):
    from transformers import AutoModelForCausalLM

    from rlhflab.models.load import add_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dirs["llama"], dtype=torch.float32)
    model = add_lora(model, target_modules=["gate_proj", "q_proj"])
    assert lean_mlp(model) == 0
    assert not any(is_gated_mlp(m) for m in model.modules())


def test_under_autocast_the_projections_run_in_bfloat16_and_grads_keep_the_weights_dtype(tiny_arch_dirs):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dirs["qwen2"], dtype=torch.float32)
    ref = copy.deepcopy(model)
    lean_mlp(model)
    ids = torch.randint(3, 300, (2, 9))
    grads = {}
    for name, m in (("own", ref), ("lean", model)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(input_ids=ids, use_cache=False).logits
        out.float().square().mean().backward()
        grads[name] = {n: p.grad for n, p in m.named_parameters()}
        assert all(g.dtype == torch.float32 for g in grads[name].values())
    for n, g in grads["own"].items():  # bfloat16 rounding of the same operations
        torch.testing.assert_close(grads["lean"][n], g, rtol=2e-2, atol=1e-4, msg=n)


def test_a_deep_copy_keeps_its_own_lean_forward(tiny_arch_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dirs["mistral"], dtype=torch.float32)
    lean_mlp(model)
    twin = copy.deepcopy(model)
    mlp, twin_mlp = model.model.layers[0].mlp, twin.model.layers[0].mlp
    assert twin_mlp.forward.args[0] is twin_mlp and mlp.forward.args[0] is mlp
    with torch.no_grad():
        twin_mlp.down_proj.weight.zero_()                        # the copy's output changes, not the original's
        x = torch.randn(1, 2, 32)
        assert twin_mlp(x).abs().max() == 0 and mlp(x).abs().max() > 0


def test_double_backward_for_fisher_vector_products():
    # TRPO differentiates the gradient again (create_graph=True): the lean MLP's backward
    # must be differentiable, and its Hessian-vector product equal autograd's own.
    torch.manual_seed(0)
    for kind, act in (("silu", torch.nn.functional.silu),
                      ("gelu_tanh", lambda t: torch.nn.functional.gelu(t, approximate="tanh"))):
        x = torch.randn(5, 4, dtype=torch.float64)
        ws = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((6, 4), (6, 4), (4, 6))]
        v = [torch.randn_like(w) for w in ws]

        def hvp(f):
            g = torch.autograd.grad(f().square().sum(), ws, create_graph=True)
            return torch.autograd.grad(sum((gi * vi).sum() for gi, vi in zip(g, v)), ws)

        lean = hvp(lambda: GatedMLP.apply(x, *ws, kind))
        own = hvp(lambda: torch.nn.functional.linear(act(x @ ws[0].t()) * (x @ ws[1].t()), ws[2]))
        for a, b in zip(lean, own):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
