"""Float32 linear layers on a CPU through oneDNN, where it is the faster library.

PyTorch computes a float32 `F.linear` / `torch.mm` on a CPU with Intel MKL. MKL runs its
AVX-512 kernels on Intel CPUs only; on other x86 CPUs with AVX-512 (AMD EPYC Zen 4 and 5)
it runs its AVX2 kernels, half as wide. PyTorch also ships oneDNN, which uses AVX-512 on
any CPU that has it. On the 2-core AMD EPYC this project is developed on, one thread of a
float32 (12,800 x 512) @ (512 x 512) product runs at about 100 GFLOP/s with MKL and
about 230 with oneDNN; forward + backward of a linear layer 1.7-2.2x faster
(bench/cpu_matmul.py prints the table). Same float32 arithmetic on both: no reduced
precision, only another order of the sums (results differ by float32 rounding, about
1e-6 relative).

`model.cpu_matmul` chooses, once per process:

    auto     oneDNN on an x86 CPU that is not Intel's and has AVX-512 (where MKL runs
             half-width), else PyTorch's own (MKL)
    onednn   oneDNN whenever it applies
    torch    PyTorch's own, everywhere (what every other PyTorch program runs)

oneDNN applies to float32 CPU tensors outside autocast; everything else (GPU, bfloat16,
autocast regions, empty inputs) takes `F.linear` whatever the mode. The choice is made
by `linear(x, weight, bias)`, used by:

- every `nn.Linear` of a model loaded by `models.load.load_model` (its class is switched
  to `FastLinear`, a subclass whose forward calls `linear`; the parameters, their names,
  the checkpoints and `isinstance(m, nn.Linear)` do not change), and the LoRA layers
  `add_lora` creates;
- rlhflab's own kernels that multiply by a weight outside a module's forward: the chunked
  log-probs (`ops.chunked`) and the lean gated MLP (`models.lean`).

The backward pass is two more oneDNN products (grad_x = g W, grad_W = gᵀ x) written with
`linear` itself, so it is differentiable again when autograd records it (TRPO's
Fisher-vector products). Attention's own products (`scaled_dot_product_attention`)
stay PyTorch's.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MODES = ("auto", "onednn", "torch")
_mode: Optional[str] = None  # "onednn" or "torch" once resolved; None: resolve "auto" at first use


# --------------------------------------------------------------------------------------
# Which library
# --------------------------------------------------------------------------------------
def cpu_info(text: str | None = None) -> tuple[str, set[str]]:
    """(vendor_id, flags) of the first CPU in /proc/cpuinfo, or ("", set()) elsewhere."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as fh:
                text = fh.read(1 << 16)
        except OSError:
            return "", set()
    vendor, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
        if vendor and flags:
            break
    return vendor, flags


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


def resolve(mode: str, cpuinfo: str | None = None) -> str:
    """"onednn" or "torch" for `mode` (one of MODES) on this machine; see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"model.cpu_matmul: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "torch":
        return "torch"
    if not onednn_available():
        if mode == "onednn":
            raise ValueError("model.cpu_matmul: onednn was asked for but this torch build has no oneDNN "
                             "linear op; set model.cpu_matmul=torch (or auto)")
        return "torch"
    if mode == "onednn":
        return "onednn"
    vendor, flags = cpu_info(cpuinfo)
    return "onednn" if vendor and vendor != "GenuineIntel" and "avx512f" in flags else "torch"


def set_cpu_matmul(mode: str) -> str:
    """Choose the library for this process (`model.cpu_matmul`); returns the resolved one."""
    global _mode
    _mode = resolve(mode)
    return _mode


def cpu_matmul() -> str:
    """The library in use: "onednn" or "torch" ("auto" is resolved at the first call)."""
    global _mode
    if _mode is None:
        _mode = resolve("auto")
    return _mode


# --------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------
def _plain(t: Tensor | None) -> bool:
    # a DTensor or another tensor subclass (FSDP's sharded parameters) takes F.linear
    return t is None or (type(t) in (Tensor, nn.Parameter) and t.dtype == torch.float32
                         and t.device.type == "cpu" and t.layout == torch.strided)


def applies(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """True when `linear(x, weight, bias)` runs on oneDNN."""
    return (cpu_matmul() == "onednn" and _plain(x) and _plain(weight) and _plain(bias)
            and x.numel() > 0 and weight.numel() > 0 and not torch.is_autocast_enabled("cpu"))


def _onednn(x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """(N, in) x (out, in)ᵀ + bias -> (N, out) on oneDNN, no autograd."""
    return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])                                     # (N, in)
        y = _onednn(x2, weight, bias)                                       # (N, out)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])                                     # (N, out)
        x2 = x.reshape(-1, x.shape[-1])                                     # (N, in)
        need_x, need_w, need_b = ctx.needs_input_grad
        # `linear` again, so that a recorded backward (create_graph) is differentiable
        grad_x = linear(g2, weight.t()).view(x.shape) if need_x else None      # g W      (N, in)
        grad_w = weight_grad(g2, x2) if need_w else None                       # gᵀ x     (out, in)
        grad_b = g2.sum(0) if ctx.has_bias and need_b else None                # (out,)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` = x Wᵀ + b, on oneDNN where `applies` (module docstring)."""
    if applies(x, weight, bias):
        if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))):
            return _onednn(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for 2-D a (N, k) and b (k, M), through `linear`."""
    return linear(a, b.t())


def weight_grad(g: Tensor, x: Tensor) -> Tensor:
    """gᵀ x (out, in) for g (N, out) and x (N, in): a linear layer's weight gradient.

    oneDNN copies an input it reads transposed (not a transposed weight). Either g is
    that input (a copy of N x out numbers) or x is and the result comes out transposed,
    (xᵀ g)ᵀ, which autograd copies into the weight's layout (N x in + out x in numbers):
    the cheaper of the two copies is taken. (At an LM head's 151,936 outputs the
    transposed result alone would be a 545 MB copy.)
    """
    if not applies(g, x):
        return g.t() @ x
    n, out_f, in_f = g.shape[0], g.shape[1], x.shape[1]
    if n * in_f + out_f * in_f < n * out_f:
        return linear(x.t(), g.t()).t()
    return linear(g.t(), x.t())


# --------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------
class FastLinear(nn.Linear):
    """An `nn.Linear` whose forward is `linear` (oneDNN where it applies). Only the class
    changes: parameters, names, state dicts and `isinstance(m, nn.Linear)` stay."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def use_fast_linears(module: nn.Module) -> int:
    """Switch every plain `nn.Linear` in `module` to `FastLinear` when oneDNN is in use
    for this process; returns how many were switched (0 under `model.cpu_matmul=torch`)."""
    if cpu_matmul() != "onednn":
        return 0
    count = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = FastLinear
            count += 1
    return count


def is_linear(module: nn.Module) -> bool:
    """A plain linear layer: `nn.Linear` itself or `FastLinear` (the same function)."""
    return type(module) in (nn.Linear, FastLinear)
