"""QLoRA keys (`model.load_in_4bit` / `load_in_8bit`): every refusal is one UserError
line naming the key and the fix, and the config path reaches the check before any model
loads. (The quantised path itself needs CUDA and bitsandbytes: not run here.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rlhflab.config import load_config
from rlhflab.config.schema import LoRAConfig, ModelConfig
from rlhflab.errors import ConfigError, UserError
from rlhflab.models import quant
from rlhflab.trainers.sft import SFTRunConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_no_quantisation_asks_for_nothing():
    assert quant.quantization_kwargs(ModelConfig(), LoRAConfig(), "cpu") == {}
    assert quant.quantization_key(ModelConfig()) is None


@pytest.mark.parametrize("key", ["load_in_4bit", "load_in_8bit"])
def test_cpu_device_is_refused_with_what_to_do(key):
    cfg = ModelConfig(**{key: True})
    with pytest.raises(UserError) as err:
        quant.quantization_kwargs(cfg, LoRAConfig(enabled=True), torch.device("cpu"))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"model.{key}: ") and "CUDA only" in msg
    assert f"model.{key}=false" in msg


def test_missing_bitsandbytes_is_refused_on_cuda(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(UserError, match=r"model.load_in_4bit: bitsandbytes is not installed; pip install"):
        quant.quantization_kwargs(ModelConfig(load_in_4bit=True), LoRAConfig(enabled=True), "cuda")


def test_without_lora_is_refused_also_from_python():
    with pytest.raises(UserError, match=r"model.load_in_8bit: a quantised base cannot be trained itself; "
                                        r"set lora.enabled=true"):
        quant.quantization_kwargs(ModelConfig(load_in_8bit=True), LoRAConfig(enabled=False), "cuda")


def test_config_load_refuses_without_lora_both_bits_and_a_separate_critic(ppo_cfg):
    with pytest.raises(ConfigError, match=r"model.load_in_4bit: a quantised base cannot be trained itself"):
        ppo_cfg("model.load_in_4bit=true")
    with pytest.raises(ConfigError, match=r"model.load_in_8bit: load_in_4bit is set too"):
        ppo_cfg("model.load_in_4bit=true", "model.load_in_8bit=true", "lora.enabled=true")
    with pytest.raises(ConfigError, match=r"separate critic trains all its weights"):
        ppo_cfg("model.load_in_4bit=true", "lora.enabled=true", "model.critic=separate")
    with pytest.raises(ConfigError, match=r"model.load_in_4bit: a quantised base cannot"):
        load_config(CONFIGS / "sft_debug.yaml", SFTRunConfig, ["model.load_in_4bit=true"])
    # With LoRA it loads: the device decides at build time.
    assert ppo_cfg("model.load_in_4bit=true", "lora.enabled=true").model.load_in_4bit


def _never(*args, **kwargs):
    raise AssertionError("a model was loaded before the quantisation check")


def test_build_models_reaches_the_check_before_loading(ppo_cfg, monkeypatch):
    from rlhflab.models import setup
    from rlhflab.trainers import ppo

    monkeypatch.setattr(setup, "load_model", _never)
    cfg = ppo_cfg("model.load_in_4bit=true", "lora.enabled=true", "training.device=cpu")
    with pytest.raises(UserError, match=r"model.load_in_4bit: bitsandbytes' quantised layers run on CUDA only"):
        ppo.build_models(cfg)


def test_sft_reaches_the_check_before_loading(tiny_sft_rm_dir, tmp_path, monkeypatch):
    from rlhflab.trainers import sft

    monkeypatch.setattr(sft, "load_model", _never)
    cfg, _ = load_config(CONFIGS / "sft_debug.yaml", SFTRunConfig, [
        f"model.name_or_path={tiny_sft_rm_dir}", "model.load_in_8bit=true", "lora.enabled=true",
        f"training.output_dir={tmp_path / 'run'}", "training.device=cpu"])
    with pytest.raises(UserError, match=r"model.load_in_8bit: .*CUDA only"):
        sft.build_model(cfg, torch.device("cpu"))


def test_cli_prints_one_line(tmp_path, capsys):
    from rlhflab.cli import main

    assert main(["sft", "--config", str(CONFIGS / "sft_debug.yaml"), "model.load_in_4bit=true",
                 f"training.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "lora.enabled=true" in err


def test_prepare_is_a_no_op_on_a_plain_model():
    model = torch.nn.Linear(2, 2)
    assert quant.prepare_quantized(model, gradient_checkpointing=False) is model


def test_full_precision_commands_refuse_a_quantised_base():
    """rm, classifier, tpo and label generate load in full precision: the key is refused, not ignored."""
    refuse_quantization = quant.refuse_quantization
    refuse_quantization(ModelConfig(), "rlhflab rm")  # nothing asked: nothing said
    with pytest.raises(UserError, match=r"^model\.load_in_8bit: rlhflab tpo loads its model in full precision .*"
                                        r"set model\.load_in_8bit=false$"):
        refuse_quantization(ModelConfig(load_in_8bit=True), "rlhflab tpo")
