"""One sampler for a model folder: how `rlhflab generate`, `rlhflab eval`, `rlhflab label
generate` and the trainers' held-out evaluation ask a model for responses.

A `Sampler` holds a tokenizer, the prompt format (`rlhflab.data.prompts.PromptFormat`:
the text template, and whether the tokenizer's chat template wraps it, by the trainers'
`use_chat_template` rule) and who samples:

- ``backend="hf"``: a loaded model and Hugging Face ``generate`` (`rlhflab.rollout.generate`);
- ``backend="vllm"``: a vLLM engine on the model folder. Its context is sized for the
  longest prompt it will see, so it starts in `start` with those prompts (the first
  `sample` starts it for its own prompts if nothing did). vLLM is imported then, never
  before.

Either way `sample` returns a `Rollout` in the one layout (`rlhflab.rollout`): the
prompts' and responses' token ids and the decoded response texts, so whoever scores it
does not know who generated.

`seed` in `sample`: each response draws from numbers keyed by (seed, its prompt's index),
so the samples do not depend on the batch size (hf: `generation.seeded_sampling`'s keyed
draw; vLLM: a generator per prompt). Without it, hf follows torch's global random stream.
Greedy decoding ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlhflab.data.prompts import PromptFormat
from rlhflab.rollout import Rollout


@dataclass(frozen=True)
class Sampling:
    """How to decode: greedy, or sampled at a temperature with top-k / top-p."""

    max_new_tokens: int
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_new_tokens: int = 0

    @classmethod
    def from_config(cls, gen, greedy: bool = False) -> "Sampling":
        """The sampling settings of a `generation:` section (`GenerationConfig`)."""
        return cls(gen.max_new_tokens, greedy, gen.temperature, gen.top_k, gen.top_p, gen.min_new_tokens)


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM engine's settings for a command that only generates."""

    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    options: dict | None = None  # the command's names for generation.* keys, for its error messages


class Sampler:
    """A model (a folder, or one already loaded) that answers prompts; see the module docstring."""

    def __init__(self, tokenizer, *, model=None, name: str = "", backend: str = "hf",
                 fmt: PromptFormat | None = None, max_prompt_length: int | None = None,
                 dtype: str = "float32", trust_remote_code: bool = False, engine: EngineSettings | None = None):
        if backend not in ("hf", "vllm"):
            from rlhflab.errors import UserError
            raise UserError(f"backend {backend!r} is not available; use hf or vllm")
        if backend == "hf" and model is None:
            raise ValueError("Sampler: backend hf needs a loaded model")
        self.tokenizer, self.model, self.name, self.backend = tokenizer, model, name, backend
        self.fmt = fmt or PromptFormat()
        self.max_prompt_length = max_prompt_length
        self.dtype, self.trust_remote_code = dtype, trust_remote_code
        self.engine_settings = engine or EngineSettings()
        self.engine = None  # the vLLM engine, once started

    @classmethod
    def from_folder(cls, name_or_path: str, *, backend: str = "hf", template: str = "{prompt}",
                    use_chat_template: bool | str = "auto", key: str = "--use-chat-template",
                    device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False,
                    tokenizer: str | None = None, max_prompt_length: int | None = None,
                    engine: EngineSettings | None = None) -> "Sampler":
        """A sampler on a saved model folder, a hub name or a LoRA adapter folder (merged
        into its base, `models.load.load_model`). hf loads the model here; vllm only the
        tokenizer (the engine reads the weights itself when it starts). The chat-template
        rule is resolved here, so ``true`` on a tokenizer without one fails before any
        weights load; `key` names the setting in that error."""
        from rlhflab.models.load import load_model, load_tokenizer

        tok = load_tokenizer(tokenizer or name_or_path, trust_remote_code,
                             kind="model" if tokenizer is None else "tokenizer")
        fmt = PromptFormat.resolve(template, use_chat_template, tok, key)  # before any weights load
        model = None
        if backend == "hf":
            model, tok = load_model(name_or_path, torch_dtype=dtype, device=device,
                                    trust_remote_code=trust_remote_code, tokenizer=tokenizer)
            model.eval()
        return cls(tok, model=model, name=str(name_or_path), backend=backend, fmt=fmt,
                   max_prompt_length=max_prompt_length, dtype=dtype, trust_remote_code=trust_remote_code,
                   engine=engine)

    # ----------------------------------------------------------------------------------
    def render(self, texts: Sequence[str]) -> list[str]:
        """What the model sees for each prompt text (`PromptFormat.render`, as the trainers'
        `load_prompts` renders its rows)."""
        return [self.fmt.render(t, self.tokenizer) for t in texts]

    def describe(self) -> str:
        """Which template the prompts went through, in one line."""
        return self.fmt.describe(self.name or "the tokenizer")

    def start(self, prompts: Sequence[str], *, max_new_tokens: int, max_num_seqs: int, seed: int = 0) -> None:
        """vLLM: start the engine, sized for these (rendered) prompts plus `max_new_tokens`,
        holding `max_num_seqs` sequences at once. hf: nothing to do."""
        if self.backend != "vllm" or self.engine is not None:
            return
        from rlhflab.rollout.vllm import engine_for_folder

        e = self.engine_settings
        self.engine = engine_for_folder(self.name, self.tokenizer, prompts, max_new_tokens=max_new_tokens,
                                        max_num_seqs=max_num_seqs, max_prompt_length=self.max_prompt_length,
                                        dtype=self.dtype, seed=seed, kv_cache_gb=e.kv_cache_gb,
                                        gpu_memory_utilization=e.gpu_memory_utilization,
                                        enforce_eager=e.enforce_eager, trust_remote_code=self.trust_remote_code,
                                        options=e.options)

    def sample(self, prompts: Sequence[str], sampling: Sampling, *, n: int = 1,
               examples: Sequence[dict] | None = None, batch_size: int = 64, seed: int | None = None,
               first_prompt: int = 0) -> Rollout:
        """`n` responses to each rendered prompt (rows [i·n, (i+1)·n) answer prompt i).

        batch_size: hf, responses per `generate` call (the padding of a batch can change
            float rounding, so evaluations that must agree use the same one); vllm, the
            sequences the engine holds when `sample` has to start it.
        first_prompt: the index of prompts[0] in the whole run, for the seeded noise.
        """
        s = sampling
        kw = dict(n=n, max_new_tokens=s.max_new_tokens, min_new_tokens=s.min_new_tokens, greedy=s.greedy,
                  temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, examples=examples,
                  max_prompt_length=self.max_prompt_length)
        if self.backend == "vllm":
            self.start(prompts, max_new_tokens=s.max_new_tokens, max_num_seqs=min(batch_size, len(prompts)) * n,
                       seed=seed or 0)
            return self.engine.generate(list(prompts), seed=seed, row_offset=first_prompt,
                                        sample_logprobs=False, **kw)
        from rlhflab.rollout import generate

        return generate(self.model, self.tokenizer, prompts, batch_size=batch_size, seed=seed,
                        row_offset=first_prompt * n, **kw)

    def close(self) -> None:
        """Free the vLLM engine (a command serving several models holds one at a time)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.model = None

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
