"""What running the last layer's MLP on the response rows only saves (models.actor_critic.last_layer_rows).

    python bench/last_layer_rows.py [--threads 1] [--rounds 60] [--prompt 27 --response 16]

One `response_hidden` forward + backward of the benchmarks' tiny model (the PPO bench's:
192 hidden, 4 layers, lean MLP) on 32 rows of `--prompt` + `--response` tokens, with the
shortcut and with it switched off (the plain pass: every position through every layer),
interleaved round by round after 10 warm-up rounds; the median CPU seconds of each.
Both give the same hidden states and gradients (tests/test_last_layer_rows.py). Last line:

    last_layer_rows: plain X ms, short Y ms, ratio Z (P prompt + T response tokens, N layers)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


@contextmanager
def _plain(*args, **kwargs):
    yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: CPU time without waits)")
    ap.add_argument("--rounds", type=int, default=60, help="measured rounds of each (default 60)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=27, help="prompt tokens (the PPO bench's padded prompts: 27)")
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--model-dir", default=str(_common.BENCH_DIR / "tiny-model"))
    a = ap.parse_args(argv)
    from rlhflab.openmp import apply_default_wait
    apply_default_wait()  # as the CLI: idle OpenMP threads poll briefly, then sleep
    import torch

    from rlhflab.models import actor_critic as ac
    from rlhflab.models.lean import lean_mlp
    from rlhflab.models.load import load_model

    torch.set_num_threads(a.threads)
    model, _ = load_model(str(_common.ensure_tiny_model(a.model_dir)))
    lean_mlp(model)
    layers = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (a.rows, a.prompt), generator=g)
    response = torch.randint(3, model.config.vocab_size, (a.rows, a.response), generator=g)
    ones_p, ones_r = torch.ones_like(prompt), torch.ones_like(response)
    short_rows = ac.last_layer_rows

    def one(kind: str) -> float:
        ac.last_layer_rows = short_rows if kind == "short" else _plain
        try:
            model.zero_grad(set_to_none=True)
            c0 = time.process_time()
            ac.response_hidden(model, prompt, ones_p, response, ones_r).square().sum().backward()
            return time.process_time() - c0
        finally:
            ac.last_layer_rows = short_rows

    times: dict[str, list[float]] = {"plain": [], "short": []}
    for r in range(10 + a.rounds):
        for kind in (("plain", "short") if r % 2 else ("short", "plain")):
            t = one(kind)
            if r >= 10:
                times[kind].append(t)
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    print(f"{a.rows} rows x ({a.prompt} prompt + {a.response} response) tokens, {layers} layers, "
          f"{a.threads} thread(s); median CPU ms of {a.rounds} interleaved rounds")
    for k, v in times.items():
        print(f"  {k:<6} {med[k]:8.2f} ms  (range {1000 * min(v):.2f}-{1000 * max(v):.2f})")
    print(f"last_layer_rows: plain {med['plain']:.1f} ms, short {med['short']:.1f} ms, "
          f"ratio {med['plain'] / med['short']:.3f} ({a.prompt} prompt + {a.response} response tokens, {layers} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
