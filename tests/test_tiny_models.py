"""`rlhflab make-tiny`: the four architectures and their real features at tiny size, a
151,936-row vocabulary over a small tokenizer, tokenizers for your own text (--corpus,
--byte-level), help text, LoRA targets per architecture, and dtype checks."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhflab import cli
from rlhflab.errors import UserError
from rlhflab.models.load import check_dtype_runs, default_lora_targets, load_model
from rlhflab.models.tiny import build_tokenizer, make_tiny_model


# --------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------
def test_each_architecture_has_its_real_features(tiny_arch_dirs):
    models = {a: AutoModelForCausalLM.from_pretrained(d) for a, d in tiny_arch_dirs.items()}
    names = {a: type(m).__name__ for a, m in models.items()}
    assert names == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "mistral": "MistralForCausalLM", "gemma": "GemmaForCausalLM"}
    attn = {a: m.model.layers[0].self_attn for a, m in models.items()}
    # Qwen2: q/k/v carry biases, o does not; 4 heads share 1 K/V head (GQA); tied head.
    q = models["qwen2"]
    assert attn["qwen2"].q_proj.bias is not None and attn["qwen2"].v_proj.bias is not None
    assert attn["qwen2"].o_proj.bias is None and attn["llama"].q_proj.bias is None
    assert q.config.num_key_value_heads == 1 and attn["qwen2"].k_proj.out_features == 32 // 4
    assert q.lm_head.weight is q.model.embed_tokens.weight
    # Mistral: GQA, a sliding window (256 positions / 4 = 64), its own LM head.
    m = models["mistral"]
    assert m.config.sliding_window == 64 and m.config.num_key_value_heads == 1
    assert m.lm_head.weight is not m.model.embed_tokens.weight
    # Gemma: head_dim 2 x 32 / 4 = 16 (q projects to 4 x 16 = 64 != hidden 32), GELU-tanh,
    # embeddings scaled by sqrt(32), one K/V head, tied.
    g = models["gemma"]
    assert g.config.head_dim == 16 and attn["gemma"].q_proj.out_features == 64
    assert g.config.hidden_act == "gelu_pytorch_tanh" and g.config.num_key_value_heads == 1
    assert float(g.model.embed_tokens.embed_scale) == pytest.approx(32 ** 0.5)
    assert g.lm_head.weight is g.model.embed_tokens.weight
    # Llama keeps every head's K/V unless --kv-heads says otherwise.
    assert models["llama"].config.num_key_value_heads == 4


def test_kv_heads_option_and_bad_sizes_are_one_line_errors(tmp_path, capsys):
    rc = cli.main(["make-tiny", "--out", str(tmp_path / "m"), "--arch", "llama", "--hidden-size", "32",
                   "--layers", "1", "--heads", "4", "--kv-heads", "2"])
    assert rc == 0 and AutoModelForCausalLM.from_pretrained(tmp_path / "m").config.num_key_value_heads == 2
    capsys.readouterr()
    for args, message in ((["--heads", "4", "--kv-heads", "3"], "error: --kv-heads 3 must divide --heads 4"),
                          (["--hidden-size", "36", "--heads", "4"], "head size"),
                          (["--byte-level", "--vocab-size", "100"], "--vocab-size 100 is smaller than the tokenizer's 258")):
        rc = cli.main(["make-tiny", "--out", str(tmp_path / "bad"), "--layers", "1", *args])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_vocab_151936_pads_embedding_rows_beyond_the_tokenizer(tmp_path):
    out = make_tiny_model(tmp_path / "big", hidden_size=16, num_layers=1, num_heads=2, arch="qwen2",
                          vocab_size=151_936)
    model, tok = load_model(str(out))
    assert model.config.vocab_size == 151_936 == model.get_output_embeddings().weight.shape[0]
    assert len(tok) < 1_000  # the BPE ran out of merges on the built-in text: the rest is padding
    ids = tok(["Question: 12 + 7?\nAnswer:"], return_tensors="pt", add_special_tokens=False).input_ids
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 151_936) and torch.isfinite(logits).all()
    # Padding rows can be sampled by a random model; they decode to nothing, not an error.
    assert tok.decode([151_935, 150_000]) == ""


# --------------------------------------------------------------------------------------
# Tokenizers for your own text
# --------------------------------------------------------------------------------------
CORPUS = ["the cat sat on the mat", "a tac is not a cat", "my cat and your tac met the dog",
          "tac tac cat cat dog", "the dog saw a cat and a tac"] * 20


def test_corpus_tokenizer_round_trips_and_splits_words_consistently(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
    rc = cli.main(["make-tiny", "--out", str(tmp_path / "m"), "--corpus", str(path), "--hidden-size", "32",
                   "--layers", "1", "--heads", "2"])
    assert rc == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    for line in set(CORPUS):  # every line of the corpus comes back as it was
        assert tok.decode(tok(line, add_special_tokens=False).input_ids) == line
    # Frequent words are one token each, and the same token wherever they appear.
    cat, tac = tok.convert_tokens_to_ids("Ġcat"), tok.convert_tokens_to_ids("Ġtac")
    assert tok(" cat", add_special_tokens=False).input_ids == [cat]
    assert tok(" tac", add_special_tokens=False).input_ids == [tac]
    ids = tok("my tac and the cat, then a cat and a tac", add_special_tokens=False).input_ids
    assert ids.count(cat) == 2 and ids.count(tac) == 2
    # The built-in arithmetic tokenizer had no such pieces (the c|at, t|a|c).
    builtin = build_tokenizer()
    assert len(builtin(" tac", add_special_tokens=False).input_ids) > 1


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"\xff\xfe\x00bad", "not UTF-8 text"),
    (b"\n  \n", "the file has no text"),
])
def test_bad_corpus_is_a_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    rc = cli.main(["make-tiny", "--out", str(tmp_path / "m"), "--corpus", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: --corpus {path}") and message in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


def test_byte_level_tokens_are_the_utf8_bytes():
    tok = build_tokenizer(byte_level=True)
    assert len(tok) == 256 + 2  # bytes, then <|endoftext|> and <|pad|>
    for text in ["cat tac", "Question: 12 + 7?\nAnswer: 19", "héllo wörld", "🙂 ok", "  two  spaces\t", ""]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    # The special tokens stay whole.
    assert tok("a<|endoftext|>", add_special_tokens=False).input_ids == [97, tok.eos_token_id]


def _options(parser_help: str) -> list[tuple[str, str]]:
    """(option, its help text) pairs from argparse's --help output."""
    body = parser_help.split("options:", 1)[1]
    chunks = re.split(r"\n  (?=-)", body)
    return [(c.split()[0].rstrip(","), " ".join(c.split())) for c in chunks if c.strip().startswith("-")]


@pytest.mark.parametrize("command", ["make-tiny", "make-data"])
def test_every_option_has_help_with_its_default(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    options = [(o, h) for o, h in _options(capsys.readouterr().out) if o not in ("-h", "--help")]
    assert len(options) >= 5
    for option, text in options:
        assert "default" in text, f"{command} {option} has no default in its help: {text}"


# --------------------------------------------------------------------------------------
# LoRA targets and dtypes
# --------------------------------------------------------------------------------------
def test_every_architecture_has_known_lora_targets(tiny_arch_dirs):
    for arch, folder in tiny_arch_dirs.items():
        assert default_lora_targets(AutoModelForCausalLM.from_pretrained(folder)) == ["q_proj", "v_proj"], arch


def test_unknown_architecture_lora_targets_is_an_error_naming_the_key():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Linear(4, 4)
            self.out = torch.nn.Linear(4, 4)

    with pytest.raises(UserError) as exc:
        default_lora_targets(Odd())
    msg = str(exc.value)
    assert msg.startswith("lora.target_modules: no known LoRA targets for Odd") and "['mix', 'out']" in msg


def test_dtypes_torch_runs_on_this_cpu_pass_the_check():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        check_dtype_runs(dtype, torch.device("cpu"))  # torch 2.13's CPU kernels have all three


def test_bfloat16_on_a_gpu_without_it_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(UserError, match=r"model.torch_dtype: bfloat16 is not supported by this GPU; "
                                        r"use model.torch_dtype=float32 \(or float16\)"):
        check_dtype_runs(torch.bfloat16, torch.device("cuda"))


def test_a_dtype_without_kernels_is_a_user_error(monkeypatch, tiny_model_dir):
    def no_half(*args, **kwargs):
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")

    monkeypatch.setattr(torch.nn.functional, "linear", no_half)
    with pytest.raises(UserError) as exc:
        load_model(str(tiny_model_dir), torch_dtype="float16")
    assert str(exc.value) == ("model.torch_dtype: float16 cannot run on cpu (\"addmm_impl_cpu_\" not implemented "
                              "for 'Half'); use model.torch_dtype=float32")


def test_saved_config_names_the_architecture(tiny_arch_dirs):
    for arch, folder in tiny_arch_dirs.items():
        assert json.loads((folder / "config.json").read_text())["model_type"] == arch


def test_linear_lm_head_only_when_logits_are_hidden_times_weight(tiny_arch_dirs):
    # The chunked log-prob path needs logits = f(hidden @ W^T + b) with a plain linear head:
    # true for the four architectures (f the identity) and for Gemma 2's soft-capped logits
    # (f = 30 tanh(. / 30), carried as the head's transform), false for a LoRA-adapted head.
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config

    from rlhflab.models.head import linear_lm_head
    from rlhflab.ops import LogitTransform

    for arch, folder in tiny_arch_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(folder)
        head = linear_lm_head(model)
        assert head is not None and head.weight is model.get_output_embeddings().weight, arch
        assert head.transform == LogitTransform(), arch
    capped = AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0))
    assert linear_lm_head(capped).transform == LogitTransform(softcap=30.0)
    llama = AutoModelForCausalLM.from_pretrained(tiny_arch_dirs["llama"])
    adapted = get_peft_model(llama, LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert linear_lm_head(adapted) is None
