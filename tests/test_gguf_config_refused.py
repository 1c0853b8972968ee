"""A model folder whose config.json still has a GGUF `quantization_config` is refused when it
loads, naming the folder and `rlhflab import-gguf`: transformers would load it, but such a
model refuses `save_pretrained`, so without the check a run failed only at its final save."""

from __future__ import annotations

import json
import shutil

import pytest

from rlhflab.errors import UserError


@pytest.fixture
def gguf_marked(tiny_model_dir, tmp_path):
    """A copy of the tiny model with the `quantization_config` a GGUF load leaves in its config."""
    folder = tmp_path / "marked"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gguf"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_load_model_refuses_it(gguf_marked, tiny_model_dir):
    from rlhflab.models.load import load_model

    with pytest.raises(UserError, match="import-gguf") as err:
        load_model(str(gguf_marked))
    assert str(gguf_marked) in str(err.value) and "\n" not in str(err.value)
    model, _ = load_model(str(tiny_model_dir))  # the same folder without the key loads
    assert getattr(model.config, "quantization_config", None) is None


def test_reward_model_training_refuses_it(gguf_marked):
    from rlhflab.config import load_config
    from rlhflab.trainers.rm import RMRunConfig, build_reward_model

    cfg = load_config(None, RMRunConfig, [f"model.name_or_path={gguf_marked}"])[0]
    with pytest.raises(UserError, match=f"{gguf_marked}.*import-gguf"):
        build_reward_model(cfg, "cpu")


def test_cli_prints_one_line_and_exits_2(gguf_marked, tmp_path, capsys):
    from rlhflab import cli

    code = cli.main(["sft", "--config", "configs/sft_debug.yaml", f"model.name_or_path={gguf_marked}",
                     f"training.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and "import-gguf" in err and str(gguf_marked) in err
    assert not (tmp_path / "out" / "final").exists()
