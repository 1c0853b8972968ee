"""Config loading: defaults inheritance, overrides, interpolation, validation messages."""

import dataclasses
from pathlib import Path

import pytest

from rlhflab.config import load_config, save_effective_config
from rlhflab.trainers.ppo import PPORunConfig
from rlhflab.trainers.sft import SFTRunConfig
from rlhflab.errors import ConfigError, UserError

DATA = Path(__file__).parent / "data" / "config"
BASE, DEBUG = DATA / "base.yaml", DATA / "debug.yaml"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _errors(path, overrides=None) -> list[str]:
    """The lines of the ConfigError raised by loading `path`; each must be one line naming
    where its key was set: the command-line override that set it, else the file."""
    with pytest.raises(ConfigError) as info:
        load_config(path, PPORunConfig, overrides)
    lines = str(info.value).splitlines()
    assert lines
    for line in lines:
        if not any(line.startswith(f"command line ({o}): ") for o in overrides or []):
            assert line.startswith(f"{path}: "), line
    return lines


def test_base_loads_with_typed_values():
    cfg, effective = load_config(BASE, PPORunConfig)
    assert isinstance(cfg, PPORunConfig)
    assert cfg.ppo.learning_rate == 1e-5 and isinstance(cfg.ppo.learning_rate, float)  # "1e-5" is a float
    assert cfg.ppo.kl_estimator == "k3"
    assert cfg.generation.max_new_tokens == 48                 # ${dataset.max_gen_length}
    assert cfg.reward.sources[0].name == "gsm8k" and cfg.reward.sources[0].weight == 1.0
    assert cfg.ppo.epochs == 4                                 # not in the file: the schema default
    assert effective.generation.max_new_tokens == 48           # the effective tree is resolved


def test_debug_inherits_from_base_relative_to_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `defaults: [base.yaml]` is found beside debug.yaml, not in the cwd
    cfg, _ = load_config(DEBUG, PPORunConfig)
    assert cfg.ppo.rollout_samples == 8 and cfg.ppo.mini_batch_size == 4      # from debug
    assert cfg.training.total_steps == 2 and cfg.training.output_dir == "outputs/debug"
    assert cfg.generation.temperature == 0.7 and cfg.ppo.kl_estimator == "k3"  # from base
    # the interpolation in base.yaml is resolved after the merge, so it sees debug's value
    assert cfg.generation.max_new_tokens == 16


def test_defaults_chain_and_order(tmp_path):
    _write(tmp_path, "a.yaml", "ppo:\n  epochs: 1\n  kl_coeff: 0.5\n")
    _write(tmp_path, "b.yaml", "ppo:\n  epochs: 2\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    main = _write(sub, "main.yaml", "defaults: [../a.yaml, ../b.yaml]\nppo:\n  vf_coeff: 0.3\n")
    cfg, _ = load_config(main, PPORunConfig)
    # later bases win over earlier ones, the file itself over its bases
    assert (cfg.ppo.epochs, cfg.ppo.kl_coeff, cfg.ppo.vf_coeff) == (2, 0.5, 0.3)


def test_dotted_overrides():
    cfg, _ = load_config(DEBUG, PPORunConfig, ["ppo.kl_coeff=0.1", "dataset.max_gen_length=20",
                                               "lora.enabled=true", "logging.report_to=[tensorboard]",
                                               "ppo.learning_rate=3e-6"])
    assert cfg.ppo.kl_coeff == 0.1 and cfg.lora.enabled is True
    assert cfg.generation.max_new_tokens == 20      # the override feeds the interpolation
    assert cfg.logging.report_to == ["tensorboard"]
    assert cfg.ppo.learning_rate == 3e-6
    # an override may also set the interpolated key directly
    cfg, _ = load_config(DEBUG, PPORunConfig, ["generation.max_new_tokens=5"])
    assert cfg.generation.max_new_tokens == 5 and cfg.dataset.max_gen_length == 16
    # no file at all: the schema defaults plus overrides
    cfg, _ = load_config(None, PPORunConfig, ["ppo.epochs=3"])
    assert cfg.ppo.epochs == 3 and cfg.ppo.learning_rate == PPORunConfig().ppo.learning_rate


def test_bad_override_syntax_and_clash():
    with pytest.raises(ConfigError, match="expected dotted key=value"):
        load_config(DEBUG, PPORunConfig, ["ppo.kl_coeff"])
    # indexing into a list is a mapping-vs-list clash: a ConfigError naming the override,
    # not a TypeError traceback from OmegaConf
    with pytest.raises(ConfigError, match=r"override 'reward.sources.0.weight=2': cannot merge"):
        load_config(DEBUG, PPORunConfig, ["reward.sources.0.weight=2"])
    # replacing the list whole works
    cfg, _ = load_config(DEBUG, PPORunConfig, ["reward.sources=[{name: gsm8k, weight: 2}]"])
    assert cfg.reward.sources[0].weight == 2.0


def test_list_mapping_clash_between_files(tmp_path):
    _write(tmp_path, "base.yaml", "reward:\n  sources:\n    - name: gsm8k\n")
    main = _write(tmp_path, "main.yaml", "defaults: [base.yaml]\nreward:\n  sources:\n    weight: 2\n")
    with pytest.raises(ConfigError, match=r"main.yaml onto its defaults: cannot merge"):
        load_config(main, PPORunConfig)


def test_unknown_key_suggests_the_nearest():
    (line,) = _errors(DEBUG, ["ppo.kl_coef=0.1"])
    assert line.endswith("ppo.kl_coef: unknown key; did you mean ppo.kl_coeff?")
    (line,) = _errors(DEBUG, ["trainng.seed=1"])
    assert "trainng: unknown key; did you mean training?" in line
    (line,) = _errors(DEBUG, ["ppo.zzz=1"])                   # nothing near: list the valid keys
    assert "ppo.zzz: unknown key; valid keys: learning_rate, min_learning_rate" in line and "rollout_samples" in line
    (line,) = _errors(DEBUG, ["reward.sources=[{nmae: gsm8k}]"])
    assert "reward.sources[0].nmae: unknown key; did you mean reward.sources[0].name?" in line


@pytest.mark.parametrize("override,expected", [
    ("ppo.epochs=four", "ppo.epochs: expected an integer, got 'four'"),
    ("ppo.epochs=2.5", "ppo.epochs: expected an integer, got 2.5"),
    ("ppo.learning_rate=fast", "ppo.learning_rate: expected a number, got 'fast'"),
    ("lora.enabled=maybe", "lora.enabled: expected true or false, got 'maybe'"),
    ("ppo.kl_estimator=k4", "ppo.kl_estimator: expected one of 'k1', 'k2', 'k3', 'abs', 'mse', got 'k4'"),
    ("generation.backend=vLLM", "generation.backend: expected one of 'hf', 'vllm', got 'vLLM'"),
    ("ppo.loss_aggregation=token_man", "did you mean 'token_mean'?"),
    ("ppo=3", "ppo: expected a section (mapping of keys), got 3"),
    ("dataset.num_samples=lots", "dataset.num_samples: expected int or null, got 'lots'"),
])
def test_bad_type(override, expected):
    (line,) = _errors(DEBUG, [override])
    assert expected in line


@pytest.mark.parametrize("overrides,expected", [
    (["ppo.learning_rate=-1e-5"], "ppo.learning_rate: must be > 0, got -1e-05"),
    (["ppo.clip_eps=1.5"], "ppo.clip_eps: must be < 1, got 1.5"),
    (["ppo.min_learning_rate=1e-4"], "ppo.min_learning_rate: 0.0001 exceeds learning_rate 1e-05"),
    (["ppo.clip_eps=0"], "ppo.clip_eps: must be > 0, got 0.0"),
    (["ppo.mini_batch_size=64"], "ppo.mini_batch_size: 64 is larger than a step's responses (8)"),
    (["generation.min_new_tokens=100"], "generation.min_new_tokens: 100 exceeds max_new_tokens 16"),
    (["generation.vllm.sync_interval=3"], "generation.vllm.sync_interval: 3 applies only to backend=vllm"),
    (["generation.vllm.kv_cache_gb=2"], "generation.vllm.kv_cache_gb: applies only to backend=vllm"),
    (["generation.vllm.enforce_eager=true"], "generation.vllm.enforce_eager: applies only to backend=vllm"),
    (["generation.backend=vllm", "generation.vllm.enforce_eager=maybe"],
     "generation.vllm.enforce_eager: expected true or false, got 'maybe'"),
    (["generation.backend=vllm", "generation.vllm.sync_interval=0"], "generation.vllm.sync_interval: must be >= 1, got 0"),
    (["generation.backend=vllm", "generation.vllm.kv_cache_gb=0"], "generation.vllm.kv_cache_gb: must be > 0, got 0"),
    (["generation.backend=vllm", "generation.vllm.gpu_memory_utilization=1.5"],
     "generation.vllm.gpu_memory_utilization: must be <= 1, got 1.5"),
    (["model.reference=none"], "model.reference: none leaves no policy to measure KL against"),
])
def test_bad_range(overrides, expected):
    (line,) = _errors(DEBUG, overrides)
    assert expected in line


def test_several_errors_reported_together(tmp_path):
    path = _write(tmp_path, "bad.yaml", """\
defaults: [{base}]
ppo:
  kl_coef: 0.1
  epochs: four
  clip_eps: 2.0
lora:
  r: 0
training:
  seed: abc
""".format(base=BASE))
    lines = _errors(path)
    text = "\n".join(lines)
    assert len(lines) == 5, text
    assert "ppo.kl_coef: unknown key; did you mean ppo.kl_coeff?" in text
    assert "ppo.epochs: expected an integer" in text
    # a range error is reported beside a type error in the same section
    assert "ppo.clip_eps: must be < 1, got 2.0" in text
    assert "lora.r: must be > 0, got 0" in text
    assert "training.seed: expected an integer" in text


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found; check the path"):
        load_config(tmp_path / "nope.yaml", PPORunConfig)
    main = _write(tmp_path, "main.yaml", "defaults: [gone.yaml]\n")
    with pytest.raises(ConfigError, match=r"gone.yaml: config file not found \(named in defaults of .*main.yaml\)"):
        load_config(main, PPORunConfig)


def test_yaml_syntax_error_is_a_config_error(tmp_path):
    path = _write(tmp_path, "broken.yaml", "ppo:\n  epochs: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, PPORunConfig)
    assert isinstance(info.value, UserError)
    msg = str(info.value)
    assert "\n" not in msg and "broken.yaml: not valid YAML" in msg


def test_top_level_list_and_bad_defaults(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "list.yaml", "- a\n- b\n"), PPORunConfig)
    with pytest.raises(ConfigError, match="defaults must be a list of file paths"):
        load_config(_write(tmp_path, "d.yaml", "defaults: {a: 1}\n"), PPORunConfig)


def test_defaults_cycle(tmp_path):
    a = _write(tmp_path, "a.yaml", "defaults: [b.yaml]\n")
    _write(tmp_path, "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match=r"defaults form a cycle \(.*a.yaml -> .*b.yaml -> .*a.yaml\)"):
        load_config(a, PPORunConfig)
    self_ref = _write(tmp_path, "self.yaml", "defaults: [self.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(self_ref, PPORunConfig)


def test_bad_interpolation(tmp_path):
    path = _write(tmp_path, "interp.yaml", "generation:\n  max_new_tokens: ${dataset.max_len}\n")
    with pytest.raises(ConfigError, match=r"interp.yaml: cannot resolve an interpolation .*dataset.max_len"):
        load_config(path, PPORunConfig)


def test_save_effective_config_round_trip(tmp_path):
    # strings YAML could misread once written back: a newline, a '#', a quote, a number-like
    run = _write(tmp_path, "run.yaml", f"""\
defaults: [{DEBUG}]
dataset:
  prompt_template: "Q: {{prompt}}\\nA: #1 'x'"
  name: "123"
model:
  tokenizer: "null"
""")
    overrides = ["ppo.kl_coeff=0.2", "lora.target_modules=[q_proj, v_proj]"]
    cfg, effective = load_config(run, PPORunConfig, overrides)
    for i, what in enumerate((cfg, effective)):   # from the dataclass or from the resolved tree
        path = save_effective_config(what, tmp_path / f"run{i}")
        assert path == tmp_path / f"run{i}" / "effective_config.yaml"
        text = path.read_text()
        assert "${" not in text and "defaults" not in text   # resolved and flat
        again, _ = load_config(path, PPORunConfig)
        assert again == cfg
        assert dataclasses.asdict(again) == dataclasses.asdict(cfg)
    assert cfg.generation.max_new_tokens == 16 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.dataset.prompt_template == "Q: {prompt}\nA: #1 'x'"
    assert cfg.dataset.name == "123" and cfg.model.tokenizer == "null" and cfg.ppo.kl_coeff == 0.2


def test_old_key_name_still_works_and_both_names_clash(tmp_path):
    # training.total_ppo_steps is the old name of training.total_steps, renamed per layer
    # (file, then each override), so a later layer still wins over an earlier one.
    old = _write(tmp_path, "old.yaml", "training:\n  total_ppo_steps: 7\n")
    cfg, eff = load_config(old, PPORunConfig)
    assert cfg.training.total_steps == 7 and "total_ppo_steps" not in eff["training"]
    cfg, _ = load_config(old, PPORunConfig, ["training.total_steps=3"])            # the override wins
    assert cfg.training.total_steps == 3
    cfg, _ = load_config(None, PPORunConfig, ["training.total_ppo_steps=4"])      # old name on the command line
    assert cfg.training.total_steps == 4
    both = _write(tmp_path, "both.yaml", "training:\n  total_ppo_steps: 7\n  total_steps: 8\n")
    with pytest.raises(ConfigError, match="training.total_ppo_steps is the old name of training.total_steps"):
        load_config(both, PPORunConfig)


def test_the_kl_weight_has_one_name_and_beta_is_read_as_it(tmp_path, monkeypatch, capsys):
    # grpo.beta, dr_grpo.beta and gspo.beta were the KL weight's name in GRPO's family;
    # kl_coeff is its name in every method now, and beta is read as it with a one-line note.
    from rlhflab.config import loader
    from rlhflab.trainers.dr_grpo import DrGRPORunConfig
    from rlhflab.trainers.grpo import GRPORunConfig
    from rlhflab.trainers.gspo import GSPORunConfig

    monkeypatch.setattr(loader, "_NOTED", set())
    for run, section in ((GRPORunConfig, "grpo"), (DrGRPORunConfig, "dr_grpo"), (GSPORunConfig, "gspo")):
        assert "beta" not in {f.name for f in dataclasses.fields(getattr(run(), section))}
        cfg, eff = load_config(None, run, [f"{section}.beta=0.07"])
        assert getattr(cfg, section).kl_coeff == 0.07 and "beta" not in eff[section]
        assert getattr(cfg, section).kl_loss_coeff == 0.07  # the engine's KL-in-the-loss weight
    err = capsys.readouterr().err
    assert "note: override 'grpo.beta=0.07': grpo.beta is read as grpo.kl_coeff" in err
    assert err.count("\n") == 3  # one note per old name
    load_config(None, GRPORunConfig, ["grpo.beta=0.01"])
    assert capsys.readouterr().err == ""  # noted once per process
    # a method that never had beta: did you mean its kl_coeff?
    with pytest.raises(ConfigError, match=r"ppo\.beta: unknown key; did you mean ppo\.kl_coeff\?"):
        load_config(None, PPORunConfig, ["ppo.beta=0.1"])


def test_every_training_section_names_its_warmup_the_same_two_ways():
    # warmup_steps (optimizer steps) and warmup_ratio (a share of them) mean the same thing in
    # every method's section; warmup_steps, when set, wins (as in Hugging Face's Trainer).
    from rlhflab.config import methods
    from rlhflab.config.cli import schema_for
    from rlhflab.trainers.common import warmup_of

    for m in methods.METHODS:
        run = schema_for(m.command)()
        sec = getattr(run, m.section, None)
        assert sec is not None, m.command
        assert {"warmup_steps", "warmup_ratio"} <= {f.name for f in dataclasses.fields(sec)}, m.command
    sft = load_config(None, SFTRunConfig, ["sft.warmup_ratio=0.1"])[0].sft
    assert warmup_of(sft, 250) == 25                                    # 0.1 x 250
    sft = load_config(None, SFTRunConfig, ["sft.warmup_ratio=0.1", "sft.warmup_steps=7"])[0].sft
    assert warmup_of(sft, 250) == 7                                     # steps win
    ppo = load_config(None, PPORunConfig, ["ppo.warmup_ratio=0.5"])[0].ppo
    assert warmup_of(ppo, 9) == 4                                       # int(0.5 x 9)


def test_names_from_the_tutorial_and_trl_get_rlhflabs_key():
    # The tutorial seed's ppo.clip_ratio / clip_range_value / training.num_samples, TRL's
    # gae_lambda and num_generations: each answered with the key rlhflab uses.
    lines = _errors(DEBUG, ["ppo.clip_ratio=0.2", "ppo.clip_range_value=0.2", "training.num_samples=100",
                            "ppo.gae_lambda=0.9"])
    assert any("ppo.clip_ratio: unknown key; did you mean ppo.clip_eps?" in x for x in lines)
    assert any("ppo.clip_range_value: unknown key; did you mean ppo.value_clip?" in x for x in lines)
    assert any("training.num_samples: unknown key; did you mean dataset.num_samples?" in x for x in lines)
    assert any("ppo.gae_lambda: unknown key; did you mean ppo.lam?" in x for x in lines)
    from rlhflab.trainers.grpo import GRPORunConfig
    with pytest.raises(ConfigError, match="grpo.num_generations: unknown key; did you mean grpo.group_size"):
        load_config(None, GRPORunConfig, ["grpo.num_generations=8"])


def test_names_from_the_tutorial_notebook_get_rlhflabs_key():
    # The tutorial notebook's PPO arguments (kl_penalty_method, kl_penalty_beta,
    # reward_score_clip), where a user of it would write them: in the method's section.
    lines = _errors(DEBUG, ["ppo.kl_penalty_method=k_3", "ppo.kl_penalty_beta=0.1", "ppo.reward_score_clip=5"])
    assert len(lines) == 3
    assert "ppo.kl_penalty_method: unknown key; did you mean ppo.kl_estimator?" in lines[0]
    assert "ppo.kl_penalty_beta: unknown key; did you mean ppo.kl_coeff?" in lines[1]
    assert "ppo.reward_score_clip: unknown key; did you mean reward.score_clip?" in lines[2]
    assert all("docs/knobs.md" in x for x in lines)
    # The KL weight is kl_coeff in every method: the notebook name finds it in GRPO and Dr. GRPO too.
    from rlhflab.trainers.dr_grpo import DrGRPORunConfig
    from rlhflab.trainers.grpo import GRPORunConfig
    with pytest.raises(ConfigError, match=r"grpo.kl_penalty_beta: unknown key; did you mean grpo.kl_coeff\?"):
        load_config(None, GRPORunConfig, ["grpo.kl_penalty_beta=0.04"])
    with pytest.raises(ConfigError, match=r"dr_grpo.kl_penalty_beta: unknown key; did you mean dr_grpo.kl_coeff\?"):
        load_config(None, DrGRPORunConfig, ["dr_grpo.kl_penalty_beta=0.04"])
    # The key it points to takes the setting (the notebook's k_3 is spelled k3 here).
    cfg, _ = load_config(DEBUG, PPORunConfig, ["ppo.kl_estimator=k3", "ppo.kl_coeff=0.1", "reward.score_clip=5"])
    assert (cfg.ppo.kl_estimator, cfg.ppo.kl_coeff, cfg.reward.score_clip) == ("k3", 0.1, 5.0)


def test_hugging_face_checkpoint_names_get_rlhflabs_key_not_a_lookalike():
    # sft.save_steps once got "did you mean sft.max_steps?" (difflib: the nearest spelling,
    # a different knob); HF's save_steps / save_total_limit / eval_steps name training's keys.
    from rlhflab.trainers.sft import SFTRunConfig

    with pytest.raises(ConfigError) as info:
        load_config(None, SFTRunConfig, ["sft.save_steps=200", "sft.save_total_limit=3", "training.eval_steps=50"])
    lines = str(info.value).splitlines()
    assert len(lines) == 3 and not any("max_steps" in x for x in lines), lines
    assert "sft.save_steps: unknown key; did you mean training.save_interval?" in lines[0]
    assert "sft.save_total_limit: unknown key; did you mean training.keep_last_checkpoints?" in lines[1]
    assert "training.eval_steps: unknown key; did you mean training.eval_interval?" in lines[2]
    cfg, _ = load_config(None, SFTRunConfig, ["training.save_interval=200", "training.keep_last_checkpoints=3"])
    assert (cfg.training.save_interval, cfg.training.keep_last_checkpoints) == (200, 3)


def test_knobs_md_maps_exactly_the_loaders_foreign_keys():
    # docs/knobs.md's table of other tools' names is FOREIGN_KEYS, row for row, and every
    # key it points at exists: a bare key in some method's section, a dotted one in a run config.
    import re

    from rlhflab.config.loader import FOREIGN_KEYS
    from rlhflab.trainers.dpo import DPORunConfig
    from rlhflab.trainers.dr_grpo import DrGRPORunConfig
    from rlhflab.trainers.grpo import GRPORunConfig
    from rlhflab.trainers.rloo import RLOORunConfig
    from rlhflab.trainers.sft import SFTRunConfig

    text = (Path(__file__).resolve().parents[1] / "docs" / "knobs.md").read_text()
    section = text.split("## The same knobs under other names", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (`[^|]+`) \| [^|]+ \|$", section, flags=re.M)
    assert len(rows) == len(set(r[0] for r in rows)), "a name is listed twice"
    # several keys, "`a`, `b`", are the loader's tuple (the first its section has)
    parsed = {name: tuple(re.findall(r"`([^`]+)`", keys)) for name, keys in rows}
    assert {k: v[0] if len(v) == 1 else v for k, v in parsed.items()} == FOREIGN_KEYS

    def fields(obj) -> set[str]:
        return {f.name for f in dataclasses.fields(obj)}

    runs = [PPORunConfig(), GRPORunConfig(), RLOORunConfig(), DPORunConfig()]
    method_sections = [getattr(run, name) for run in runs for name in ("ppo", "grpo", "rloo", "dpo")
                       if hasattr(run, name)]
    for name, target in ((n, t) for n, ts in parsed.items() for t in ts):
        if "." not in target:
            assert any(target in fields(sec) for sec in method_sections), (name, target)
        elif target.startswith("<method>."):
            assert all(target.split(".", 1)[1] in fields(sec) for sec in method_sections), (name, target)
        else:  # a section of the PPO run (training, reward, ...) or a method's own (grpo.kl_coeff)
            *path, key = target.split(".")  # generation.vllm.gpu_memory_utilization: a sub-section

            def owner(run):
                for part in path:
                    run = getattr(run, part, None)
                return run
            owners = [owner(run) for run in [*runs, DrGRPORunConfig(), SFTRunConfig()] if owner(run) is not None]
            assert owners and all(key in fields(sec) for sec in owners), (name, target)


# --------------------------------------------------------------------------------------
# Empty files; override values that YAML cannot parse (issue 28)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "   \n\n\t\n", "# nothing set yet\n\n"])
def test_an_empty_config_file_is_named(tmp_path, capsys, text):
    # Today a 0-byte file is "all defaults" and the run fails later on a dataset file
    # (outputs/arith/train.jsonl not found) that names no config at all.
    from rlhflab import cli

    empty = _write(tmp_path, "cfg.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(empty, PPORunConfig)
    only = " (no settings, only comments)" if text.strip() else ""
    assert str(info.value).startswith(f"{empty} is empty{only}; ")
    assert cli.main(["ppo", "--config", str(empty), "training.output_dir=" + str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {empty} is empty{only}; ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    # ... and an empty file named under `defaults:`, with the file that names it.
    main = _write(tmp_path, "main.yaml", "defaults: [cfg.yaml]\nppo:\n  epochs: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(main, PPORunConfig)
    assert str(info.value).startswith(f"{empty} is empty{only} (named in defaults of {main})")


def test_an_explicit_empty_mapping_is_all_defaults(tmp_path):
    # `{}` is written on purpose (a script passing every setting as overrides): not "empty".
    cfg, _ = load_config(_write(tmp_path, "cfg.yaml", "{}\n"), PPORunConfig, ["ppo.epochs=3"])
    assert cfg.ppo.epochs == 3


PROMPT = r"dataset.prompt_template=Question: {prompt}\nAnswer:"  # as typed in the shell, in single quotes


def test_an_override_yaml_cannot_parse_is_read_as_the_string_with_a_note(capsys):
    # Today: yaml.parser.ParserError ("while parsing a block mapping") from OmegaConf's
    # dot-list parser, a traceback before any of rlhflab's checks.
    cfg, _ = load_config(DEBUG, PPORunConfig, [PROMPT])
    assert cfg.dataset.prompt_template == "Question: {prompt}\nAnswer:"  # as the quoted form reads it: a newline
    err = capsys.readouterr().err
    assert err == ('note: override dataset.prompt_template: the value is not valid YAML; it is read as the string '
                   'dataset.prompt_template="Question: {prompt}\\nAnswer:" (write it so, quoted, to silence this '
                   'note)\n')
    quoted, _ = load_config(DEBUG, PPORunConfig, ['dataset.prompt_template="Question: {prompt}\\nAnswer:"'])
    assert quoted.dataset.prompt_template == cfg.dataset.prompt_template and capsys.readouterr().err == ""
    # An escape YAML does not know: the text as typed, and the quoted form that gives it.
    odd, _ = load_config(DEBUG, PPORunConfig, [r"dataset.prompt_template=Q: {prompt} \d"])
    assert odd.dataset.prompt_template == "Q: {prompt} \\d"
    assert 'dataset.prompt_template="Q: {prompt} \\\\d"' in capsys.readouterr().err
    # A value that is not a string for a number key still fails there, naming the override.
    lines = _errors(DEBUG, ["ppo.kl_coeff=[0.1"])
    assert lines == ["command line (ppo.kl_coeff=[0.1): ppo.kl_coeff: expected a number, got '[0.1'"]


def test_a_prompt_yaml_reads_as_a_mapping_says_to_quote_it():
    # `Question: {prompt}` is valid YAML (a mapping): the string key's error says why and how.
    lines = _errors(DEBUG, ["dataset.prompt_template=Question: {prompt}"])
    assert lines == ["command line (dataset.prompt_template=Question: {prompt}): dataset.prompt_template: expected "
                     "a string, got {'Question': {'prompt': None}}; YAML reads `word: text` and `{word}` as a "
                     "mapping: quote the whole value, e.g. 'dataset.prompt_template=\"...\"'"]


def test_every_command_with_overrides_reads_such_a_value_through_the_cli(tmp_path, capsys):
    from omegaconf import OmegaConf

    from rlhflab import cli
    from rlhflab.config.cli import SCHEMAS, schema_for, schema_rows

    for command in SCHEMAS:  # `config resolve` loads each command's schema through the one loader
        key = next(r[0] for r in schema_rows(schema_for(command)) if r[1] in ("str", "str | null")
                   and "[]" not in r[0] and "template" in r[0] or r[0] == "training.output_dir")
        value = PROMPT.split("=", 1)[1]
        assert cli.main(["config", "resolve", command, f"{key}={value}"]) == 0, (command, key)
        out = capsys.readouterr().out
        assert OmegaConf.select(OmegaConf.create(out), key) == "Question: {prompt}\nAnswer:", (command, key)


def test_engine_knobs_live_under_generation_vllm_and_hf_and_the_old_names_still_load(tmp_path, monkeypatch, capsys):
    # issue 48: the vLLM-only and hf-only knobs moved to generation.vllm.* / generation.hf.*;
    # the old flat names land in the new place with a one-line note.
    from rlhflab.config import loader

    monkeypatch.setattr(loader, "_NOTED", set())
    old = tmp_path / "old.yaml"
    old.write_text("generation:\n  backend: vllm\n  sync_interval: 3\n  enforce_eager: true\n  kv_cache_gb: 0.5\n")
    cfg, eff = load_config(old, PPORunConfig, ["generation.sync_check_floor=0.01"])
    assert (cfg.generation.vllm.sync_interval, cfg.generation.vllm.enforce_eager) == (3, True)
    assert (cfg.generation.vllm.kv_cache_gb, cfg.generation.vllm.sync_check_floor) == (0.5, 0.01)
    assert "sync_interval" not in eff.generation and eff.generation.vllm.sync_interval == 3
    err = capsys.readouterr().err
    assert "generation.sync_interval is read as generation.vllm.sync_interval" in err
    assert err.count("\n") == 4  # one note per old name: sync_interval, enforce_eager, kv_cache_gb, the floor
    cfg, _ = load_config(None, PPORunConfig, ["generation.hf_cache=static"])
    assert cfg.generation.hf.cache == "static"
    # the new names, on the command line
    cfg, _ = load_config(None, PPORunConfig, ["generation.backend=vllm", "generation.vllm.enforce_eager=true"])
    assert cfg.generation.vllm.enforce_eager is True
    # both names in one layer: the same value is one setting; different values are an error
    # (the new key is looked up in its own section: the leaf names are the same)
    both = tmp_path / "both.yaml"
    both.write_text("generation:\n  backend: vllm\n  sync_interval: 2\n  vllm: {sync_interval: 2}\n")
    assert load_config(both, PPORunConfig)[0].generation.vllm.sync_interval == 2
    both.write_text("generation:\n  backend: vllm\n  sync_interval: 2\n  vllm: {sync_interval: 4}\n")
    with pytest.raises(ConfigError, match=r"generation\.sync_interval is the old name of "
                                          r"generation\.vllm\.sync_interval and both are set") as exc:
        load_config(both, PPORunConfig)
    assert "\n" not in str(exc.value)
    # a flat vLLM knob on the hf backend is still refused, under its new name
    with pytest.raises(ConfigError, match=r"vllm\.enforce_eager: applies only to backend=vllm"):
        load_config(None, PPORunConfig, ["generation.vllm.enforce_eager=true"])


def test_share_prompt_is_read_as_the_shared_layout(tmp_path, monkeypatch, capsys):
    # issue 49: <method>.share_prompt (a KV cache) became a layout value: true is layout: shared,
    # false padded, auto auto, each with a one-line note; a layout set beside it wins.
    from rlhflab.config import loader
    from rlhflab.trainers.grpo import GRPORunConfig

    monkeypatch.setattr(loader, "_NOTED", set())
    got = [load_config(None, GRPORunConfig, [f"grpo.share_prompt={v}"])[0].grpo.layout for v in ("true", "false")]
    assert got == ["shared", "padded"]
    old = _write(tmp_path, "old.yaml", "grpo:\n  share_prompt: auto\n  layout: packed\n")
    cfg, eff = load_config(old, GRPORunConfig)
    assert cfg.grpo.layout == "packed" and "share_prompt" not in eff.grpo
    err = capsys.readouterr().err
    assert "grpo.share_prompt: true is read as grpo.layout: shared; rename it" in err
    assert err.count("\n") == 1  # noted once per process
    assert load_config(None, PPORunConfig)[0].ppo.layout == "auto"
