"""The end of a run: the metrics logger closed, plots, peak memory, train_result.json,
and what a run returns (`TrainResult`) with its end-of-run printout."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhflab.metrics import plot_metrics


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    except ImportError:  # pragma: no cover
        return float("nan")


@dataclass
class TrainResult:
    """What a training run returns: where its outputs went and what it measured. A trainer
    with more to say subclasses it (SFT's rows, the classifier's labels)."""

    output_dir: Path
    final_dir: Path
    history: list[dict] = field(default_factory=list)
    eval_before: dict | None = None
    eval_after: dict | None = None
    samples_per_s: float = 0.0    # episodes (RL) or pairs (DPO) per second of training
    unit: str = "episodes"
    world_size: int = 1
    is_main: bool = True                       # False on the other processes of a multi-process run
    models: object | None = None               # the trained models, for callers in the same process
    state: dict = field(default_factory=dict)  # other in-process objects (e.g. DPO's reference cache)
    adapter_dir: Path | None = None            # final/adapter/ under LoRA (SFT, RM)
    steps: int = 0
    seconds: float = 0.0

    def report(self, headline: str | None = None, skip_missing: bool = False) -> None:
        """The end-of-run printout (the main process only): `headline` (default: where the
        model went and the throughput), then the before/after table."""
        if not self.is_main:
            return
        print(headline or f"done: {self.output_dir} (final model in {self.final_dir}); "
                          f"{self.samples_per_s:.2f} {self.unit}/s")
        print_before_after(self.eval_before, self.eval_after, skip_missing)


def format_metrics(metrics: dict[str, float]) -> str:
    """`k=v, ...` with three decimals: the "step 0 (before training)" line."""
    return ", ".join(f"{k}={v:.3f}" for k, v in metrics.items())


def finish_run(logger, out_dir: Path, device: torch.device, plots: bool,
               plot_groups: dict[str, list[str]] | None = None) -> None:
    """Close the metrics logger, draw plots/ when asked, write peak_memory_mb.txt."""
    logger.close()
    if plots:
        plot_metrics(logger.path, out_dir / "plots", plot_groups)
    (out_dir / "peak_memory_mb.txt").write_text(f"{peak_memory_mb(device):.1f}\n")


def write_train_result(out_dir: Path, **fields) -> None:
    """train_result.json: the run's summary fields, in the order given, then the float32
    matmul library the run used on a CPU (`cpu_matmul`: "onednn" or "torch", what
    `cpu.matmul` resolved to; the CPU seam, rlhflab/cpu/)."""
    from rlhflab.cpu import matmul_library

    fields = {**fields, "cpu_matmul": matmul_library()}
    (out_dir / "train_result.json").write_text(json.dumps(fields, indent=2))


def print_before_after(before: dict | None, after: dict | None, skip_missing: bool = False) -> None:
    """`  key: before -> after` per final eval metric; nothing unless both are there.

    A key the starting evaluation lacks prints as nan, or is skipped with `skip_missing`.
    """
    if not (before and after):
        return
    for k in after:
        if skip_missing and k not in before:
            continue
        print(f"  {k}: {before.get(k, float('nan')):.3f} -> {after[k]:.3f}")
