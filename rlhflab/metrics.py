"""Metrics: one JSON line per step in metrics.jsonl, optional TensorBoard/W&B, PNG plots.

The jsonl file is the source of truth (`rlhflab doctor` and the plots read it); it is
appended and flushed each step, so a crash loses at most the step in flight.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

PLOT_GROUPS: dict[str, list[str]] = {
    "reward": ["rollout/reward_mean", "eval/reward_mean", "eval/accuracy"],
    "losses": ["loss/policy", "loss/value", "loss/total"],
    "entropy": ["loss/entropy"],
    "kl": ["params/approx_kl", "params/kl_to_ref"],
    "clipping": ["params/policy_clip_frac", "params/value_clip_frac"],
    "grad_norm": ["params/grad_norm"],
    "length": ["rollout/response_length"],
    "lr": ["lr"],
}


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


class MetricsLogger:
    """Writes metrics to `out_dir/metrics.jsonl` and to the configured extra sinks."""

    def __init__(self, out_dir: str | Path, report_to: Iterable[str] = (), run_name: str | None = None,
                 wandb_project: str = "rlhflab", config: dict | None = None, resume: bool = False,
                 resume_step: int | None = None):
        """`resume` appends to an existing metrics.jsonl. Rows of steps after the checkpoint
        resumed from were logged before the run stopped and are about to be redone, so they
        are dropped, and each step appears once: those after `resume_step` at once when it
        is given, else those from the first step this logger logs onwards (on its first
        `log` call)."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        if not resume and self.path.exists():
            self.path.unlink()
        self._drop_from: bool = resume and resume_step is None  # decided by the first log()
        if resume and resume_step is not None:
            self._keep_before(resume_step + 1)
        self._fh = self.path.open("a")
        self._tb = None
        self._wandb = None
        name = run_name or self.out_dir.name
        for sink in report_to:
            if sink == "tensorboard":
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    print("warning: tensorboard is not installed (pip install 'rlhflab[tensorboard]'); skipping it")
                    continue
                self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
            elif sink == "wandb":
                try:
                    import wandb
                except ImportError:
                    print("warning: wandb is not installed (pip install 'rlhflab[wandb]'); skipping it")
                    continue
                self._wandb = wandb.init(project=wandb_project, name=name, config=config or {})

    def _keep_before(self, step: int) -> None:
        """Rewrite metrics.jsonl without the rows of `step` and later (and a cut last line)."""
        if self.path.exists():
            keep = [r for r in read_metrics(self.path) if r.get("step", 0) < step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            tmp.replace(self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._drop_from:  # resumed without resume_step: the first step logged is the first redone
            self._fh.close()
            self._keep_before(step)
            self._fh = self.path.open("a")
            self._drop_from = False
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self, failed: bool = False) -> None:
        """Close every sink; `failed`: the run raised, and W&B marks it failed (exit code 1)
        instead of finished."""
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)


def read_metrics(path: str | Path, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, each a dict with a whole-number "step" >= 0.

    A partial last line (the run is still writing) and broken lines elsewhere are
    skipped; when `notes` is a list, one line per skipped line is appended to it (what
    `rlhflab doctor` prints). A row without "step" gets its index among the rows kept.
    """
    rows: list[dict[str, Any]] = []
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    skipped = notes if notes is not None else []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped.append(f"line {i} is incomplete (the run may still be writing); skipped" if i == len(lines)
                           else f"line {i} is not valid JSON; skipped")
            continue
        if not isinstance(row, dict):
            skipped.append(f"line {i} is not a JSON object; skipped")
            continue
        if "step" not in row:
            row = {"step": len(rows), **row}
        step = row["step"]
        if isinstance(step, float) and math.isfinite(step) and step.is_integer():
            row["step"] = step = int(step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            skipped.append(f"line {i}: step {json.dumps(step)[:20]} is not a whole number >= 0; skipped")
            continue
        rows.append(row)
    return rows


def plot_metrics(metrics_path: str | Path, out_dir: str | Path,
                 groups: dict[str, list[str]] | None = None) -> list[Path]:
    """One PNG per group of metrics present in the file; returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    groups = dict(groups or PLOT_GROUPS)
    # Held-out checks (eval.rewards' eval/<metric>) join the plot that holds the reward, so
    # the true score is drawn beside the optimised one.
    listed = {k for keys in groups.values() for k in keys}
    held_out = sorted({k for r in rows for k in r if k.startswith("eval/") and k not in listed})
    home = next((n for n, keys in groups.items() if "eval/reward_mean" in keys), None)
    if held_out and home is not None:
        groups[home] = [*groups[home], *held_out]
    for name, keys in groups.items():
        series = {}
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
            if pts:
                series[k] = pts
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k, pts in series.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=k)
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
