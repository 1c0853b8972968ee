"""Chat templates with locally built tokenizers in the two real styles (ChatML/Qwen-like and
Llama-3-like): prompt rendering with the generation prompt, the end-of-turn token found
from the template, generation stopping there (also when generation_config lacks it), the
token scored as part of the response, reward text without template tokens, SFT targets
ending with it, and the one `use_chat_template` rule (auto / true / false)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhflab import cli
from rlhflab.config.schema import DatasetConfig
from rlhflab.data import sft as sftdata
from rlhflab.data.chat import end_of_turn_id, resolve_use_chat_template
from rlhflab.data.prompts import load_prompts
from rlhflab.errors import UserError
from rlhflab.models.load import load_model
from rlhflab.models.tiny import make_tiny_model
from rlhflab.rollout import eos_ids_of, generate

STYLES = {
    "chatml": {"eot": "<|im_end|>",
               "prompt": "<|im_start|>user\nQ: 2 + 2?<|im_end|>\n<|im_start|>assistant\n"},
    "llama3": {"eot": "<|eot_id|>",
               "prompt": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nQ: 2 + 2?<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n")},
}


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("chat")
    return {s: make_tiny_model(base / s, hidden_size=32, num_layers=2, num_heads=2, chat_template=s)
            for s in STYLES}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat-data") / "rows.jsonl"
    path.write_text(json.dumps({"question": "2 + 2?", "answer": "4"}) + "\n")
    return path


# --------------------------------------------------------------------------------------
# Rendering and the end-of-turn token
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
def test_prompt_rendered_with_the_generation_prompt(chat_dirs, prompts_file, style):
    _, tok = load_model(str(chat_dirs[style]))
    d = DatasetConfig(path=str(prompts_file), prompt_template="Q: {prompt}")  # use_chat_template: auto
    (ex,) = load_prompts(d, tok, "train")
    assert ex.prompt == STYLES[style]["prompt"]
    # Every template marker is one special token, not spelled out in pieces.
    ids = tok(ex.prompt, add_special_tokens=False).input_ids
    for marker in ("<|im_start|>", "<|im_end|>") if style == "chatml" else (
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert tok.convert_tokens_to_ids(marker) in ids and marker in tok.all_special_tokens
    # false: the plain template; the same file, no markers.
    (plain,) = load_prompts(DatasetConfig(path=str(prompts_file), prompt_template="Q: {prompt}",
                                          use_chat_template=False), tok, "train")
    assert plain.prompt == "Q: 2 + 2?"


@pytest.mark.parametrize("style", STYLES)
def test_end_of_turn_token_and_eos_ids(chat_dirs, style):
    model, tok = load_model(str(chat_dirs[style]))
    eot = tok.convert_tokens_to_ids(STYLES[style]["eot"])
    assert end_of_turn_id(tok) == eot != tok.eos_token_id
    # make-tiny writes it into generation_config, as the real models do ...
    assert model.generation_config.eos_token_id == [tok.eos_token_id, eot]
    assert eos_ids_of(model, tok) == [tok.eos_token_id, eot]
    # ... and a hub model whose generation_config leaves it out still stops there.
    model.generation_config.eos_token_id = tok.eos_token_id
    assert eos_ids_of(model, tok) == [tok.eos_token_id, eot]


def test_no_template_no_end_of_turn(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    assert end_of_turn_id(tok) is None and eos_ids_of(model, tok) == [tok.eos_token_id]
    tok.chat_template = "{{ raise_exception('only system turns') }}"  # a template that cannot render
    assert end_of_turn_id(tok) is None


# --------------------------------------------------------------------------------------
# Generation, mask, reward text
# --------------------------------------------------------------------------------------
def _force(model, token_ids: list[int]):
    """Make greedy decoding emit `token_ids` in order (one per LM-head call after the first)."""
    calls = {"n": 0}

    def hook(module, inputs, output):
        step = min(calls["n"], len(token_ids) - 1)
        calls["n"] += 1
        out = output.clone()
        out[..., token_ids[step]] += 1_000.0
        return out

    return model.get_output_embeddings().register_forward_hook(hook)


@pytest.mark.parametrize("style", STYLES)
def test_generation_stops_at_end_of_turn_scores_it_and_rewards_see_clean_text(chat_dirs, style):
    model, tok = load_model(str(chat_dirs[style]))
    model.generation_config.eos_token_id = tok.eos_token_id  # as a hub config that lacks it
    eot = tok.convert_tokens_to_ids(STYLES[style]["eot"])
    four = tok("4", add_special_tokens=False).input_ids
    assert len(four) == 1
    # Would write "4 4 <eot> 4 4 ..." if nothing stopped it; max_new_tokens is 8.
    handle = _force(model, [four[0], four[0], eot] + [four[0]] * 8)
    prompt = STYLES[style]["prompt"]
    roll = generate(model, tok, [prompt, prompt], max_new_tokens=8, greedy=True)
    handle.remove()
    assert roll.response_ids.shape[1] == 3                       # stopped at the end-of-turn token
    assert roll.response_ids[0].tolist() == [four[0], four[0], eot]
    assert roll.response_mask.tolist() == [[1, 1, 1]] * 2          # the end-of-turn token is scored
    assert not roll.hit_limit.any()
    assert roll.responses == ["44", "44"]                          # what rewards read: no template tokens
    # Its log-prob is a real response token's: finite and part of the sequence sum.
    from rlhflab.models.actor_critic import PolicyOnly
    out = PolicyOnly(model)(roll.prompt_ids, roll.prompt_mask, roll.response_ids, roll.response_mask)
    assert torch.isfinite(out.logprobs).all() and (out.logprobs[:, 2] < 0).all()


@pytest.mark.parametrize("style", STYLES)
def test_sft_target_ends_with_the_end_of_turn_token(chat_dirs, style):
    _, tok = load_model(str(chat_dirs[style]))
    eot = tok.convert_tokens_to_ids(STYLES[style]["eot"])
    ex = sftdata.row_to_example({"question": "Q: 2 + 2?", "answer": "4"}, 0)
    prompt, response, append_eos = sftdata.format_example(ex, tok, sftdata.Template(use_chat_template=True))
    assert prompt == STYLES[style]["prompt"]             # the same text RL prompts get
    assert response == "4" + STYLES[style]["eot"] and not append_eos  # ChatML's trailing "\n" left out
    t = sftdata.tokenize_example(prompt, response, append_eos, tok, 64)
    assert t.labels[-1] == eot and tok.eos_token_id not in t.input_ids  # learns to close its turn
    assert t.labels[: t.prompt_len] == [sftdata.IGNORE_INDEX] * t.prompt_len


def test_dpo_responses_end_with_the_end_of_turn_token_under_a_template(chat_dirs, tmp_path):
    from rlhflab.data.chat import response_end_id
    from rlhflab.trainers.dpo import read_preference_pairs, tokenize_pairs

    _, tok = load_model(str(chat_dirs["chatml"]))
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 2?", "chosen": "4", "rejected": "5"}) + "\n")
    pairs = read_preference_pairs(str(path), DatasetConfig(prompt_field="prompt"), tok)  # auto
    assert pairs[0].prompt == "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    (tp,) = tokenize_pairs(pairs, tok, 64, 16, True, response_end_id(tok, True))
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert tp.chosen_ids[-1] == eot and tp.rejected_ids[-1] == eot


# --------------------------------------------------------------------------------------
# The one rule
# --------------------------------------------------------------------------------------
def test_the_rule_auto_true_false(chat_dirs, tiny_model_dir):
    _, chat_tok = load_model(str(chat_dirs["chatml"]))
    _, plain_tok = load_model(str(tiny_model_dir))
    assert resolve_use_chat_template("auto", chat_tok) is True
    assert resolve_use_chat_template("auto", plain_tok) is False
    assert resolve_use_chat_template(True, chat_tok) is True
    assert resolve_use_chat_template(False, chat_tok) is False
    with pytest.raises(UserError) as exc:
        resolve_use_chat_template(True, plain_tok, "data.use_chat_template")
    msg = str(exc.value)
    assert msg.startswith("data.use_chat_template: true, but the tokenizer") and "has no chat template" in msg
    assert "set data.use_chat_template=auto" in msg and "\n" not in msg


def test_every_command_defaults_to_auto():
    import importlib
    import inspect

    root = Path(__file__).resolve().parents[1] / "configs"
    schemas = []
    for name in ("sft", "rm", "dpo", "ppo", "grpo", "rloo", "dr_grpo", "reinforce_pp", "trpo"):
        module = importlib.import_module(f"rlhflab.trainers.{name}")
        schemas += [c for n, c in inspect.getmembers(module, inspect.isclass)
                    if n.endswith("RunConfig") and c.__module__ == module.__name__]
    assert len(schemas) == 9
    for schema in schemas:
        cfg = schema()
        section = cfg.data if hasattr(cfg, "data") else cfg.dataset
        assert section.use_chat_template == "auto", schema.__name__
    for path in sorted(root.glob("*.yaml")):  # and every shipped config says auto
        text = path.read_text()
        if "use_chat_template" in text:
            assert "use_chat_template: auto" in text, path.name


@pytest.mark.parametrize("command, config, key", [
    ("sft", "sft_debug.yaml", "data.use_chat_template"),
    ("ppo", "ppo_debug.yaml", "dataset.use_chat_template"),
])
def test_true_without_a_template_is_a_one_line_cli_error(command, config, key, tiny_model_dir, arith_dir,
                                                         tmp_path, capsys):
    root = Path(__file__).resolve().parents[1] / "configs"
    data = ([f"data.path={arith_dir / 'sft.jsonl'}", f"data.eval_path={arith_dir / 'test.jsonl'}"]
            if command == "sft" else [f"dataset.path={arith_dir / 'train.jsonl'}",
                                      f"dataset.eval_path={arith_dir / 'test.jsonl'}"])
    rc = cli.main([command, "--config", str(root / config), f"model.name_or_path={tiny_model_dir}",
                   f"training.output_dir={tmp_path / 'run'}", "logging.progress_bar=false", *data,
                   f"{key}=true"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bars
    assert rc == 2 and err.startswith(f"error: {key}: true, but the tokenizer")


@pytest.mark.slow
def test_sft_under_chatml_learns_to_close_its_turn(tmp_path):
    # SFT on question/answer rows through the template, then greedy generation from RL-style
    # prompts (dataset.prompt_template "{prompt}", auto): responses end with <|im_end|>,
    # which the mask keeps and the decoded text drops.
    from rlhflab.config import load_config
    from rlhflab.data import arith
    from rlhflab.trainers.sft import SFTRunConfig, train_sft

    folder = make_tiny_model(tmp_path / "chatml-64", hidden_size=64, num_layers=2, num_heads=4,
                             chat_template="chatml")
    rows = arith.make_split(600, seed=5)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in rows))
    root = Path(__file__).resolve().parents[1] / "configs"
    cfg, _ = load_config(root / "sft_debug.yaml", SFTRunConfig, [
        f"model.name_or_path={folder}", f"data.path={data}", "data.eval_path=null",
        "data.eval_fraction=0.1", f"training.output_dir={tmp_path / 'run'}", "training.num_threads=1",
        "logging.progress_bar=false", "logging.plots=false", "sft.epochs=6", "sft.batch_size=8",
        "sft.learning_rate=2e-3", "sft.num_eval_generate=0", "sft.eval_before=false"])
    res = train_sft(cfg, quiet=True)
    model, tok = load_model(str(res.final_dir))
    examples = load_prompts(DatasetConfig(path=str(data), num_samples=16), tok, "train")
    assert examples[0].prompt.startswith("<|im_start|>user\n")
    roll = generate(model, tok, [e.prompt for e in examples], max_new_tokens=48, greedy=True)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    lengths = roll.response_mask.sum(-1)
    ended = [int(roll.response_ids[i, lengths[i] - 1]) == eot for i in range(len(examples))]
    # Measured: 16 of 16 end with <|im_end|>; about 7 s on one core.
    assert sum(ended) >= 14, (sum(ended), roll.responses[:3])
    assert not any("<|im_end|>" in r or "<|im_start|>" in r for r in roll.responses)
    assert all("####" in r for r, e in zip(roll.responses, ended) if e)
