"""DPO trainer: config, the labelling app's export read as it is, sequence log-probs over
response tokens only, the loss of each kind by hand, reference log-probs computed once,
a CLI run, and learning on right-vs-off-by-one pairs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlhflab.config import load_config
from rlhflab.config.schema import DatasetConfig
from rlhflab.data.arith import write_jsonl
from rlhflab.data.preferences import PairText, write_off_by_one_pairs
from rlhflab.errors import ConfigError, UserError
from rlhflab.models.actor_critic import Reference, ResponseOutput
from rlhflab.models.load import load_model
from rlhflab.trainers import dpo
from rlhflab.trainers.dpo import (DPORunConfig, DPOSection, TokenizedPair, dpo_micro_batch_loss, pair_batch,
                                  policy_sequence_logprobs, read_preference_pairs, tokenize_pairs)
from rlhflab.models.actor_critic import PolicyOnly

from test_grpo_helpers import ROOT, TEMPLATE, debug_config, easy_task, small_model, warm_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return small_model(tmp_path_factory)


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    import shutil

    out = tmp_path_factory.mktemp("pairs")
    for split in ("train", "test"):
        shutil.copy(easy_task(tmp_path_factory) / f"{split}.jsonl", out / f"{split}.jsonl")
    write_off_by_one_pairs(out)  # chosen right, rejected off by one (up or down)
    return out


def _cfg(model_dir, pairs_dir, out, *overrides):
    return debug_config(DPORunConfig, "dpo_debug.yaml", model_dir, pairs_dir, out,
                        f"dataset.path={pairs_dir / 'pairs_train.jsonl'}",
                        f"dataset.eval_path={pairs_dir / 'pairs_test.jsonl'}", "dpo.task_eval_path=null",
                        *overrides)


# --------------------------------------------------------------------------------------
# Config and data
# --------------------------------------------------------------------------------------
def test_shipped_configs_validate():
    main, _ = load_config(ROOT / "configs" / "dpo.yaml", DPORunConfig)
    debug, _ = load_config(ROOT / "configs" / "dpo_debug.yaml", DPORunConfig)
    assert main.dpo.loss_kind == "sigmoid" and main.lora.enabled and main.dataset.prompt_field == "prompt"
    assert debug.dpo.task_eval_path == "outputs/arith/test.jsonl" and debug.training.device == "cpu"


@pytest.mark.parametrize("override, message", [
    ("model.reference=none", "model.reference: none leaves DPO nothing to compare against"),
    ("dpo.beta=0", "dpo.beta: must be > 0"),
    ("dpo.loss_kind=dpo", "dpo.loss_kind: expected one of"),
    ("dpo.mini_batch_size=64", "dpo.mini_batch_size: 64 exceeds batch_size 16"),
])
def test_bad_config(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs" / "dpo_debug.yaml", DPORunConfig, [override])


def test_label_smoothing_only_with_sigmoid():
    with pytest.raises(ConfigError, match="dpo.label_smoothing: only the sigmoid loss uses it"):
        load_config(ROOT / "configs" / "dpo_debug.yaml", DPORunConfig,
                    ["dpo.loss_kind=ipo", "dpo.label_smoothing=0.1"])


def test_reads_the_label_export_as_it_is(tmp_path):
    rows = [
        {"prompt": "2 + 2?", "chosen": " 4", "rejected": " 5", "margin": 1.0, "pair_id": 7, "n_labels": 3},
        {"prompt": "1 + 1?", "chosen": " 2", "rejected": " 3", "margin": 0.5, "pair_id": "b", "n_labels": 1},
        {"prompt": "3 + 0?", "chosen": " 3", "rejected": " 4", "margin": 0.0, "pair_id": 9, "n_labels": 2,
         "tie": True},
    ]
    path = write_jsonl(rows, tmp_path / "export.jsonl")
    warnings = []
    pairs = read_preference_pairs(str(path), DatasetConfig(prompt_field="prompt", prompt_template=TEMPLATE),
                                  warn=warnings.append)
    assert [p.chosen for p in pairs] == [" 4", " 2"]  # the tie row left out, the order kept
    assert pairs[0].prompt == "Question: 2 + 2?\nAnswer:" and pairs[0].chosen == " 4" and pairs[0].rejected == " 5"
    assert warnings and "1 tie rows left out" in warnings[0]
    # The conversational form (chosen/rejected as messages) is read too; no chat template
    # on this tokenizer, so the plain User/Assistant layout is used.
    write_jsonl([{"chosen": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}],
                  "rejected": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "5"}]}],
                tmp_path / "chat.jsonl")
    (chat,) = read_preference_pairs(str(tmp_path / "chat.jsonl"), DatasetConfig(prompt_field="prompt"))
    assert "2 + 2?" in chat.prompt and chat.chosen.strip() == "4" and chat.rejected.strip() == "5"
    write_jsonl([{"prompt": "x", "chosen": "y"}], tmp_path / "bad.jsonl")
    with pytest.raises(UserError, match=r"bad.jsonl: 1 of 1 rows are not preference pairs \(row 0 lacks"):
        read_preference_pairs(str(tmp_path / "bad.jsonl"), DatasetConfig(prompt_field="prompt"), warn=warnings.append)


def test_tokenize_appends_eos_and_truncates(model_dir):
    _, tok = load_model(str(model_dir))
    pair = PairText("Question: 1 + 1?\nAnswer:", " 1 + 1 = 2\n#### 2", " 1 + 1 = 3\n#### 3")
    (full,) = tokenize_pairs([pair], tok, max_prompt_length=64, max_response_length=64)
    assert full.chosen_ids[-1] == tok.eos_token_id and full.rejected_ids[-1] == tok.eos_token_id
    (cut,) = tokenize_pairs([pair], tok, max_prompt_length=3, max_response_length=4)
    assert cut.prompt_ids == full.prompt_ids[-3:] and cut.chosen_ids == full.chosen_ids[:4]


# --------------------------------------------------------------------------------------
# Sequence log-probs and the loss
# --------------------------------------------------------------------------------------
def test_sequence_logprobs_sum_response_tokens_only(model_dir):
    model, tok = load_model(str(model_dir))
    actor = PolicyOnly(model).eval()
    # Prompts and responses of different lengths, so the batch carries left and right padding.
    pairs = [TokenizedPair([5, 9, 11, 40], [20, 21], [22, 23, 24, 25]),
             TokenizedPair([7], [30, 31, 32], [33])]
    batch = pair_batch(pairs, tok.pad_token_id, "cpu")
    assert batch.input_ids.shape == (4, 4 + 4) and batch.prompt_len == 4
    with torch.no_grad():
        got = policy_sequence_logprobs(actor, batch)  # (4,): chosen 0, chosen 1, rejected 0, rejected 1

    def by_hand(prompt, response):  # one unpadded sequence: Σ_t log p(r_t | prompt, r_<t)
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        return sum(float(logp[len(prompt) - 1 + t, r]) for t, r in enumerate(response))

    want = [by_hand(p.prompt_ids, p.chosen_ids) for p in pairs] + [by_hand(p.prompt_ids, p.rejected_ids) for p in pairs]
    assert torch.allclose(got, torch.tensor(want), atol=1e-4)


def test_sequence_logprobs_from_hidden_states_equal_the_logits_path(model_dir):
    # The trainer's path (hidden states of the real response tokens + the head's weight,
    # chunked) against today's (the (B, T, V) logits into sequence_logprobs): the same
    # sums and the same gradients.
    pairs = [TokenizedPair([5, 9, 11, 40], [20, 21], [22, 23, 24, 25]), TokenizedPair([7], [30, 31, 32], [33])]
    results = []
    for path in ("hidden", "logits"):
        torch.manual_seed(0)
        model, tok = load_model(str(model_dir))
        actor = PolicyOnly(model).train()
        batch = pair_batch(pairs, tok.pad_token_id, "cpu")
        if path == "hidden":
            lp = policy_sequence_logprobs(actor, batch)
        else:
            out = actor.forward_response(batch.input_ids, batch.attention_mask, batch.prompt_len)
            lp = dpo.sequence_logprobs(out.logits, batch)
        (lp * torch.tensor([1.0, -2.0, 0.5, 3.0])).sum().backward()
        results.append((lp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (lp_h, g_h), (lp_l, g_l) = results
    # The two paths are passes of different shapes (the real tokens' rows, chunked, against
    # the whole (B, T, V) logits), so their float32 sums round differently: each gradient
    # entry is a sum over ~16 tokens of terms of order 1, a few ulps apart (up to 3.6e-6
    # seen on a busy 2-core AMD EPYC), hence 1e-5; a wrong token or mask is off by ~1e-1.
    torch.testing.assert_close(lp_h, lp_l, rtol=1e-6, atol=1e-5)
    for name in g_l:
        torch.testing.assert_close(g_h[name], g_l[name], rtol=1e-5, atol=1e-5)


def test_reference_cache_equals_the_reference_logits_path(model_dir):
    # ReferenceCache goes through Reference.logprobs (hidden states, the engine's path); the
    # same sums as the reference's full (B, T, V) logits into sequence_logprobs.
    model, tok = load_model(str(model_dir))
    ref = Reference.frozen_copy(model)
    pairs = [TokenizedPair([5, 9, 11, 40], [20, 21], [22, 23, 24, 25]), TokenizedPair([7], [30, 31, 32], [33])]
    cache = dpo.ReferenceCache(ref, pairs, tok.pad_token_id, torch.device("cpu"), batch_size=2)
    cache.fill()
    batch = pair_batch(pairs, tok.pad_token_id, "cpu")
    want = dpo.sequence_logprobs(ref.response_logits(batch.input_ids, batch.attention_mask, batch.prompt_len), batch)
    torch.testing.assert_close(torch.cat([cache.chosen, cache.rejected]), want, rtol=1e-6, atol=1e-5)


class UniformActor(torch.nn.Module):
    """Logits of 0 over V = 10 tokens: every response token has log-prob −ln 10."""

    def forward_response(self, input_ids, attention_mask, prompt_len, with_values=False):
        t = input_ids.shape[1] - prompt_len
        return ResponseOutput(torch.zeros(input_ids.shape[0], t, 10, requires_grad=True), None)


# Chosen has 2 tokens, rejected 3, so log π(y_w) = −2 ln 10 = −4.605170 and
# log π(y_l) = −3 ln 10 = −6.907755. The reference is set 1 below on chosen and 1 above on
# rejected: log π_ref(y_w) = −5.605170, log π_ref(y_l) = −5.907755.
# h = (−4.605170 + 6.907755) − (−5.605170 + 5.907755) = 2.302585 − 0.302585 = 2.0; β = 0.1, βh = 0.2.
#   sigmoid:        −log σ(0.2) = log(1 + e^−0.2) = log 1.818731 = 0.598139
#   sigmoid, ε=0.1: 0.9·0.598139 + 0.1·log(1 + e^0.2) = 0.538325 + 0.1·0.798139 = 0.618139
#   ipo:            (h − 1/(2β))² = (2 − 5)² = 9
#   hinge:          max(0, 1 − βh) = 0.8
# Implicit rewards: β·(−4.605170 + 5.605170) = 0.1 and β·(−6.907755 + 5.907755) = −0.1.
@pytest.mark.parametrize("kind, smoothing, expected", [
    ("sigmoid", 0.0, 0.598139), ("sigmoid", 0.1, 0.618139), ("ipo", 0.0, 9.0), ("hinge", 0.0, 0.8)])
def test_dpo_loss_by_hand(kind, smoothing, expected):
    sec = DPOSection(beta=0.1, loss_kind=kind, label_smoothing=smoothing)
    # Two pairs with different prompt lengths: padding must not change anything.
    pairs = [TokenizedPair([1, 2, 3], [4, 5], [6, 7, 8]), TokenizedPair([1], [4, 5], [6, 7, 8])]
    ln10 = math.log(10.0)
    ref_chosen = torch.full((2,), -2 * ln10 - 1.0)
    ref_rejected = torch.full((2,), -3 * ln10 + 1.0)
    loss, stats = dpo_micro_batch_loss(UniformActor(), pairs, ref_chosen, ref_rejected, sec, 0, "cpu")
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-5)
    assert torch.allclose(stats.chosen_rewards, torch.full((2,), 0.1), atol=1e-6)
    assert torch.allclose(stats.rejected_rewards, torch.full((2,), -0.1), atol=1e-6)
    assert torch.allclose(stats.policy_chosen, torch.full((2,), -2 * ln10), atol=1e-5)


# --------------------------------------------------------------------------------------
# The reference, computed once
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("precompute", [True, False])
def test_reference_logprobs_are_computed_once_per_pair(model_dir, pairs_dir, tmp_path, monkeypatch, precompute):
    rows = []
    real = Reference.logprobs

    def counting(self, prompt_ids, *args, **kwargs):
        rows.append(prompt_ids.shape[0])
        return real(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(Reference, "logprobs", counting)
    cfg = _cfg(model_dir, pairs_dir, tmp_path / "run", "dataset.num_samples=12", "dataset.num_eval_samples=4",
               "dpo.batch_size=4", "dpo.mini_batch_size=2", "dpo.epochs=2", "dpo.max_steps=null",
               f"dpo.precompute_ref_logprobs={str(precompute).lower()}", "training.eval_interval=3",
               "training.save_interval=0")
    res = dpo.train(cfg, quiet=True)
    assert len(res.history) == 6  # 2 epochs x 12/4 steps, each pair seen twice, evaluated 3 times
    assert sum(rows) == 2 * (12 + 4)  # each pair's chosen and rejected rows went through once
    assert res.state["ref_cache"].complete and res.state["ref_cache"].n_computed == 12
    if precompute:  # the frozen copy is released once everything is cached
        assert res.models.reference is None
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "eval/rewards/accuracies", "eval/loss"):
        assert key in res.history[-1] and math.isfinite(res.history[-1][key]), key


def test_cli_run_writes_outputs(model_dir, pairs_dir, tmp_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from rlhflab.cli import main

    out = tmp_path / "run"
    task = easy_task(tmp_path_factory)
    assert main(["dpo", "--config", str(ROOT / "configs/dpo_debug.yaml"), f"model.name_or_path={model_dir}",
                 f"dataset.path={pairs_dir / 'pairs_train.jsonl'}", f"dataset.eval_path={pairs_dir / 'pairs_test.jsonl'}",
                 f"dpo.task_eval_path={task / 'test.jsonl'}", "dataset.num_eval_samples=8", "dpo.max_steps=2",
                 "training.save_interval=1", "training.eval_interval=2", f"training.output_dir={out}",
                 "training.num_threads=1", "logging.progress_bar=false"]) == 0
    for name in ("effective_config.yaml", "metrics.jsonl", "step_1/trainer_state.pt", "final/config.json",
                 "plots/accuracy.png", "eval/step_2.jsonl", "train_result.json"):
        assert (out / name).exists(), name
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"eval/accuracy", "eval/rewards/accuracies", "eval/logp_accuracy"} <= set(last)
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_make_arith_pairs_cli(tmp_path, tmp_path_factory):
    import shutil

    from rlhflab.cli import main

    task = tmp_path / "task"
    shutil.copytree(easy_task(tmp_path_factory), task)
    assert main(["dpo", "--make-arith-pairs", str(task)]) == 0
    row = json.loads((task / "pairs_test.jsonl").read_text().splitlines()[0])
    assert set(row) == {"prompt", "chosen", "rejected", "margin", "pair_id", "n_labels"}
    rows = [json.loads(line) for line in (task / "pairs_train.jsonl").read_text().splitlines()]
    slips = {int(r["rejected"].split("####")[1]) - int(r["chosen"].split("####")[1]) for r in rows}
    assert slips == {-1, 1}  # off by one both ways, so "smaller is better" is no shortcut
    assert main(["dpo"]) == 2  # neither --config nor --make-arith-pairs: a one-line error


# --------------------------------------------------------------------------------------
# Learning
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dpo_raises_accuracy_and_implicit_reward_accuracy(tmp_path_factory, pairs_dir, tmp_path):
    task = easy_task(tmp_path_factory)
    cfg = _cfg(warm_model(tmp_path_factory), pairs_dir, tmp_path / "run", f"dpo.task_eval_path={task / 'test.jsonl'}",
               "dataset.num_eval_samples=100", "dpo.batch_size=16", "dpo.mini_batch_size=16", "dpo.epochs=2",
               "dpo.max_steps=null", "dpo.beta=0.1", "dpo.learning_rate=1e-4", "training.eval_interval=1000",
               "training.save_interval=0")
    res = dpo.train(cfg, quiet=True)
    before, after = res.eval_before, res.eval_after
    print(f"DPO held-out accuracy {before['eval/accuracy']:.2f} -> {after['eval/accuracy']:.2f}, "
          f"implicit reward accuracy {before['eval/rewards/accuracies']:.2f} -> "
          f"{after['eval/rewards/accuracies']:.2f}")
    assert after["eval/accuracy"] >= before["eval/accuracy"] + 0.1
    # Implicit rewards tie at 0 before training (accuracy 0); after it, most held-out pairs
    # rank the right answer above the wrong one, and so does the policy's own log-prob.
    assert after["eval/rewards/accuracies"] >= 0.6 and after["eval/rewards/margins"] > 0
    assert after["eval/logp_accuracy"] > before["eval/logp_accuracy"]
