"""`rlhflab label generate`: sample N responses per prompt and store candidate pairs.

Prompts are fed to the model as plain text, tokenised without special tokens as every
rlhflab rollout is (format them in the file the way the policy expects, e.g.
"User: ...\\nAssistant:"). Sampling settings come from the `generation:` section of the
config (temperature, top_k, top_p, max/min_new_tokens), and so does who samples:
`generation.backend: hf` (Hugging Face `generate`, the default) or `vllm` (a vLLM engine
on the model folder, started once; `kv_cache_gb`, `gpu_memory_utilization`). Identical
samples of one prompt are stored once, and every two distinct responses make a pair (or
`pairs_per_prompt` of them drawn at random). Each batch of prompts is one transaction,
so an interrupted run keeps the batches it finished; running again adds only new pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rlhflab.config.schema import GenerationConfig, ModelConfig, f
from rlhflab.errors import UserError
from rlhflab.files import iter_jsonl
from rlhflab.label import db as labeldb


@dataclass
class LabelGenerateConfig:
    """`rlhflab label generate`: the model, sampling settings and how many pairs to make."""

    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
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


def sample_responses(model, tokenizer, prompts: list[str], n: int, gen: GenerationConfig, *,
                     engine=None, seed: int | None = None, first_prompt: int = 0) -> list[list[str]]:
    """n sampled continuations for each prompt: a list (per prompt) of n strings.

    `engine`: a `VLLMEngine` that samples instead of `model` (generation.backend=vllm).
    Either way the responses are a `Rollout`'s: cut after the first EOS (or end of turn),
    decoded without special tokens. `seed`: the samples of each row (hf,
    generation.seeded_sampling) or of each prompt (vllm) keyed by (seed, its index in the
    whole run, prompts[0] being number `first_prompt`), so they do not depend on batch_size.
    """
    kw = dict(n=n, max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
              temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p)
    if engine is not None:
        roll = engine.generate(prompts, seed=seed, row_offset=first_prompt, sample_logprobs=False, **kw)
    else:
        from rlhflab.rollout import generate
        roll = generate(model, tokenizer, prompts, batch_size=len(prompts) * n, seed=seed,
                        row_offset=first_prompt * n, **kw)
    return [roll.responses[i * n:(i + 1) * n] for i in range(len(prompts))]  # rows i*n.. answer prompt i


def generate_pairs(cfg: LabelGenerateConfig, prompts_path: str | Path,
                   out_db: str | Path) -> labeldb.AddResult:
    """Sample, then store prompts, responses and pairs in `out_db` (created if new).

    With generation.backend=vllm the engine starts (or fails, e.g. vLLM missing) before
    the database is opened, so a failed start leaves no new file behind.
    """
    prompts = read_prompts(prompts_path)  # a bad file fails before torch is imported

    import torch

    m, gen = cfg.model, cfg.generation
    torch.manual_seed(cfg.seed)
    model = engine = None
    if gen.backend == "vllm":  # the engine loads the weights itself: only the tokenizer here
        from rlhflab.models.load import load_tokenizer
        from rlhflab.rollout.vllm import engine_for_folder

        tokenizer = load_tokenizer(m.tokenizer or m.name_or_path, m.trust_remote_code, kind="model")
        engine = engine_for_folder(m.name_or_path, tokenizer, prompts, max_new_tokens=gen.max_new_tokens,
                                   max_num_seqs=min(cfg.batch_size, len(prompts)) * cfg.n, dtype=m.torch_dtype,
                                   seed=cfg.seed, kv_cache_gb=gen.kv_cache_gb,
                                   gpu_memory_utilization=gen.gpu_memory_utilization,
                                   enforce_eager=gen.enforce_eager, trust_remote_code=m.trust_remote_code)
    else:
        from rlhflab.models.load import load_model

        model, tokenizer = load_model(m.name_or_path, torch_dtype=m.torch_dtype, device=cfg.device,
                                      trust_remote_code=m.trust_remote_code, tokenizer=m.tokenizer)
        model.eval()
    seed = cfg.seed if gen.seeded_sampling or engine is not None else None
    source = str(m.name_or_path)
    conn = labeldb.connect(out_db, create=True)
    result = labeldb.AddResult()
    try:
        for start in range(0, len(prompts), cfg.batch_size):
            batch = prompts[start:start + cfg.batch_size]
            samples = sample_responses(model, tokenizer, batch, cfg.n, gen, engine=engine, seed=seed,
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
    return result
