"""The lean RMSNorm (`models.lean.RMSNormFn`, `lean_norms`): the model's own output bit for
bit, its gradients, one saved (N, H) tensor instead of two, on the four architectures
(Gemma's 1 + w form included), and the model's own forward wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
from model_helpers import held_own_and_lean, logits_and_grads
from torch import nn

from rlhflab.models.lean import RMSNormFn, lean_norms, norm_form
from rlhflab.models.tiny import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_same_output_and_gradients_as_the_models_own_norms(arch, tiny_arch_dirs):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dirs[arch], dtype=torch.float32)
    with torch.no_grad():  # weights away from their init (ones, or zeros in Gemma's 1 + w)
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.normal_(0.5 if arch == "gemma" else 1.0, 0.2)
    ids = torch.randint(3, 300, (3, 11))
    out0, grads0 = logits_and_grads(model, ids)
    assert lean_norms(model) == 5                                   # two per layer and the final one
    want = "one_plus_weight" if arch == "gemma" else "weight"
    assert norm_form(model.model.norm) == want
    out1, grads1 = logits_and_grads(model, ids)
    assert torch.equal(out0, out1)                                  # the same operations in the same order
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("form", ["weight", "one_plus_weight"])
def test_gradcheck_in_float64(form):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFn.apply(a, b, 1e-6, form), (x, w))


def test_the_gradients_equal_autograds_of_the_formula_by_hand():
    # x = [3, 4]: mean(x²) = 12.5, r = 1/√12.5; w = [1, 2], g = [1, 1]
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    RMSNormFn.apply(x, w, 0.0, "weight").backward(torch.ones(1, 2, dtype=torch.float64))
    r = 12.5 ** -0.5
    # dw = g ⊙ x r = [3r, 4r]; gy = [1, 2], mean(gy ⊙ x r) = (3r + 8r) / 2 = 5.5 r,
    # dx = r (gy − x r · 5.5 r) = r ([1, 2] − 5.5 r² [3, 4]) = r ([1, 2] − [1.32, 1.76])
    torch.testing.assert_close(w.grad, torch.tensor([3 * r, 4 * r], dtype=torch.float64))
    torch.testing.assert_close(x.grad, torch.tensor([[-0.32 * r, 0.24 * r]], dtype=torch.float64))


def test_keeps_one_row_tensor_instead_of_two(tiny_arch_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dirs["llama"], dtype=torch.float32)
    norm = model.model.norm                                         # H = 32
    held = held_own_and_lean(norm, torch.randn(256, 32, requires_grad=True), lean_norms)
    row = 256 * 32 * 4
    # own: x r, the output and r (N, 1) (x itself is the caller's); lean: the output and r
    assert held["own"] - held["lean"] == row, held
    assert held["lean"] == row + 256 * 4, held


def test_double_backward_for_fisher_vector_products():
    torch.manual_seed(0)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    v = [torch.randn_like(x), torch.randn_like(w)]

    def hvp(f):
        g = torch.autograd.grad(f().square().sum(), (x, w), create_graph=True)
        return torch.autograd.grad(sum((gi * vi).sum() for gi, vi in zip(g, v)), (x, w))

    lean = hvp(lambda: RMSNormFn.apply(x, w, 1e-6, "weight"))
    own = hvp(lambda: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))
    for a, b in zip(lean, own):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_other_layers_and_dtypes_keep_the_models_own_forward(tiny_arch_dirs):
    from transformers import AutoModelForCausalLM

    assert norm_form(nn.LayerNorm(8)) is None                       # not an RMSNorm

    class OffsetRMSNorm(nn.Module):                                 # an RMSNorm of another formula
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x):
            return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt() * self.weight + 0.5

    assert norm_form(OffsetRMSNorm()) is None and lean_norms(OffsetRMSNorm()) == 0
    model = AutoModelForCausalLM.from_pretrained(tiny_arch_dirs["qwen2"], dtype=torch.float32)
    lean_norms(model)
    norm = model.model.norm
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    assert torch.equal(norm(x), type(norm).forward(norm, x))        # bfloat16 input: the model's own
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_arch_dirs["qwen2"], dtype=torch.bfloat16)
    assert lean_norms(bf16) == 0                                    # bfloat16 weights: left as they are


def test_the_cpu_seam_switches_the_trained_models_norms(tiny_model_dir):
    import torch

    from rlhflab import cpu
    from rlhflab.config.schema import LoRAConfig, ModelConfig
    from rlhflab.models.lean import _lean_norm_forward
    from rlhflab.models.setup import build_models

    def lean(m):
        return [getattr(x.forward, "func", None) is _lean_norm_forward for x in m.modules()
                if type(x).__name__.endswith("RMSNorm")]

    for on in (True, False):
        model_cfg = ModelConfig(name_or_path=str(tiny_model_dir), critic="separate", lean_norm=on)
        models = build_models(model_cfg, LoRAConfig(), "cpu", need_reference=True, critic="separate")
        assert not any(lean(models.policy))                         # build_models is device-neutral
        cpu.apply_to_models(models, model_cfg)                      # the run context's call on a CPU
        for m in (models.policy, models.actor.critic.base):
            assert lean(m) and all(f is on for f in lean(m))
        assert not any(lean(models.reference.model))               # no gradients there: its own forward
        cuda = build_models(model_cfg, LoRAConfig(), "cpu", need_reference=False, critic="separate")
        cuda.device = torch.device("cuda")                          # a CUDA run: the seam leaves it alone
        cpu.apply_to_models(cuda, model_cfg)
        assert not any(lean(cuda.policy)) and not any(lean(cuda.actor.critic.base))
