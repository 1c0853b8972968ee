"""The small traps of issue 47: report_to as a string, weights written 0644, no progress
frames into a piped log, and a broken torchvision named with its fix."""

from __future__ import annotations

import os
import stat

import pytest

from rlhflab.errors import UserError


def test_report_to_as_a_string_is_a_one_element_list():
    from rlhflab.config import load_config
    from rlhflab.errors import ConfigError
    from rlhflab.trainers.grpo import GRPORunConfig

    cfg, _ = load_config(None, GRPORunConfig, ["logging.report_to=tensorboard"])
    assert cfg.logging.report_to == ["tensorboard"]
    with pytest.raises(ConfigError, match="logging.report_to"):  # a wrong choice is still refused
        load_config(None, GRPORunConfig, ["logging.report_to=tensorbord"])


def test_weights_are_written_with_the_mode_of_every_other_file(tmp_path):
    from rlhflab.models.checkpoint import atomic_folder
    from rlhflab.models.tiny import make_tiny_model

    mask = os.umask(0o022)
    try:
        out = make_tiny_model(tmp_path / "tiny", hidden_size=16, num_layers=1, num_heads=2)
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
        assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
        # A checkpoint folder: safetensors' private 0600 file becomes 0644 before the rename.
        with atomic_folder(tmp_path / "step_1") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x")
            os.chmod(tmp / "model.safetensors", 0o600)
        assert stat.S_IMODE((tmp_path / "step_1" / "model.safetensors").stat().st_mode) == 0o644
    finally:
        os.umask(mask)


def test_no_progress_frames_when_stderr_is_not_a_terminal(ppo_cfg, tmp_path, capsys):
    from rlhflab.trainers.ppo import train

    # logging.progress_bar on; pytest's captured stderr is no terminal
    train(ppo_cfg("training.total_steps=1", "logging.progress_bar=true"), quiet=False)
    assert "\r" not in capsys.readouterr().err


def test_a_broken_torchvision_is_named_with_its_fix(monkeypatch, tiny_model_dir):
    import transformers

    from rlhflab.models.load import load_model

    def broken(*args, **kwargs):
        # transformers' lazy import: the RuntimeError from torchvision's operator registration,
        # raised while importing the config module, re-raised as a ModuleNotFoundError.
        try:
            try:
                raise RuntimeError("operator torchvision::nms does not exist")
            except RuntimeError as inner:
                raise ImportError("cannot import torchvision.ops") from inner
        except ImportError as mid:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'. Are this object's requirements "
                                      "defined correctly?") from mid

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
    with pytest.raises(UserError) as info:
        load_model(str(tiny_model_dir))
    msg = str(info.value)
    assert "operator torchvision::nms does not exist" in msg and "pip uninstall torchvision torchaudio torchcodec" in msg
    assert "\n" not in msg
