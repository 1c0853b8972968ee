"""Memory-lean layers: the same functions, fewer saved activations and fewer operators: the
gated MLP, which keeps about half of its saved activations. (A lean RMSNorm was here too; it
gained 1.6-5% of a SmolLM2 step and was removed under the 10% rule, issue 51.)

The MLP of Llama, Qwen2, Mistral and Gemma is y = down(act(gate(x)) ⊙ up(x)), with act
SiLU (Gemma: GELU, tanh form) and I, the intermediate size, 4-5x the hidden size H.
Autograd keeps four (N, I) tensors of it for the backward pass: gate(x) (for act's
derivative), act(gate(x)) and up(x) (for the product's), and the product (for down's
weight gradient). Per token and layer that is 4·I numbers, more than the rest of the
layer together (about 3.5·H for the attention, H for each norm); at Qwen2.5-0.5B's size
(I = 4864, H = 896) it is 19,456 of about 27,000.

`GatedMLP` keeps g = gate(x) and u = up(x) only (2·I) and recomputes a = act(g) and
p = a ⊙ u in the backward pass, two elementwise operations:

    dW_down = dyᵀ p        dp = dy W_down
    da = dp ⊙ u            du = dp ⊙ a           dg = da ⊙ act'(g)
    dx = dg W_gate + du W_up                     dW_gate = dgᵀ x,   dW_up = duᵀ x

The forward pass is the same operations in the same order as the model's own, so its
output is identical; the gradients equal autograd's up to float rounding (the weight
gradients multiply the same matrices in the other order). When the backward pass is
itself differentiated (TRPO's Fisher-vector products), g and u are recomputed from x in
it, so the second derivative is exact too. Under autocast the
projections run in bfloat16 as in the model's own MLP, and the backward pass computes
in the dtype the forward used, returning gradients in the weights' and the input's
dtypes.

`lean_mlp(model)` switches every such MLP of a model to it (an instance `forward`; the
parameters, their names and the saved checkpoints do not change). An MLP whose
projections are not plain bias-free `nn.Linear` layers (a LoRA adapter on them, say)
keeps its own forward, checked at every call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhflab.cpu.matmul import is_fast, is_linear
from rlhflab.ops.matmul import linear, mm, weight_grad

ACTIVATIONS = ("silu", "gelu_tanh")


def activation_kind(act: nn.Module) -> str | None:
    """"silu", "gelu_tanh", or None for an activation `GatedMLP` does not know."""
    name = type(act).__name__
    if isinstance(act, nn.SiLU) or name == "SiLUActivation":                 # F.silu
        return "silu"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    if name == "GELUTanh" and isinstance(getattr(act, "act", None), functools.partial):  # F.gelu(approximate="tanh")
        return "gelu_tanh"
    return None  # e.g. a Python-formula GELU: not the same rounding as F.gelu


def _act(g: Tensor, kind: str) -> Tensor:
    return F.silu(g) if kind == "silu" else F.gelu(g, approximate="tanh")


def _act_backward(grad: Tensor, g: Tensor, kind: str) -> Tensor:
    """grad ⊙ act'(g), with the kernels autograd uses for the activation; when the backward
    pass is itself differentiated (TRPO's Fisher-vector products), SiLU's derivative is
    written out, as autograd does then: silu'(g) = σ(g) (1 + g (1 - σ(g)))."""
    if kind == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, g, approximate="tanh")
    if torch.is_grad_enabled():
        s = torch.sigmoid(g)
        return grad * s * (1 + g * (1 - s))
    return torch.ops.aten.silu_backward(grad, g)


class GatedMLP(torch.autograd.Function):
    """(x (..., H), W_gate (I, H), W_up (I, H), W_down (H, I), kind, onednn) -> (..., H); see
    the module docstring. `onednn`: the products through oneDNN (the layers are FastLinear)."""

    @staticmethod
    def forward(ctx, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, kind: str,
                onednn: bool = False) -> Tensor:
        g = linear(x, w_gate, onednn=onednn)                                 # (..., I)
        a = _act(g, kind)
        u = linear(x, w_up, onednn=onednn)                                   # (..., I)
        y = linear(a * u, w_down, onednn=onednn)                             # (..., H)
        ctx.save_for_backward(x, w_gate, w_up, w_down, g, u)
        ctx.kind, ctx.onednn = kind, onednn
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_gate, w_up, w_down, g, u = ctx.saved_tensors
        on = ctx.onednn
        dtype = g.dtype                                  # the forward's compute dtype (bfloat16 under autocast)
        with torch.autocast(dy.device.type, enabled=False):
            wg, wu, wd = w_gate.to(dtype), w_up.to(dtype), w_down.to(dtype)
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)                        # (N, H)
            dy2 = dy.reshape(-1, dy.shape[-1]).to(dtype)                     # (N, H)
            if torch.is_grad_enabled():
                # This backward is differentiated again (create_graph, TRPO's Fisher-vector
                # products): g and u are recomputed from the inputs so that the second
                # derivative sees their dependence on x and the weights.
                g2, u2 = linear(x2, wg, onednn=on), linear(x2, wu, onednn=on)  # (N, I)
            else:
                g2, u2 = g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1])  # (N, I)
            a = _act(g2, ctx.kind)                                           # recomputed
            dp = mm(dy2, wd, onednn=on)                                      # (N, I)
            grad_down = weight_grad(dy2, a * u2, onednn=on) if ctx.needs_input_grad[3] else None
            du = dp * a
            # da = dp ⊙ u in dp's storage, unless this backward is itself differentiated
            da = dp * u2 if torch.is_grad_enabled() else dp.mul_(u2)
            dg = _act_backward(da, g2, ctx.kind)
            grad_x = mm(dg, wg, onednn=on) + mm(du, wu, onednn=on) if ctx.needs_input_grad[0] else None
            grad_gate = weight_grad(dg, x2, onednn=on) if ctx.needs_input_grad[1] else None
            grad_up = weight_grad(du, x2, onednn=on) if ctx.needs_input_grad[2] else None
        grads = (grad_x.view(x.shape).to(x.dtype) if grad_x is not None else None,
                 grad_gate.to(w_gate.dtype) if grad_gate is not None else None,
                 grad_up.to(w_up.dtype) if grad_up is not None else None,
                 grad_down.to(w_down.dtype) if grad_down is not None else None, None, None)
        return grads[: len(ctx.needs_input_grad)]  # `onednn` may be left to its default


def _plain(linear: nn.Module) -> bool:
    return linear is not None and is_linear(linear) and linear.bias is None


def is_gated_mlp(module: nn.Module) -> bool:
    """An MLP of the down(act(gate(x)) * up(x)) form that `GatedMLP` computes exactly."""
    return (all(_plain(getattr(module, n, None)) for n in ("gate_proj", "up_proj", "down_proj"))
            and activation_kind(getattr(module, "act_fn", None)) is not None)


def _lean_forward(mlp: nn.Module, x: Tensor) -> Tensor:
    if not is_gated_mlp(mlp):  # changed since (an adapter added): the model's own expression
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    return GatedMLP.apply(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                          activation_kind(mlp.act_fn), is_fast(mlp.gate_proj))


def lean_mlp(model: nn.Module) -> int:
    """Switch every gated MLP of `model` to `GatedMLP`; returns how many were switched."""
    n = 0
    for module in model.modules():
        if is_gated_mlp(module):
            module.forward = functools.partial(_lean_forward, module)
            n += 1
    return n


def read_past_forward(model: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """(module, parameter) pairs where the module's forward reads a child's weight without
    running the child: every MLP switched to `GatedMLP` reads its three projections'. A
    strategy that gathers a module's own parameters as it runs (DeepSpeed ZeRO-3) must be
    told (`engine.dist`)."""
    return [(m, getattr(m, n).weight) for m in model.modules()
            if isinstance(m.forward, functools.partial) and m.forward.func is _lean_forward
            for n in ("gate_proj", "up_proj", "down_proj")]


def make_lean(model: nn.Module, model_cfg) -> None:
    """The lean MLP a model section asks for (`model.lean_mlp`, any device, unless
    `model.compile_layers`) on a model about to be trained. Call after LoRA is attached: an adapted projection keeps the
    model's own MLP."""
    if model_cfg.lean_mlp and not getattr(model_cfg, "compile_layers", False):
        # compiled layers: inductor plans the MLP's recomputation itself, and each lean MLP's own
        # forward (a functools.partial per module) would make torch.compile recompile per layer
        # until its recompile limit, then run the layers eager (bench/NOTES.md)
        lean_mlp(model)
