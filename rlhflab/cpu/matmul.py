"""Which library computes float32 linear layers on a CPU (`cpu.matmul`), and the
layers that use it.

`cpu.matmul` chooses, once per process:

    auto     oneDNN on an x86 CPU that is not Intel's and has AVX-512 (where torch's MKL
             runs half-width kernels), else PyTorch's own (MKL)
    onednn   oneDNN whenever it applies
    torch    PyTorch's own, everywhere (what every other PyTorch program runs)

The product itself is `rlhflab.ops.matmul.linear` (what "applies" means is there). The
CPU seam (`rlhflab.cpu`, called by the run context when the training device is a CPU)
chooses the library and switches every `nn.Linear` of the models a run trains (the
policy, a separate critic's decoder, the SFT / reward / classifier model, their LoRA
layers) and of a frozen reference copy to `FastLinear`, a subclass whose forward calls
it: the parameters, their names, the checkpoints and `isinstance(m, nn.Linear)` do not
change. Nothing is switched under `torch`, nor on any device other than the CPU; models
loaded outside a training run (`generate`, `eval`, reward scorers) keep `nn.Linear`.
docs/cpu_matmul.md.
"""

from __future__ import annotations

from torch import Tensor, nn

from rlhflab.ops import matmul as ops_matmul

MODES = ("auto", "onednn", "torch")


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


def resolve(mode: str, cpuinfo: str | None = None) -> str:
    """"onednn" or "torch" for `mode` (one of MODES) on this machine; see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"cpu.matmul: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "torch":
        return "torch"
    if not ops_matmul.onednn_available():
        if mode == "onednn":
            raise ValueError("cpu.matmul: onednn was asked for but this torch build has no oneDNN "
                             "linear op; set cpu.matmul=torch (or auto)")
        return "torch"
    if mode == "onednn":
        return "onednn"
    vendor, flags = cpu_info(cpuinfo)
    return "onednn" if vendor and vendor != "GenuineIntel" and "avx512f" in flags else "torch"


# --------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------
class FastLinear(nn.Linear):
    """An `nn.Linear` whose forward is `linear` on oneDNN (where it applies). Only the class
    changes: parameters, names, state dicts and `isinstance(m, nn.Linear)` stay. Being a
    FastLinear is the switch: the CPU seam installs them only when oneDNN was chosen."""

    def forward(self, x: Tensor) -> Tensor:
        return ops_matmul.linear(x, self.weight, self.bias, onednn=True)


def use_fast_linears(module: nn.Module) -> int:
    """Switch every plain `nn.Linear` in `module` to `FastLinear`; returns how many were
    switched. The CPU seam (`rlhflab.cpu.apply`) calls it when oneDNN was chosen."""
    count = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = FastLinear
            count += 1
    return count


def is_linear(module: nn.Module) -> bool:
    """A plain linear layer: `nn.Linear` itself or `FastLinear` (the same function)."""
    return type(module) in (nn.Linear, FastLinear)


def is_fast(module: nn.Module) -> bool:
    """A `FastLinear`: products that read its weight go through oneDNN too (`onednn=True`)."""
    return type(module) is FastLinear
