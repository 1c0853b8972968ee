"""Load a YAML config: `defaults:` inheritance, dotted overrides, interpolation, validation.

A config file may start with ``defaults: [base.yaml]`` (paths relative to the file
itself); each base is loaded (recursively) and merged in order, then the file's own
keys on top, then the dotted command-line overrides (``ppo.kl_coeff=0.1``). The
result is resolved (``${dataset.max_gen_length}`` interpolations) and checked
against a typed schema: a tree of dataclasses built with `rlhflab.config.schema.f`.

Every problem is reported as one line naming the file and the key; several problems
are reported together. No traceback reaches the user for a bad config.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhflab.errors import ConfigError
from rlhflab.files import check_utf8

T = TypeVar("T")

_MISSING = dataclasses.MISSING

# Old key -> the key that replaced it. Each YAML file and each override is renamed on
# its own, before merging, so a later layer still wins; `rlhflab config show` lists them.
ALIASES: dict[str, str] = {
    "training.total_ppo_steps": "training.total_steps",
    # the KL weight has one name, kl_coeff, in every method; GRPO's family called it beta
    "grpo.beta": "grpo.kl_coeff", "dr_grpo.beta": "dr_grpo.kl_coeff", "gspo.beta": "gspo.kl_coeff",
    # the CPU-only settings live in one `cpu:` section (issue 51)
    "model.cpu_matmul": "cpu.matmul",
    # engine-only knobs live under generation.vllm / generation.hf (issue 48)
    **{f"generation.{k}": f"generation.vllm.{k}" for k in (
        "sync_interval", "gpu_memory_utilization", "kv_cache_gb", "enforce_eager", "sync_check",
        "sync_check_factor", "sync_check_floor")},
    "generation.hf_cache": "generation.hf.cache",
}


# Old keys whose values became values of another key: <section>.share_prompt (the group's
# prompt once, by a KV cache) is now <section>.layout: shared (issue 49).
VALUE_ALIASES: dict[str, tuple[str, dict]] = {
    "share_prompt": ("layout", {True: "shared", False: "padded", "true": "shared", "false": "padded",
                                "auto": "auto"}),
}


# Names other tools (the tutorial seed's course config, TRL) give rlhflab's knobs: an
# unknown key with one of these names is answered with rlhflab's key (docs/knobs.md has
# the table). A bare name maps within its own section; a dotted one names the section.
FOREIGN_KEYS: dict[str, str] = {
    "clip_ratio": "clip_eps", "cliprange": "clip_eps", "clip_range": "clip_eps",
    "clip_range_value": "value_clip", "cliprange_value": "value_clip",
    "kl_coef": "kl_coeff", "init_kl_coef": "kl_coeff", "vf_coef": "vf_coeff", "ent_coef": "entropy_coeff",
    "gae_lambda": "lam", "lambda": "lam", "num_ppo_epochs": "epochs", "ppo_epochs": "epochs",
    "num_generations": "group_size", "rloo_k": "k",
    "training.num_samples": "dataset.num_samples", "training.learning_rate": "<method>.learning_rate",
    "ppo.response_length": "generation.max_new_tokens", "ppo.temperature": "generation.temperature",
    "training.batch_size": "<method>.batch_size", "training.epochs": "<method>.epochs",
    # the tutorial notebook's PPO arguments (its k_3 estimator is rlhflab's k3)
    "kl_penalty_method": "kl_estimator", "kl_penalty_beta": "kl_coeff",
    "beta": "kl_coeff",  # TRL's GRPO name for the KL weight (read as it in grpo, dr_grpo, gspo)
    "reward_score_clip": "reward.score_clip",
    # the tutorial's value-head options (TRL's AutoModelForCausalLMWithValueHead kwargs)
    "summary_dropout_prob": "model.value_head_dropout", "v_head_initializer_range": "model.value_head_init_std",
    "v_head_init_strategy": "model.value_head_init",
    # the notebook's labels = input_ids (Axolotl calls it train_on_inputs)
    "train_on_inputs": "sft.train_on_prompt",
    # Hugging Face TrainingArguments
    "save_steps": "training.save_interval", "save_total_limit": "training.keep_last_checkpoints",
    "save_only_model": "training.save_only_model",
    "eval_steps": "training.eval_interval",
    # TRL's GRPOConfig/RLOOConfig/DPOConfig and TrainingArguments (a tuple: the first of its
    # keys the section has; docs/conventions.md and docs/knobs.md compare the meanings)
    "scale_rewards": ("advantage_scale", "normalize_advantages", "whiten_advantages"),
    "max_completion_length": "generation.max_new_tokens", "max_new_tokens": "generation.max_new_tokens",
    "max_prompt_length": "dataset.max_prompt_length",
    "num_iterations": "epochs", "epsilon": "clip_eps", "epsilon_high": "clip_eps_high",
    "loss_type": ("loss_aggregation", "loss_kind"),
    "temperature": "generation.temperature", "top_p": "generation.top_p", "top_k": "generation.top_k",
    "num_train_epochs": "training.total_steps", "sft.num_train_epochs": "epochs", "dpo.num_train_epochs": "epochs",
    "rm.num_train_epochs": "epochs", "classifier.num_train_epochs": "epochs", "max_steps": ("max_steps", "training.total_steps"),
    "fp16": "training.mixed_precision", "bf16": "training.mixed_precision",
    "dataset_name": "dataset.name", "dataset_config": "dataset.subset", "dataset_config_name": "dataset.subset",
    "dataset_train_split": "dataset.split", "dataset_test_split": "dataset.eval_split",
    "per_device_train_batch_size": ("mini_batch_size", "batch_size"),
    "per_device_eval_batch_size": "training.eval_batch_size",
    "mask_truncated_completions": "mask_truncated", "lr_scheduler_type": "lr_schedule",
    "model_name_or_path": "model.name_or_path", "output_dir": "training.output_dir",
    "use_vllm": "generation.backend", "vllm_gpu_memory_utilization": "generation.vllm.gpu_memory_utilization",
    # verl and OpenRLHF
    "n_samples_per_prompt": ("group_size", "k"), "num_generations": ("group_size", "k"),
    "rollout_n": ("group_size", "k"),
    "eps_clip": "clip_eps", "kl_loss_coef": "kl_coeff", "kl_loss_type": "kl_estimator", "entropy_coef": "entropy_coeff",
    "use_kl_in_reward": "kl_in", "ppo_mini_batch_size": "mini_batch_size", "micro_train_batch_size": "mini_batch_size",
    "train_batch_size": ("prompts_per_step", "batch_size"), "rollout_batch_size": ("prompts_per_step", "rollout_samples"),
    "actor_learning_rate": "learning_rate", "generate_max_len": "generation.max_new_tokens",
    "prompt_max_len": "dataset.max_prompt_length",
}

# What a mapped name means here when it is not the same thing, said beside the hint.
FOREIGN_NOTES: dict[str, str] = {
    "num_train_epochs": "passes over the data; an RL run counts steps, and its <method>.epochs are passes "
                        "over each step's responses",
    "per_device_train_batch_size": "TRL's responses per device per pass; rlhflab's is per minibatch",
    "fp16": "no (the default), or bf16; fp16 is refused (no loss scaler)",
    "bf16": "bf16: true is mixed_precision: bf16",
    "use_vllm": "generation.backend: vllm",
    "loss_type": "TRL's dapo is rlhflab's token_mean (docs/conventions.md)",
    "scale_rewards": "TRL's group, batch, none",
    "temperature": "sampling settings live in the generation section",
}

# Names other tools use that have no rlhflab key, and why.
FOREIGN_NONE: dict[str, str] = {
    "do_sample": "rollouts always sample (at generation.temperature) and the held-out evaluation is greedy; "
                 "there is no switch",
    "n_samples_per_prompt": "PPO samples one response per prompt (ppo.rollout_samples counts them); "
                            "grpo.group_size and rloo.k are the samples per prompt",
    "num_generations": "PPO samples one response per prompt; grpo.group_size and rloo.k are the samples per prompt",
    "use_kl_loss": "the KL sits in the loss when the method's kl_coeff > 0 (GRPO family) or ppo.kl_in: loss",
    "gradient_checkpointing": "it is model.gradient_checkpointing",
}


# CPU-only settings removed because they saved under 10% of a shipped SmolLM2 recipe's step
# (issue 51; bench/NOTES.md): a config that still sets one is told so, not offered a near name.
REMOVED_KEYS = ("model.lean_norm", "model.cpu_allocator", "model.critic_overlap", "generation.fast_draw")


def _foreign_target(prefix: str, name: str, fields: dict) -> str | None:
    """rlhflab's key for a name another tool uses, when this section (or another) has one."""
    dotted = f"{prefix}.{name}" if prefix else str(name)
    target = FOREIGN_KEYS.get(dotted) or FOREIGN_KEYS.get(str(name))
    for key in (target,) if isinstance(target, str) else target or ():
        if "." not in key:  # a key of the same section
            if key in fields:
                return f"{prefix + '.' if prefix else ''}{key}"
        else:  # a dotted key: the section it names
            return key
    return None


def _foreign_hint(prefix: str, name: str, fields: dict) -> str | None:
    """The did-you-mean (or why-there-is-none) for a name another tool uses; None for others."""
    target = _foreign_target(prefix, name, fields)
    if target is not None:
        note = FOREIGN_NOTES.get(str(name))
        return (f"did you mean {target}? ({name} is its name elsewhere{': ' + note if note else ''}; "
                f"docs/knobs.md maps the names)")
    why = FOREIGN_NONE.get(str(name))
    if why is not None:
        return f"{name} (another tool's name) has no rlhflab key: {why}"
    return None


_NOTED: set[str] = set()  # old names already noted in this process


def _rename_aliases(node: DictConfig, where: str) -> DictConfig:
    """One layer (a file or an override) with its old key names replaced by the new ones;
    the first use of each old name in a process prints a one-line note naming the new one."""
    for old, new in ALIASES.items():
        section, _, old_key = old.rpartition(".")
        new_section, _, new_key = new.rpartition(".")
        sec = node.get(section) if section else node
        if not isinstance(sec, DictConfig) or old_key not in sec:
            continue
        # the new key is looked up in its own section (generation.sync_interval and
        # generation.vllm.sync_interval share a leaf name but not a section)
        new_sec = OmegaConf.select(node, new_section, default=None) if new_section else node
        value = sec[old_key]
        if isinstance(new_sec, DictConfig) and new_key in new_sec:
            if new_sec[new_key] != value:
                raise ConfigError(f"{where}: {old} is the old name of {new} and both are set; keep only {new}")
        else:
            OmegaConf.update(node, new, value, merge=False)
        sec.pop(old_key)
        if old not in _NOTED:
            _NOTED.add(old)
            print(f"note: {where}: {old} is read as {new}, its name in rlhflab; rename it to silence this",
                  file=sys.stderr)
    for name, sec in list(node.items()):
        for old_key, (new_key, values) in VALUE_ALIASES.items():
            if not isinstance(sec, DictConfig) or old_key not in sec:
                continue
            value = sec.pop(old_key)
            value = value.lower() if isinstance(value, str) else value
            if new_key not in sec and value in values:  # a value it never took is left for the check to name
                sec[new_key] = values[value]
            elif value not in values:
                sec[old_key] = value
                continue
            if f"{name}.{old_key}" not in _NOTED:
                _NOTED.add(f"{name}.{old_key}")
                set_too = f" ({name}.{new_key} is set too and wins)" if sec[new_key] != values[value] else ""
                shown = str(value).lower()  # as YAML writes it: true, false, auto
                print(f"note: {where}: {name}.{old_key}: {shown} is read as {name}.{new_key}: {values[value]}"
                      f"{set_too}; rename it to silence this", file=sys.stderr)
    return node


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> DictConfig:
    """Read one YAML file and merge its `defaults:` bases under it."""
    shown = str(path) if not chain else None  # the top file as the user wrote it
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"{path}: defaults form a cycle ({cycle}); remove one of them")
    if not path.is_file():
        where = f" (named in defaults of {chain[-1]})" if chain else ""
        raise ConfigError(f"{path}: config file not found{where}; check the path")
    check_utf8(path)  # a Latin-1 byte: the file, line and byte, not a YAML reader's traceback
    if not path.read_bytes().strip():  # 0 bytes or blanks: not "all defaults" (the dataset error that follows names no file)
        named = f" (named in defaults of {chain[-1]})" if chain else ""
        raise ConfigError(f"{shown or path} is empty{named}; write its settings (configs/ has examples) or name "
                          f"another file")
    try:
        node = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and friends: say where, not a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path}: not valid YAML ({first}); fix the syntax") from None
    # Comments only: nothing written. An explicit `{}` is a choice (every setting from
    # overrides, as a script may do), so it loads as all defaults.
    lines = path.read_text(encoding="utf-8").splitlines()
    if node is None or not any(line.strip() and not line.lstrip().startswith("#") for line in lines):
        named = f" (named in defaults of {chain[-1]})" if chain else ""
        raise ConfigError(f"{shown or path} is empty (no settings, only comments){named}; write its settings or "
                          f"name another file")
    if isinstance(node, ListConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not a list")
    defaults = node.pop("defaults", None) if "defaults" in node else None
    merged = OmegaConf.create({})
    if defaults is not None:
        if isinstance(defaults, str):
            defaults = [defaults]
        if not isinstance(defaults, (list, ListConfig)):
            raise ConfigError(f"{path}: defaults must be a list of file paths, e.g. [base.yaml]")
        for base in defaults:
            if not isinstance(base, str):
                raise ConfigError(f"{path}: defaults entries must be file paths, got {base!r}")
            merged = _merge(merged, _read_yaml(path.parent / base, (*chain, path)), f"{path} onto {base}")
    return _merge(merged, _rename_aliases(node, str(path)), f"{path} onto its defaults")


def _kind(node: Any) -> str | None:
    if isinstance(node, (DictConfig, dict)):
        return "mapping"
    if isinstance(node, (ListConfig, list, tuple)):
        return "list"
    return None


def clash_key(base: Any, top: Any, prefix: str = "") -> tuple[str, str, str] | None:
    """The first dotted key that is a list on one side and a mapping on the other, with
    the two kinds (base's, top's); None when there is no such key."""
    kb, kt = _kind(base), _kind(top)
    if kb and kt and kb != kt:
        return prefix or "<top level>", kb, kt
    if kb == kt == "mapping":
        for key in top:
            if key in base:
                found = clash_key(base[key], top[key], f"{prefix}.{key}" if prefix else str(key))
                if found:
                    return found
    return None


def _merge(base: DictConfig, top: DictConfig, what: str) -> DictConfig:
    """OmegaConf.merge, with a list-vs-mapping clash reported as a ConfigError naming the key."""
    try:
        return OmegaConf.merge(base, top)
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        clash = clash_key(base, top)
        if clash is not None:
            key, was, now = clash
            how = (f"give the whole list, e.g. {key}=[...] (a list is replaced whole, as in "
                   f"reward.sources=[{{name: gsm8k}}])" if was == "list" else
                   f"set its keys, e.g. {key}.some_key=value (a mapping is merged key by key)")
            raise ConfigError(f"{what}: cannot merge a {now} onto the {was} at {key}; {how}") from None
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{what}: cannot merge ({msg}); a key that is a list or mapping in one must be the "
            f"same kind in the other (a list is replaced whole, e.g. reward.sources=[{{name: gsm8k}}])"
        ) from None


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(
                f"override {item!r}: expected dotted key=value, e.g. ppo.kl_coeff=0.05"
            )
    node = OmegaConf.create({})
    for item in overrides:
        try:
            node = OmegaConf.merge(node, OmegaConf.from_dotlist([item]))
        except yaml.YAMLError:  # `key=Question: {prompt}\nAnswer:`: a prompt, not YAML
            key, _, value = item.partition("=")
            text, quoted = _as_string(value)
            _note(f"note: override {key}: the value is not valid YAML; it is read as the string "
                  f"{key}={quoted} (write it so, quoted, to silence this note)")
            try:
                OmegaConf.update(node, key.strip(), text, merge=True)
            except OmegaConfBaseException as exc:
                raise ConfigError(f"override {item!r}: {exc}".splitlines()[0]) from None
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override {item!r}: {exc}".splitlines()[0]) from None
    return node


def _as_string(value: str) -> tuple[str, str]:
    """An override's value that YAML cannot parse, as one string, and the double-quoted
    form that gives it. Read as YAML reads it in double quotes (``\\n`` a newline, as in a
    config file's "User: {prompt}\\n\\nAssistant:"), or as typed when that fails too (an
    escape YAML does not know, such as ``\\d``)."""
    quoted = '"' + value.replace('"', '\\"') + '"'
    if "\n" not in value:  # in double quotes YAML folds a real line break into a space
        try:
            text = yaml.safe_load(quoted)
            if isinstance(text, str):
                return text, quoted
        except yaml.YAMLError:
            pass
    return value, json.dumps(value, ensure_ascii=False)  # a JSON string is YAML in double quotes


_NOTES: set[str] = set()


def _note(line: str) -> None:
    """Print a one-line note to stderr, once per process (a config may be loaded twice)."""
    if line not in _NOTES:
        _NOTES.add(line)
        print(line, file=sys.stderr)


def compose(path: str | Path | None, overrides: list[str] | None = None) -> DictConfig:
    """Merge a config file (with its bases) and dotted overrides; not yet resolved."""
    cfg = _read_yaml(Path(path)) if path is not None else OmegaConf.create({})
    for item in overrides or []:  # one at a time, so a clash names its override
        cfg = _merge(cfg, _rename_aliases(_parse_overrides([item]), f"override {item!r}"), f"override {item!r}")
    return cfg


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        return f"a list of {_describe(inner)}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a section (mapping)"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, errors: list[str]) -> Any:
    """Return `value` converted to `tp`, or append an error and return None."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            out = _coerce(value, arg, key, trial)
            if not trial:
                return out
        errors.append(f"{key}: expected {_describe(tp)}, got {value!r}")
        return None
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        extra = f"; did you mean {hint[0]!r}?" if hint else ""
        errors.append(f"{key}: expected {_describe(tp)}, got {value!r}{extra}")
        return None
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) and typing.get_origin(inner) is Literal:
            value = [value]  # one choice given alone, as TRL takes report_to=tensorboard
        if not isinstance(value, (list, tuple)):
            errors.append(f"{key}: expected {_describe(tp)}, got {value!r}")
            return None
        return [_coerce(v, inner, f"{key}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping, got {value!r}")
            return None
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a section (mapping of keys), got {value!r}")
            return None
        return _build(tp, value, key, errors)
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(f"{key}: expected true or false, got {value!r}")
        return None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        errors.append(f"{key}: expected an integer, got {value!r}")
        return None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # "1e-5" written without a dot is read as a string by YAML 1.1
            try:
                return float(value)
            except ValueError:
                pass
        errors.append(f"{key}: expected a number, got {value!r}")
        return None
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        quote = ("; YAML reads `word: text` and `{word}` as a mapping: quote the whole value, e.g. "
                 f"'{key}=\"...\"'" if isinstance(value, dict) else "")
        errors.append(f"{key}: expected a string, got {value!r}{quote}")
        return None
    return value


def _build(cls: type[T], data: dict, prefix: str, errors: list[str]) -> T:
    hints = typing.get_type_hints(cls)
    fields = {fl.name: fl for fl in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields and key in REMOVED_KEYS:
            errors.append(f"{key}: removed (it saved under 10% of a step; bench/NOTES.md); delete it")
            continue
        if name not in fields:
            foreign = _foreign_hint(prefix, str(name), fields)
            near = difflib.get_close_matches(str(name), list(fields), n=1, cutoff=0.6)
            target = _foreign_target(prefix, str(name), fields)
            if foreign and not (near and target == f"{prefix + '.' if prefix else ''}{near[0]}"):
                hint = f"; {foreign}"
            elif near:
                hint = f"; did you mean {prefix + '.' if prefix else ''}{near[0]}?"
            else:
                hint = f"; valid keys: {', '.join(fields)}"
            errors.append(f"{key}: unknown key{hint}")
            continue
        kwargs[name] = _coerce(value, hints[name], key, errors)
    for name, fl in fields.items():
        if name in kwargs:
            continue
        if fl.default is _MISSING and fl.default_factory is _MISSING:  # type: ignore[misc]
            if dataclasses.is_dataclass(hints[name]):
                kwargs[name] = _build(hints[name], {}, f"{prefix}.{name}" if prefix else name, errors)
            else:
                errors.append(f"{prefix + '.' if prefix else ''}{name}: required key is missing")
    # Field-level ranges declared with schema.f(...), checked before the section is built
    # so that a type error in one key does not hide a range error in another.
    for name, fl in fields.items():
        rng = fl.metadata.get("check")
        value = kwargs[name] if name in kwargs else fl.default
        if rng is not None and value is not None and value is not _MISSING:
            msg = rng(value)
            if msg:
                errors.append(f"{prefix + '.' if prefix else ''}{name}: {msg}")
    if any(v is None and not _allows_none(hints[k]) for k, v in kwargs.items()):
        return None  # type: ignore[return-value]  # errors already recorded
    try:
        obj = cls(**kwargs)
    except TypeError:
        return None  # type: ignore[return-value]
    # Cross-field rules: a `check()` method returning messages keyed relative to the section.
    check = getattr(obj, "check", None)
    if callable(check):
        for msg in check() or []:
            errors.append(f"{prefix + '.' if prefix else ''}{msg}")
    return obj


def _allows_none(tp: Any) -> bool:
    return tp is Any or (
        typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)
    )


def fill_plugin_dirs(obj: Any, folder: Path) -> None:
    """Set every section's `plugin_dir` left null to `folder` (the config file's own), so
    ``module:function`` and ``file.py:function`` plug-ins named in a config are found next
    to it from any working directory. A value set in the file or an override is kept."""
    if not dataclasses.is_dataclass(obj):
        return
    for fl in dataclasses.fields(obj):
        value = getattr(obj, fl.name)
        if fl.name == "plugin_dir" and value is None:
            setattr(obj, fl.name, str(folder))
        elif dataclasses.is_dataclass(value):
            fill_plugin_dirs(value, folder)


def load_config(
    path: str | Path | None,
    schema: type[T],
    overrides: list[str] | None = None,
    base: dict | None = None,
) -> tuple[T, DictConfig]:
    """Load, merge, resolve and validate a config.

    `base` (a plain mapping, e.g. ``dataclasses.asdict`` of a config built in code) sits
    under the file and the overrides: how commands with built-in settings (the
    quickstart) still take dotted overrides with the same checks.

    Every section's `plugin_dir` left null becomes the config file's folder (see
    `fill_plugin_dirs`). Returns the typed config (a `schema` instance) and the resolved
    OmegaConf tree (for `effective_config.yaml`). Raises `ConfigError` listing every problem found,
    one line each, prefixed with the config file.
    """
    where = str(path) if path is not None else "<defaults>"
    raw = compose(path, overrides)
    if base is not None:
        raw = _merge(OmegaConf.create(base), raw, where)
    try:
        resolved = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as exc:
        msg = str(exc).strip().splitlines()[0]
        raise ConfigError(f"{where}: cannot resolve an interpolation ({msg})") from None
    errors: list[str] = []
    obj = _build(schema, resolved or {}, "", errors)
    if errors:
        raise ConfigError("\n".join(f"{_origin(e, where, overrides or [])}: {e}" for e in errors))
    if path is not None:
        fill_plugin_dirs(obj, Path(path).resolve().parent)
    effective = OmegaConf.create(dataclasses.asdict(obj))
    return obj, effective


def _origin(error: str, where: str, overrides: list[str]) -> str:
    """Where the key of `error` ("key: message") was set: the command-line override that
    holds it, or else the config file."""
    key = error.split(": ", 1)[0]
    for item in reversed(overrides):  # the last override of a key is the one that counts
        okey = item.split("=", 1)[0].strip()
        if key == okey or key.startswith((okey + ".", okey + "[")) or okey.startswith(key + "."):
            return f"command line ({item})"
    return where


# Keys that do not change what a run computes: a folder whose run was started with
# other values of these still holds "the same run" (`config_differences`).
RUN_NEUTRAL_KEYS = ("training.overwrite", "logging.progress_bar")


def _effective_yaml(cfg: Any) -> str:
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dataclasses.asdict(cfg))
    return OmegaConf.to_yaml(node)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def config_differences(saved: str | Path, cfg: Any) -> list[str] | None:
    """The dotted keys whose values differ between the config recorded in `saved` (an
    `effective_config.yaml`) and `cfg` (a typed config or its resolved tree), leaving out
    RUN_NEUTRAL_KEYS; [] when they describe the same run, None when `saved` is missing or
    cannot be read."""
    try:
        old = yaml.safe_load(Path(saved).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(old, dict):
        return None
    a, b = _flat(old), _flat(yaml.safe_load(_effective_yaml(cfg)))
    return [k for k in sorted(set(a) | set(b)) if k not in RUN_NEUTRAL_KEYS and a.get(k, _MISSING) != b.get(k, _MISSING)]


def save_effective_config(cfg: Any, out_dir: str | Path, resume_from: str | Path | None = None) -> Path:
    """Write the merged, resolved, validated config as `effective_config.yaml`.

    A resumed run (`resume_from`: the step_N/ folder it continues) keeps the run's record:
    an `effective_config.yaml` already there is never rewritten; when this run's config
    differs from it (a key other than RUN_NEUTRAL_KEYS), the new one is written beside it
    as `effective_config.resume_step_N.yaml`. Returns the file that holds this run's config.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = _effective_yaml(cfg)
    path = out / "effective_config.yaml"
    if resume_from is not None and path.is_file():
        if config_differences(path, cfg) == []:
            return path
        path = out / f"effective_config.resume_{Path(resume_from).name}.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path
