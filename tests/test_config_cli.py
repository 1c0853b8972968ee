"""`rlhflab config show|resolve`, through `rlhflab.cli.main` as a user runs it."""

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from rlhflab.cli import main
from rlhflab.config import load_config
from rlhflab.trainers.ppo import PPORunConfig
from rlhflab.config import cli as config_cli

DATA = Path(__file__).parent / "data" / "config"
DEBUG = DATA / "debug.yaml"


def _leaf_fields(cls, prefix=""):
    """(dotted key, field) of every non-section key, list items as key[].field."""
    hints = typing.get_type_hints(cls)
    for fl in dataclasses.fields(cls):
        tp, key = hints[fl.name], prefix + fl.name
        if dataclasses.is_dataclass(tp):
            yield from _leaf_fields(tp, key + ".")
            continue
        yield key, fl
        args = typing.get_args(tp)
        if args and dataclasses.is_dataclass(args[0]):
            yield from _leaf_fields(args[0], key + "[].")


def test_show_lists_every_key_with_type_default_and_help(capsys):
    assert main(["config", "show", "ppo"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    leaves = list(_leaf_fields(PPORunConfig))
    assert len(leaves) > 60
    for key, fl in leaves:
        assert key in lines, key
        assert fl.metadata["help"] and lines[key].rstrip().endswith(fl.metadata["help"]), key
    assert len(lines) == len(leaves)
    # spot checks of the type and default columns
    assert lines["ppo.kl_coeff"].split()[1:3] == ["float", "0.05"]
    assert lines["ppo.kl_estimator"].split()[1:3] == ["k1|k2|k3|abs|mse", '"k1"']
    assert lines["ppo.dual_clip"].split()[1:5] == ["float", "|", "null", "null"]
    assert lines["reward.sources[].weight"].split()[1:3] == ["float", "1.0"]
    # each section gets a header with its docstring
    assert "\nppo:  # PPO settings" in out
    # old key names that still work are listed with their new names
    assert "#   training.total_ppo_steps is the old name of training.total_steps; it still works" in out


def test_resolve_prints_the_validated_yaml(capsys):
    assert main(["config", "resolve", "ppo", "--config", str(DEBUG), "ppo.kl_coeff=0.2",
                 "dataset.max_gen_length=24"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    cfg, _ = load_config(DEBUG, PPORunConfig, ["ppo.kl_coeff=0.2", "dataset.max_gen_length=24"])
    assert printed == dataclasses.asdict(cfg)
    assert printed["ppo"]["kl_coeff"] == 0.2
    assert printed["generation"]["max_new_tokens"] == 24      # interpolation resolved
    assert printed["ppo"]["rollout_samples"] == 8             # from debug.yaml
    assert printed["generation"]["temperature"] == 0.7        # from base.yaml
    # overrides before --config, and no --config at all (schema defaults)
    assert main(["config", "resolve", "ppo", "ppo.epochs=1", "--config", str(DEBUG)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["ppo"]["epochs"] == 1
    assert main(["config", "resolve", "ppo", "ppo.epochs=3"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["ppo"]["epochs"] == 3


def test_bad_config_prints_error_and_exits_2(capsys, tmp_path):
    rc = main(["config", "resolve", "ppo", "--config", str(DEBUG), "ppo.kl_coef=0.1", "ppo.clip_eps=1.5"])
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    # Each key is reported where it was set: on the command line, not in the file.
    assert lines[0] == "error: command line (ppo.kl_coef=0.1): ppo.kl_coef: unknown key; did you mean ppo.kl_coeff?"
    assert lines[1] == "command line (ppo.clip_eps=1.5): ppo.clip_eps: must be < 1, got 1.5"
    assert "Traceback" not in captured.err
    # YAML syntax error and missing file: also `error: ...`, exit 2
    broken = tmp_path / "broken.yaml"
    broken.write_text("ppo: [1,\n")
    assert main(["config", "resolve", "ppo", "--config", str(broken)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {broken}: not valid YAML")
    assert main(["config", "resolve", "ppo", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_unavailable_schema_is_a_user_error(capsys, monkeypatch):
    monkeypatch.setitem(config_cli.SCHEMAS, "sft", "rlhflab.no_such_module:SFTRunConfig")
    assert main(["config", "show", "sft"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the config schema of `rlhflab sft` (rlhflab.no_such_module:SFTRunConfig)")
    monkeypatch.setitem(config_cli.SCHEMAS, "sft", "rlhflab.config.schema:NoSuchClass")
    assert main(["config", "show", "sft"]) == 2
    assert "rlhflab sft" in capsys.readouterr().err


def test_unknown_command_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as info:
        main(["config", "show", "ppoo"])
    assert info.value.code == 2
    assert "invalid choice: 'ppoo'" in capsys.readouterr().err
