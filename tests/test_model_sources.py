"""Say what the thing is: a missing model path fails fast (no minute of hub retries), a
missing run output names the command that makes it, and a LoRA adapter folder given as a
model is recognised (loaded on its base, or named as an adapter with its base)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from rlhflab import cli
from rlhflab.errors import UserError
from rlhflab.models import load as modelload
from rlhflab.models.load import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_hub_calls(monkeypatch):
    """Fail the test if transformers is asked to fetch anything."""
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("from_pretrained was called for a model that cannot be loaded")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)


def test_hub_like_typo_fails_at_once_when_the_hub_is_unreachable(tmp_path, monkeypatch, no_hub_calls):
    # `outptus/tiny-model`: no `outptus/` folder here, so it looks like a hub id. Today the
    # hub client retries for about 49 s offline before failing.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(modelload, "hub_reachable", lambda *a, **k: False)
    with pytest.raises(UserError) as err:
        load_model("outptus/tiny-model")
    msg = str(err.value)
    # The local folder comes first: that is the likely mistake.
    assert msg.startswith("model 'outptus/tiny-model': no such local folder")
    assert "hub cannot be reached" in msg and "make-tiny --out outptus/tiny-model" in msg


def test_offline_switch_is_honoured_without_a_probe(monkeypatch):
    modelload.hub_reachable.cache_clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("probed the network under HF_HUB_OFFLINE=1")

    monkeypatch.setattr(modelload.socket, "create_connection", no_network)
    try:
        assert modelload.hub_reachable() is False
    finally:
        modelload.hub_reachable.cache_clear()


def test_real_load_of_a_missing_hub_like_name_takes_seconds(tmp_path, monkeypatch):
    # No mocks: on this offline machine the probe fails fast; on one with network the hub
    # answers 401/404 fast. Either way a one-line UserError within a few seconds.
    monkeypatch.chdir(tmp_path)
    modelload.hub_reachable.cache_clear()
    start = time.perf_counter()
    with pytest.raises(UserError):
        load_model("outptus/tiny-model")
    assert time.perf_counter() - start < 15


def test_missing_run_outputs_name_the_command_that_makes_them(tmp_path, monkeypatch, no_hub_calls):
    from rlhflab.rewards.model import load_reward_model

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        load_model("outputs/sft_judge/final")     # rm_debug.yaml's base model
    msg = str(err.value)
    assert "rlhflab sft --config configs/sft_debug.yaml training.output_dir=outputs/sft_judge" in msg
    assert "make-tiny" not in msg
    with pytest.raises(UserError) as err:
        load_reward_model("outputs/rm_debug/final")  # ppo_rm_debug.yaml's reward model
    msg = str(err.value)
    assert "reward model path 'outputs/rm_debug/final' does not exist" in msg
    assert "rlhflab rm --config configs/rm_debug.yaml training.output_dir=outputs/rm_debug" in msg


def test_rm_and_ppo_rm_debug_configs_say_what_to_run_first(tmp_path, monkeypatch, capsys, tiny_sft_rm_dir):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    (tmp_path / "outputs" / "prefs").mkdir(parents=True)
    assert cli.main(["rm", "--config", "configs/rm_debug.yaml"]) == 2
    err = capsys.readouterr().err
    assert "outputs/sft_judge/final" in err and "rlhflab sft" in err and "make-tiny" not in err
    assert not (tmp_path / "outputs" / "rm_debug").exists()
    assert cli.main(["ppo", "--config", "configs/ppo_rm_debug.yaml"]) == 2
    err = capsys.readouterr().err
    assert "outputs/sft_debug/final" in err and "rlhflab sft" in err and "make-tiny" not in err


@pytest.fixture(scope="module")
def adapter_dir(tiny_lora_adapter_dir) -> Path:
    """A LoRA adapter on the tiny model (B non-zero, so it changes the outputs), saved alone."""
    return tiny_lora_adapter_dir


def test_adapter_folder_loads_as_its_base_with_the_adapter_merged(tiny_sft_rm_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, tok = load_model(str(adapter_dir))
    assert not hasattr(model, "peft_config")  # a plain model: the adapter is merged in
    base = AutoModelForCausalLM.from_pretrained(str(tiny_sft_rm_dir)).eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_sft_rm_dir)),
                                     str(adapter_dir)).eval()
    ids = tok(["Question: 1 + 2\nAnswer:"], return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        got, want, plain = (m.eval()(ids).logits for m in (model, peft, base))
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)  # the adapter did change the model
    assert load_tokenizer(str(adapter_dir)).vocab_size == tok.vocab_size  # the base's tokenizer


def test_adapter_folder_where_a_full_model_is_needed_is_named(adapter_dir, tiny_sft_rm_dir, tmp_path):
    from rlhflab.rewards.model import load_reward_model

    with pytest.raises(UserError) as err:
        load_reward_model(str(adapter_dir))
    msg = str(err.value)
    assert "is a LoRA adapter" in msg and str(tiny_sft_rm_dir) in msg
    # An adapter whose base is not here: named as an adapter, with the missing base.
    moved = tmp_path / "adapter"
    shutil.copytree(adapter_dir, moved)
    cfg = (moved / "adapter_config.json").read_text().replace(str(tiny_sft_rm_dir), str(tmp_path / "gone"))
    (moved / "adapter_config.json").write_text(cfg)
    with pytest.raises(UserError, match=r"is a LoRA adapter on the base model '.*gone', which does not exist"):
        load_model(str(moved))


@pytest.mark.parametrize("kind, command", [("model", "rlhflab rm --config configs/rm_debug.yaml"),
                                           ("classifier", "rlhflab classifier --config configs/classifier_debug.yaml")])
def test_a_missing_learned_reward_names_the_command_that_trains_it(tmp_path, kind, command):
    from rlhflab.errors import UserError
    from rlhflab.models.load import check_model_source

    missing = tmp_path / "runs" / "judge" / "final"
    with pytest.raises(UserError) as exc:
        check_model_source(str(missing), f"reward.sources[1] ({kind})")
    msg = str(exc.value)
    assert msg.startswith(f"reward.sources[1] ({kind}) path") and command in msg
    assert f"training.output_dir={missing.parent}" in msg and "rlhflab sft" not in msg
