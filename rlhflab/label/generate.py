"""`rlhflab label generate`: sample N responses per prompt and store candidate pairs.

Prompts are fed to the model as plain text (format them in the file the way the policy
expects, e.g. "User: ...\\nAssistant:"). Sampling settings come from the `generation:`
section of the config (temperature, top_k, top_p, max/min_new_tokens). Identical samples
of one prompt are stored once, and every two distinct responses make a pair (or
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


def sample_responses(model, tokenizer, prompts: list[str], n: int,
                     gen: GenerationConfig) -> list[list[str]]:
    """n sampled continuations for each prompt: a list (per prompt) of n strings."""
    import torch

    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)  # (B, L)
    kwargs = dict(do_sample=True, num_return_sequences=n, max_new_tokens=gen.max_new_tokens,
                  min_new_tokens=gen.min_new_tokens, temperature=gen.temperature,
                  top_p=gen.top_p, top_k=gen.top_k, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        out = model.generate(**enc, **kwargs)  # (B * n, L + T), rows grouped by prompt
    new_tokens = out[:, enc["input_ids"].shape[1]:]  # (B * n, T): left padding aligns the prompts
    texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]


def generate_pairs(cfg: LabelGenerateConfig, prompts_path: str | Path,
                   out_db: str | Path) -> labeldb.AddResult:
    """Sample, then store prompts, responses and pairs in `out_db` (created if new)."""
    prompts = read_prompts(prompts_path)  # a bad file fails before torch is imported

    import torch

    from rlhflab.models.load import load_model

    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model.name_or_path, torch_dtype=cfg.model.torch_dtype,
                                  device=cfg.device, trust_remote_code=cfg.model.trust_remote_code,
                                  tokenizer=cfg.model.tokenizer)
    model.eval()
    source = str(cfg.model.name_or_path)
    conn = labeldb.connect(out_db, create=True)
    result = labeldb.AddResult()
    try:
        for start in range(0, len(prompts), cfg.batch_size):
            batch = prompts[start:start + cfg.batch_size]
            samples = sample_responses(model, tokenizer, batch, cfg.n, cfg.generation)
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
