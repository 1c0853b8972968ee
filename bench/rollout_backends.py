"""Generation throughput and MFU: the hf backend (Hugging Face generate) beside vllm.

    python bench/rollout_backends.py                       # the full table (see --help)
    python bench/rollout_backends.py --models tiny --lengths 16 --batches 32 --repeats 1
    python bench/rollout_backends.py --ppo                 # also PPO episodes/s end to end
    python bench/rollout_backends.py --device cuda --model-dir DIR [--peak-tflops T]
                                                           # the hf backend on a GPU (vllm when importable)

Prints a table (seconds, generated tokens/s and generate-phase MFU per model, response
length, batch and backend; the vllm/hf ratio per cell) and, last, the line
`rollout_backends: hf X tok/s, vllm Y tok/s, ratio Z (25M, response 64, batch 128)`.

What it measures, its options and its latest figures: bench/README.md; its history: bench/NOTES.md and git.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (the bench folder is not a package)

MODELS = {  # name -> make_tiny_model arguments
    "tiny": dict(hidden_size=192, num_layers=4, num_heads=6, max_positions=512),
    "25M": dict(hidden_size=512, num_layers=6, num_heads=8, max_positions=512),
}
BACKENDS = ("hf", "vllm")  # main() drops vllm when it cannot be imported (read at call time, Cell too)
# vllm as the trainers call it: also the sampler's log-prob of every token (rollout/logprob_gap,
# TIS), which the hf backend does not compute. Measured at the headline cell only.
WITH_LOGPROBS = "vllm+lp"
HEADLINE = ("25M", 64, 128)  # model, response length, batch of the last line
MAX_PROMPT = 64
FOLDERS: dict[str, Path] = {}  # name -> a model folder of the user's (--model-dir), used as it is


@dataclass
class Cell:
    model: str
    length: int
    batch: int
    seconds: dict[str, list[float]] = field(default_factory=lambda: {b: [] for b in BACKENDS})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {b: [] for b in BACKENDS})
    flops: float = 0.0  # model FLOPs of one call (real tokens only)

    def tok_s(self, backend: str) -> float:
        if not self.seconds.get(backend):
            return float("nan")
        return self.batch * self.length / _common.median(self.seconds[backend])

    def tok_cpu_s(self, backend: str) -> float:
        if not self.cpu.get(backend):
            return float("nan")
        return self.batch * self.length / _common.median(self.cpu[backend])


# --------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------
@dataclass
class Peak:
    wall: float     # FLOP/s on `threads` threads, wall time
    per_cpu: float  # FLOP per CPU-second of one thread


def matmul_peak(threads: int, sizes: tuple[int, ...] = (2048, 4096), trials: int = 5,
                dtype: str = "float32") -> Peak:
    """Best matmul rates of this machine over a few sizes: float32 through PyTorch's own
    matmul (MKL) and through oneDNN (`ops.matmul`), whichever is faster; another `dtype`
    (bfloat16: AMX where the CPU has it) through PyTorch's matmul."""
    import torch

    from rlhflab.ops import matmul

    products = [lambda a, b: a @ b]
    if dtype == "float32" and matmul.onednn_available():
        products.append(lambda a, b: matmul._onednn(a, b, None))  # a @ bᵀ: the same FLOPs
    best_wall = best_cpu = 0.0
    for n, product in ((n, p) for n in sizes for p in products):
        a, b = (torch.randn(n, n).to(getattr(torch, dtype)) for _ in range(2))
        for t in (threads, 1):
            torch.set_num_threads(t)
            product(a, b)  # warm-up
            for _ in range(trials):
                t0, c0 = time.perf_counter(), time.process_time()
                product(a, b)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if t == threads:
                    best_wall = max(best_wall, 2 * n ** 3 / wall)
                if t == 1:
                    best_cpu = max(best_cpu, 2 * n ** 3 / max(cpu, 1e-9))
    torch.set_num_threads(threads)
    return Peak(best_wall, best_cpu)


def model_flops(config: dict, params: int, prompt_lens: list[int], length: int) -> float:
    """2·N per token plus attention 4·layers·hidden·context, for real tokens only."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    total = 0.0
    for p in prompt_lens:
        total += 2 * params * (p + length)
        contexts = sum(range(1, p + length + 1))  # token k attends to k positions
        total += 4 * layers * hidden * contexts
    return total


def build_model(name: str) -> Path:
    if name in FOLDERS:
        return FOLDERS[name]
    folder = _common.BENCH_DIR / f"rollout-{name}"
    if not (folder / "config.json").is_file():
        from rlhflab.models.tiny import make_tiny_model
        make_tiny_model(folder, **MODELS[name])
    return folder


class Side:
    """One model under both backends: the HF model and a VLLMEngine, in this process."""

    def __init__(self, name: str, max_batch: int, max_length: int, threads: int,
                 dtype: str = "float32", engine_dtype: str | None = None, enforce_eager: bool = False,
                 device: str = "cpu", mixed_precision: str = "no"):
        import json

        from rlhflab.models.load import load_model

        self.name, self.folder = name, build_model(name)
        self.device, self.mixed_precision = device, mixed_precision
        self.config = json.loads((self.folder / "config.json").read_text())
        self.model, self.tok = load_model(str(self.folder), torch_dtype=dtype, device=device)
        self.model.eval()
        self.params = sum(p.numel() for p in self.model.parameters())
        self.threads = threads
        self.engine, self.startup, self.sync = None, float("nan"), float("nan")
        if "vllm" not in BACKENDS:
            return
        from rlhflab.rollout.vllm import VLLMEngine

        t0 = time.perf_counter()
        self.engine = VLLMEngine.create(str(self.folder), self.tok, dtype=engine_dtype or dtype,
                                        max_model_len=MAX_PROMPT + max_length, seed=0,
                                        max_num_seqs=max_batch, enforce_eager=enforce_eager)
        self.startup = time.perf_counter() - t0
        syncs = []
        for _ in range(3):  # the push after an update: every weight, in memory
            t0 = time.perf_counter()
            self.engine.sync_weights(self.model)
            syncs.append(time.perf_counter() - t0)
        self.sync = _common.median(syncs)

    def run(self, backend: str, prompts: list[str], length: int) -> tuple[float, float]:
        """One generate call: (wall seconds, CPU seconds of this process)."""
        import torch

        from rlhflab.rollout import generate

        torch.set_num_threads(self.threads)
        kw = dict(max_new_tokens=length, min_new_tokens=length, temperature=1.0,
                  max_prompt_length=MAX_PROMPT)
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        if backend == "hf":
            with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.mixed_precision == "bf16"):
                roll = generate(self.model, self.tok, prompts, batch_size=len(prompts), **kw)
        else:
            roll = self.engine.generate(prompts, sample_logprobs=backend == WITH_LOGPROBS, **kw)
        if cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert int(roll.response_mask.sum()) == len(prompts) * length, "responses not full length"
        return wall, cpu

    def prompt_lens(self, prompts: list[str]) -> list[int]:
        enc = self.tok(prompts, add_special_tokens=False, truncation=True, max_length=MAX_PROMPT)
        return [len(ids) for ids in enc["input_ids"]]


def measure(models: list[str], lengths: list[int], batches: list[int], repeats: int,
            threads: int, dtype: str = "float32", engine_dtype: str | None = None,
            enforce_eager: bool = False, say=print, device: str = "cpu",
            mixed_precision: str = "no") -> tuple[list[Cell], dict]:
    import torch

    torch.manual_seed(0)
    # Every round draws prompts it has not seen: vLLM caches the KV of prompt prefixes
    # across calls, and a prompt repeated from the last round would skip its prefill
    # (work the hf backend does). PPO also sees new prompts at every step.
    rows = _common.bench_rows(max(batches) * (repeats + 1), seed=0)
    prompts_all = [_common.format_bench_prompt(r["question"]) for r in rows]
    cells, info = [], {}
    for name in models:
        side = Side(name, max(batches), max(lengths), threads, dtype, engine_dtype, enforce_eager,
                    device, mixed_precision)
        info[name] = {"params": side.params, "startup": side.startup, "sync": side.sync}
        say(f"{name}: {side.params / 1e6:.2f}M parameters"
            + (f", vllm engine started in {side.startup:.1f} s, weight sync {1000 * side.sync:.0f} ms"
               if side.engine is not None else ""))
        for length in lengths:
            for batch in batches:
                cell = Cell(name, length, batch)
                backends = BACKENDS
                if (name, length, batch) == HEADLINE and "vllm" in BACKENDS:
                    backends += (WITH_LOGPROBS,)
                    cell.seconds[WITH_LOGPROBS], cell.cpu[WITH_LOGPROBS] = [], []
                for r in range(repeats + 1):  # round 0 warms up
                    prompts = prompts_all[r * batch:(r + 1) * batch]  # both backends: the same
                    if r > 0:  # the mean over the measured rounds (their prompts differ in length)
                        cell.flops += model_flops(side.config, side.params, side.prompt_lens(prompts),
                                                  length) / repeats
                    order = backends if r % 2 == 0 else backends[::-1]
                    for backend in order:
                        wall, cpu = side.run(backend, prompts, length)
                        if r > 0:
                            cell.seconds[backend].append(wall)
                            cell.cpu[backend].append(cpu)
                cells.append(cell)
                say(f"  {name} L={length:<4} B={batch:<4} " + "  ".join(
                    f"{b} {cell.tok_s(b):8.0f} tok/s" for b in BACKENDS))
        del side
        _common.release_freed_memory()
    return cells, info


# --------------------------------------------------------------------------------------
# PPO end to end
# --------------------------------------------------------------------------------------
def ppo_episodes_per_s(backend: str, steps: int = 4, threads: int = 2, device: str = "cpu",
                      mixed_precision: str = "no") -> float:
    """PPO episodes/s of `rlhflab.trainers.ppo.train` with generation.backend=`backend`,
    on the tiny model and the arithmetic task (configs/ppo_debug.yaml, 64 episodes a step)."""
    import tempfile

    from rlhflab.config import load_config
    from rlhflab.data.arith import write_task
    from rlhflab.trainers.ppo import PPORunConfig, train

    with tempfile.TemporaryDirectory() as tmp:
        data = write_task(Path(tmp) / "arith", n_train=256, n_test=16)
        cfg, _ = load_config(_common.REPO / "configs" / "ppo_debug.yaml", PPORunConfig, [
            f"model.name_or_path={build_model('tiny')}", f"dataset.path={data['train']}",
            f"dataset.eval_path={data['test']}", f"training.output_dir={Path(tmp) / 'run'}",
            f"generation.backend={backend}", f"training.total_ppo_steps={steps}",
            "ppo.rollout_samples=64", "ppo.batch_size=64", "ppo.mini_batch_size=32",
            "training.eval_interval=0", "training.save_interval=0", f"training.num_threads={threads}",
            f"training.device={device}", f"training.mixed_precision={mixed_precision}",
            "logging.progress_bar=false", "logging.plots=false", "logging.doctor=false"])
        res = train(cfg, quiet=True)
    return res.samples_per_s


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------
def report(cells: list[Cell], info: dict, peak: Peak, threads: int, peak_what: str | None = None) -> str:
    head = (f"matmul peak ({peak_what}): {peak.wall / 1e9:.1f} GFLOP/s" if peak_what else
            f"matmul peak (float32): {peak.wall / 1e9:.1f} GFLOP/s on {threads} threads (wall), "
            f"{peak.per_cpu / 1e9:.1f} GFLOP per CPU-second of one thread")
    lines = [head, "",
             f"{'model':<6}{'params':>8}{'L':>5}{'B':>5}  {'backend':<7}{'s/call':>8}{'noise':>7}"
             f"{'cpu s':>8}{'tok/s':>8}{'tok/cpu-s':>10}{'MFU':>7}{'MFU/cpu':>8}{'vllm/hf':>8}{'on cpu':>7}"]
    for c in cells:
        for b in c.seconds:
            s, cpu = _common.median(c.seconds[b]), _common.median(c.cpu[b])
            ratio = (f"{c.tok_s(b) / c.tok_s('hf'):8.2f}{c.tok_cpu_s(b) / c.tok_cpu_s('hf'):7.2f}"
                     if b != "hf" else "")
            lines.append(f"{c.model:<6}{info[c.model]['params'] / 1e6:>7.1f}M{c.length:>5}{c.batch:>5}  "
                         f"{b:<7}{s:8.3f}{100 * _common.spread(c.seconds[b]):6.0f}%{cpu:8.3f}"
                         f"{c.tok_s(b):8.0f}{c.tok_cpu_s(b):10.0f}{100 * c.flops / s / peak.wall:6.1f}%"
                         f"{100 * c.flops / cpu / peak.per_cpu:7.1f}%{ratio}")
    return "\n".join(lines)


def targets(cells: list[Cell], peak: Peak) -> str:
    """The issue's targets on the headline cell: ratio >= 1.5, vllm MFU >= 40% at 25M."""
    match = [c for c in cells if (c.model, c.length, c.batch) == HEADLINE]
    if not match:
        model, length, batch = HEADLINE
        return f"targets: the headline cell ({model}, response {length}, batch {batch}) was not measured"
    c = match[0]
    if not c.seconds.get("vllm"):
        return "targets: vllm was not measured (not importable here), so neither target applies"
    mfu = c.flops / _common.median(c.seconds["vllm"]) / peak.wall
    mfu_cpu = c.flops / _common.median(c.cpu["vllm"]) / peak.per_cpu
    lp = (f"; with the sampler's log-probs (as the trainers ask) {c.tok_s(WITH_LOGPROBS) / c.tok_s('hf'):.2f}"
          if c.seconds.get(WITH_LOGPROBS) else "")
    return (f"targets: ratio >= 1.50: {c.tok_s('vllm') / c.tok_s('hf'):.2f} "
            f"(on CPU seconds {c.tok_cpu_s('vllm') / c.tok_cpu_s('hf'):.2f}{lp}); "
            f"vllm MFU at {c.model} >= {'60' if c.model in FOLDERS else '40'}%: {100 * mfu:.1f}% "
            f"(per CPU-second {100 * mfu_cpu:.1f}%){best_vllm_cell(cells, c, peak)}")


def best_vllm_cell(cells: list[Cell], headline_cell: Cell, peak: Peak) -> str:
    """'; best vllm MFU X% at batch B' over the headline model and length, when another
    batch than the headline's (the largest) gave vllm's best wall MFU; else ''."""
    same = [c for c in cells if (c.model, c.length) == (headline_cell.model, headline_cell.length)
            and c.seconds.get("vllm")]
    best = max(same, key=lambda c: c.flops / _common.median(c.seconds["vllm"]), default=headline_cell)
    if best is headline_cell:
        return ""
    mfu = best.flops / _common.median(best.seconds["vllm"]) / peak.wall
    return f"; best vllm MFU {100 * mfu:.1f}% at batch {best.batch}"


def headline(cells: list[Cell]) -> str:
    model, length, batch = HEADLINE
    match = [c for c in cells if (c.model, c.length, c.batch) == HEADLINE]
    hf, vl = (match[0].tok_s("hf"), match[0].tok_s("vllm")) if match else (float("nan"),) * 2
    return (f"rollout_backends: hf {hf:.0f} tok/s, vllm {vl:.0f} tok/s, ratio {vl / hf:.2f} "
            f"({model}, response {length}, batch {batch})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=None, choices=list(MODELS),
                    help="the bench's own models (default: all, or none with --model-dir)")
    ap.add_argument("--model-dir", default=None,
                    help="a model folder to measure, e.g. outputs/models/smollm2-135m-instruct (make models); "
                         "the last line then reports its cell at the first --lengths and the largest --batches")
    ap.add_argument("--lengths", nargs="+", type=int, default=[16, 64, 256])
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 128])
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds per cell (after a warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and compute of both backends (the peak stays float32)")
    ap.add_argument("--engine-dtype", default=None, choices=["float32", "bfloat16"],
                    help="the vllm engine's dtype when it differs from --dtype")
    ap.add_argument("--peak-sizes", nargs="+", type=int, default=[2048, 4096],
                    help="square float32 matmuls that measure the peak")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="the vllm engine without torch.compile (generation.vllm.enforce_eager=true); default: compiled")
    ap.add_argument("--ppo", action="store_true", help="also PPO episodes/s end to end with each backend")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the hf backend's model (and --ppo's run) computes")
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no",
                    help="bf16: the hf backend's generate under bfloat16 autocast (weights stay --dtype); "
                         "--ppo's runs take training.mixed_precision=bf16")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="on --device cuda: the peak FLOP/s (in TFLOP/s) the MFU divides by, e.g. the measured "
                         "bf16 matmul rate; default: square matmuls of --peak-sizes in --dtype (bfloat16 under "
                         "--mixed-precision bf16), measured here")
    args = ap.parse_args(argv)
    global HEADLINE, BACKENDS
    models = args.models if args.models is not None else ([] if args.model_dir else list(MODELS))
    if args.model_dir:
        folder = Path(args.model_dir)
        if not (folder / "config.json").is_file():
            ap.error(f"--model-dir {folder}: no config.json there; for SmolLM2-135M-Instruct run `make models` first")
        quant = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
        if quant.get("quant_method") == "gguf":
            ap.error(f"--model-dir {folder}: its config.json still names a GGUF file (quantization_config), which "
                     f"vLLM cannot load; import the model with `make models` or `rlhflab import-gguf FILE --out DIR`")
        name = folder.resolve().name
        FOLDERS[name] = folder.resolve()  # vLLM reads a relative path as a hub id
        models.append(name)
        HEADLINE = (name, args.lengths[0], max(args.batches))
    from rlhflab.openmp import apply_default_wait
    apply_default_wait()  # as the CLI: idle OpenMP threads poll briefly, then sleep
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (not installed, or installed for another device)
        BACKENDS = ("hf",)
        print(f"vllm cannot be imported here ({type(exc).__name__}: {exc}); its rows are skipped")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device")
        peak_dtype = "bfloat16" if args.mixed_precision == "bf16" else args.dtype
        peak_flops, peak_what = _common.device_peak("cuda", args.threads, tuple(args.peak_sizes), peak_dtype,
                                                 args.peak_tflops)
        peak = Peak(peak_flops, float("nan"))  # no per-CPU-second peak on a GPU
        print(f"machine: {_common.device_name('cuda')} (CUDA)")
    else:
        peak, peak_what = matmul_peak(args.threads, tuple(args.peak_sizes)), None
        print(f"machine: {_common.cpu_name()}, {args.threads} threads")
    cells, info = measure(models, args.lengths, args.batches, args.repeats, args.threads,
                          args.dtype, args.engine_dtype, args.enforce_eager,
                          device=args.device, mixed_precision=args.mixed_precision)
    if args.dtype != "float32" or args.engine_dtype:
        print(f"dtype: hf {args.dtype}, vllm {args.engine_dtype or args.dtype} (MFU is against the "
              f"{'given or measured' if args.device == 'cuda' else 'float32'} peak)")
    if args.mixed_precision == "bf16":
        print("hf backend: generate under bfloat16 autocast")
    if "vllm" in BACKENDS:
        from rlhflab.rollout.vllm import CPU_BLOCK_SIZE
        mode = "eager (enforce_eager)" if args.enforce_eager else "compiled (torch.compile, vLLM default)"
        print(f"vllm engine: {mode}, KV blocks of {CPU_BLOCK_SIZE} tokens on CPU")
    print()
    print(report(cells, info, peak, args.threads, peak_what))
    print(targets(cells, peak))
    if args.ppo:
        print()
        for backend in BACKENDS:
            eps = ppo_episodes_per_s(backend, threads=args.threads, device=args.device,
                                     mixed_precision=args.mixed_precision)
            print(f"PPO end to end, {backend}: {eps:.2f} episodes/s")
    print(headline(cells))
    return 0


if __name__ == "__main__":  # vLLM may start helper processes: keep the entry point import-safe
    raise SystemExit(main())
