"""`rlhflab label generate`: sample N responses per prompt and store candidate pairs.

Prompts are rendered as the trainers render theirs (`rlhflab.rollout.sampler.Sampler`):
`prompt_template` ({prompt} replaced; the default sends the file's text as it is), then
the tokenizer's chat template by the `use_chat_template` rule (auto, the default: a
tokenizer with a chat template is asked as a chat model; false sends the text raw, so
format it in the file the way the policy expects, e.g. "User: ...\\nAssistant:").
The database stores the prompt as the file has it, without the template, since `rm` and
`dpo` render the exported rows themselves. Sampling settings come from the
`generation:` section of the config (temperature, top_k, top_p, max/min_new_tokens), and
so does who samples: `generation.backend: hf` (Hugging Face `generate`, the default) or
`vllm` (a vLLM engine on the model folder, started once; `kv_cache_gb`,
`gpu_memory_utilization`). Identical
samples of one prompt are stored once, and every two distinct responses make a pair (or
`pairs_per_prompt` of them drawn at random). Each batch of prompts is one transaction,
so an interrupted run keeps the batches it finished; running again adds only new pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rlhflab.config.schema import CHAT_TEMPLATE_HELP, ChatTemplateUse, GenerationConfig, ModelConfig, f
from rlhflab.errors import UserError
from rlhflab.files import iter_jsonl
from rlhflab.label import db as labeldb


@dataclass
class LabelGenerateConfig:
    """`rlhflab label generate`: the model, sampling settings and how many pairs to make."""

    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    prompt_template: str = f("{prompt}", "how a prompt is shown to the model; {prompt} is replaced")
    use_chat_template: ChatTemplateUse = f("auto", CHAT_TEMPLATE_HELP)
    n: int = f(4, "responses sampled per prompt", ge=2)
    pairs_per_prompt: Optional[int] = f(None, "pairs kept per prompt, drawn at random; null keeps all n(n-1)/2", gt=0)
    batch_size: int = f(8, "prompts per generate() call", gt=0)
    device: str = f("cpu", "cpu, cuda or auto")
    seed: int = f(0, "seed for sampling and for choosing pairs")


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a jsonl file of {"prompt": str} rows (duplicates dropped, order kept)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--prompts {path}: no such file; give a jsonl file with a 'prompt' per row")
    prompts = []
    for lineno, row in iter_jsonl(path, 'one {"prompt": ...} object per line'):
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f"{path} line {lineno}: needs a non-empty string 'prompt'")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"--prompts {path}: no rows; write one {{\"prompt\": ...}} per line")
    return list(dict.fromkeys(prompts))


def sample_responses(sampler, prompts: list[str], n: int, gen: GenerationConfig, *,
                     seed: int | None = None, first_prompt: int = 0) -> list[list[str]]:
    """n sampled continuations for each (rendered) prompt: a list (per prompt) of n strings.

    The responses are a `Rollout`'s, whichever backend `sampler` runs: cut after the first
    EOS (or end of turn), decoded without special tokens. `seed`: the samples of each
    prompt keyed by (seed, its index in the whole run, prompts[0] being number
    `first_prompt`), so they do not depend on batch_size.
    """
    from rlhflab.rollout.sampler import Sampling

    roll = sampler.sample(prompts, Sampling.from_config(gen), n=n, batch_size=len(prompts) * n, seed=seed,
                          first_prompt=first_prompt)
    return [roll.responses[i * n:(i + 1) * n] for i in range(len(prompts))]  # rows i*n.. answer prompt i


def generate_pairs(cfg: LabelGenerateConfig, prompts_path: str | Path,
                   out_db: str | Path, say=print) -> labeldb.AddResult:
    """Sample, then store prompts, responses and pairs in `out_db` (created if new).

    With generation.backend=vllm the engine starts (or fails, e.g. vLLM missing) before
    the database is opened, so a failed start leaves no new file behind. `say(line)`
    hears which template the prompts went through.
    """
    prompts = read_prompts(prompts_path)  # a bad file fails before torch is imported
    if "{prompt}" not in cfg.prompt_template:
        raise UserError(f"prompt_template: {cfg.prompt_template!r} has no {{prompt}}; e.g. \"{{prompt}}\" "
                        "(the file's text as it is)")

    import torch

    from rlhflab.models.quant import refuse_quantization
    from rlhflab.rollout.sampler import EngineSettings, Sampler

    m, gen = cfg.model, cfg.generation
    refuse_quantization(m, "rlhflab label generate")
    torch.manual_seed(cfg.seed)
    sampler = Sampler.from_folder(
        m.name_or_path, backend=gen.backend, template=cfg.prompt_template, use_chat_template=cfg.use_chat_template,
        key="use_chat_template", device=cfg.device, dtype=m.torch_dtype, trust_remote_code=m.trust_remote_code,
        tokenizer=m.tokenizer,
        engine=EngineSettings(gen.vllm.kv_cache_gb, gen.vllm.gpu_memory_utilization, gen.vllm.enforce_eager))
    rendered = dict(zip(prompts, sampler.render(prompts)))
    # vLLM: the engine starts now, sized for every prompt (hf: nothing to start)
    sampler.start(list(rendered.values()), max_new_tokens=gen.max_new_tokens,
                  max_num_seqs=min(cfg.batch_size, len(prompts)) * cfg.n, seed=cfg.seed)
    say(f"prompts: {sampler.describe()}")
    # vLLM always draws from per-prompt generators; hf only with generation.seeded_sampling.
    seed = cfg.seed if gen.seeded_sampling or gen.backend == "vllm" else None
    source = str(m.name_or_path)
    conn = labeldb.connect(out_db, create=True)
    result = labeldb.AddResult()
    try:
        for start in range(0, len(prompts), cfg.batch_size):
            batch = prompts[start:start + cfg.batch_size]
            samples = sample_responses(sampler, [rendered[p] for p in batch], cfg.n, gen, seed=seed,
                                       first_prompt=start)
            with labeldb.transaction(conn):
                for prompt, responses in zip(batch, samples, strict=True):
                    labeldb.add_candidates(conn, prompt, responses, source,
                                           cfg.pairs_per_prompt, cfg.seed, result)
            result.rows += len(batch)
        result.prompts = labeldb.count(conn, "prompts")
        result.responses = labeldb.count(conn, "responses")
    finally:
        conn.close()
        sampler.close()
    return result
