"""Float32 linear products on a CPU through oneDNN: `linear(x, weight, bias)` = x Wᵀ + b.

PyTorch computes a float32 `F.linear` / `torch.mm` on a CPU with Intel MKL, which runs its
AVX-512 kernels on Intel CPUs only; on other x86 CPUs with AVX-512 (AMD EPYC Zen 4 and 5)
it runs its AVX2 kernels, half as wide. PyTorch also ships oneDNN, which uses AVX-512 on
any CPU that has it (`torch.ops.mkldnn._linear_pointwise`, for ordinary strided tensors).
Same float32 arithmetic on both: no reduced precision, only another order of the sums
(results differ by float32 rounding, about 1e-6 relative). docs/cpu_matmul.md has the
measurements.

Pure functions, no process-global switch: `linear(x, w, b, onednn=True)` runs on oneDNN
when the tensors are float32, on the CPU, plain (not a DTensor or another subclass), not
empty, and outside an autocast region; otherwise, and always with `onednn=False` (the
default), it is `F.linear`. Who asks for oneDNN is decided behind the CPU seam
(`rlhflab.cpu`, from `cpu.matmul`): it switches a model's linear layers to
`cpu.matmul.FastLinear`, whose forward passes `onednn=True`, and the chunked
log-prob op and the lean MLP pass `onednn` when the layers they read are FastLinear. The backward pass is two
more products (grad_x = g W, grad_W = gᵀ x) written with `linear` itself, so it is
differentiable again when autograd records it (TRPO's Fisher-vector products). `mm`
and `weight_grad` are the products rlhflab's own kernels need (ops.chunked,
models.lean).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """True when this torch build has oneDNN's linear op for plain (strided) tensors."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), torch.ones(3, 2), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return True


# --------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------
def _plain(t: Tensor | None) -> bool:
    # a DTensor or another tensor subclass (FSDP's sharded parameters) takes F.linear
    return t is None or (type(t) in (Tensor, nn.Parameter) and t.dtype == torch.float32
                         and t.device.type == "cpu" and t.layout == torch.strided)


def applies(x: Tensor, weight: Tensor, bias: Tensor | None = None, onednn: bool = False) -> bool:
    """True when `linear(x, weight, bias, onednn)` runs on oneDNN."""
    return (onednn and _plain(x) and _plain(weight) and _plain(bias)
            and x.numel() > 0 and weight.numel() > 0 and not torch.is_autocast_enabled("cpu"))


def _onednn(x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """(N, in) x (out, in)ᵀ + bias -> (N, out) on oneDNN, no autograd."""
    return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")


def _onednn_nd(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """(..., in) -> (..., out): `_onednn` on the flattened leading dimensions."""
    return _onednn(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_nd(x, weight, bias)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])                                     # (N, out)
        x2 = x.reshape(-1, x.shape[-1])                                     # (N, in)
        need_x, need_w, need_b = ctx.needs_input_grad
        # `linear` again, so that a recorded backward (create_graph) is differentiable
        grad_x = linear(g2, weight.t(), onednn=True).view(x.shape) if need_x else None  # g W   (N, in)
        grad_w = weight_grad(g2, x2, onednn=True) if need_w else None                   # gᵀ x  (out, in)
        grad_b = g2.sum(0) if ctx.has_bias and need_b else None                # (out,)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, onednn: bool = False) -> Tensor:
    """`F.linear(x, weight, bias)` = x Wᵀ + b, on oneDNN when asked and it `applies`
    (module docstring)."""
    if applies(x, weight, bias, onednn):
        if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))):
            return _onednn_nd(x, weight, bias)
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def mm(a: Tensor, b: Tensor, onednn: bool = False) -> Tensor:
    """a @ b for 2-D a (N, k) and b (k, M), through `linear`."""
    return linear(a, b.t(), onednn=onednn)


def weight_grad(g: Tensor, x: Tensor, onednn: bool = False) -> Tensor:
    """gᵀ x (out, in) for g (N, out) and x (N, in): a linear layer's weight gradient.

    oneDNN copies an input it reads transposed (not a transposed weight). Either g is
    that input (a copy of N x out numbers) or x is and the result comes out transposed,
    (xᵀ g)ᵀ, which autograd copies into the weight's layout (N x in + out x in numbers):
    the cheaper of the two copies is taken. (At an LM head's 151,936 outputs the
    transposed result alone would be a 545 MB copy.)
    """
    if not applies(g, x, None, onednn):
        return g.t() @ x
    n, out_f, in_f = g.shape[0], g.shape[1], x.shape[1]
    if n * in_f + out_f * in_f < n * out_f:
        return linear(x.t(), g.t(), onednn=True).t()
    return linear(g.t(), x.t(), onednn=True)
