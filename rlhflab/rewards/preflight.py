"""Preflight: import every reward and check plug-in and call it once, before any model loads.

A typo in ``my_rewards:score``, a missing file, a function that reads a field the data
does not have: each used to surface only after the policy, the reference and the data
had loaded. `preflight(cfg)` runs first in every RL trainer and reports such a problem as
one line naming the config key, the plug-in and the dataset row:

    error: preflight of reward.sources[0] on row 0 of data/train.jsonl: plug-in
    'my_rewards:score' raised KeyError: 'target' at my_rewards.py:7 on prompt 'cat'; ...

Each rule plug-in is called once with the first row's formatted prompt, a stand-in
response (the row's reference ``answer`` when it has one, else the empty string) and the
row as the trainer passes it (`rlhflab.data.prompts.load_prompts`: every field of the
row, plus ``answer`` copied from ``dataset.answer_field``). Reward sources use the first
training row; ``eval.correct`` and ``eval.rewards`` the first held-out row. Model and
classifier sources are not loaded here, only checked to exist when they are local paths.
"""

from __future__ import annotations

from typing import NamedTuple

from rlhflab.errors import UserError


class PreflightCall(NamedTuple):
    key: str       # the config key, e.g. reward.sources[0]
    spec: str      # the plug-in, e.g. my_rewards:score
    row: str       # which row it was called on
    response: str  # the stand-in response it was given
    value: float   # what it returned


class Rows(NamedTuple):
    examples: list   # the split's examples (`load_prompts`)
    source: str      # the file or hub name they come from
    answer_field: str

    @property
    def first(self) -> str:
        return f"row 0 of {self.source}"


def _rows(dataset_cfg, split: str) -> Rows:
    """The split's examples and where they come from."""
    from rlhflab.data.prompts import load_prompts

    examples = load_prompts(dataset_cfg, None, split)
    source = (dataset_cfg.path or dataset_cfg.name) if split == "train" else (dataset_cfg.eval_path or dataset_cfg.name)
    return Rows(examples, str(source), dataset_cfg.answer_field)


class _Reads(dict):
    """A row that records the fields read from it by subscript."""

    def __init__(self, row: dict):
        super().__init__(row)
        self.read: list[str] = []

    def __getitem__(self, key):
        if key not in self.read:
            self.read.append(key)
        return super().__getitem__(key)


def _check_fields(rows: Rows, fields: list[str], key: str, spec: str) -> None:
    """Every row of the split has the fields the plug-in read on row 0, else a one-line error."""
    for i, example in enumerate(rows.examples):
        missing = [f for f in fields if f not in example.row]
        if missing:
            named = [rows.answer_field if f == "answer" else f for f in missing]
            fix = "add them to the row" + (", or set dataset.answer_field to the field that holds the answer"
                                           if "answer" in missing else "")
            raise UserError(f"preflight of {key}: {rows.source}: row {i} lacks field(s) {named} that {spec!r} "
                            f"reads (row 0 has them; row {i} has {sorted(example.row)}); {fix}")


def _named_columns(fn) -> list[str]:
    """The columns a TRL-form function names as parameters without a default: each row
    must have them (TRL hands a row's missing column on as None)."""
    import inspect

    from rlhflab.rewards.plugins import is_trl_form

    if not is_trl_form(fn):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds
            and p.default is inspect.Parameter.empty and n not in ("prompts", "completions", "completion_ids",
                                                                     "trainer_state")]


def _call_once(fn, key: str, spec: str, rows: Rows, what: str) -> PreflightCall:
    from rlhflab.rewards.plugins import call_plugin

    example = rows.examples[0]
    response = str(example.row.get("answer", ""))
    row = _Reads(example.row)
    try:
        (value,) = call_plugin(fn, spec, [example.prompt], [response], [row], what=what)
    except UserError as exc:
        raise UserError(f"preflight of {key} on {rows.first}: {exc}") from None
    _check_fields(rows, row.read + _named_columns(fn), key, spec)
    return PreflightCall(key, spec, rows.first, response, value)


def _check_model_source(source, key: str) -> None:
    from rlhflab.models.load import check_model_source

    try:
        check_model_source(str(source.path), f"{key} ({source.type})")
    except UserError as exc:
        raise UserError(f"preflight: {exc}") from None


def _load(spec: str, key: str, plugin_dir):
    from rlhflab.rewards import resolve_rule

    try:
        return resolve_rule(spec, plugin_dir)
    except UserError as exc:
        raise UserError(f"preflight of {key}: {exc}") from None


def _call_rules(sources, prefix: str, plugin_dir, read_rows) -> list[PreflightCall]:
    """Each rule source imported and called once on the first of `read_rows()` (a `Rows`),
    which is read only when a rule needs it."""
    calls, rows = [], None
    for i, source in enumerate(sources):
        if source.type == "rule":
            key = f"{prefix}[{i}]"
            fn = _load(source.name, key, plugin_dir)
            rows = rows or read_rows()
            calls.append(_call_once(fn, key, source.name, rows, "reward"))
    return calls


def _check_model_sources(sources, prefix: str) -> None:
    """Each model and classifier source: its path exists (nothing is loaded)."""
    for i, source in enumerate(sources):
        if source.type != "rule":
            _check_model_source(source, f"{prefix}[{i}]")


def preflight(cfg, quiet: bool = False) -> list[PreflightCall]:
    """Import and call once every plug-in of a run config (sections dataset, reward and,
    when present, eval and training); raise a one-line `UserError` at the first problem.

    Prints one line per call (and what eval/accuracy will mean) unless `quiet`.
    """
    from rlhflab.rewards.checks import EvalChecks, accuracy_rule

    calls = _call_rules(cfg.reward.sources, "reward.sources", cfg.reward.plugin_dir, lambda: _rows(cfg.dataset, "train"))
    model = getattr(cfg, "model", None)
    if model is not None and getattr(model, "name_or_path", None):
        # The policy before the reward models: it is the input made first (ppo_rm_debug's SFT model).
        from rlhflab.models.load import check_model_source

        check_model_source(str(model.name_or_path), "model.name_or_path")
    _check_model_sources(cfg.reward.sources, "reward.sources")
    eval_cfg = getattr(cfg, "eval", None)
    training = getattr(cfg, "training", None)
    evaluates = training is None or training.eval_interval > 0
    note = None
    if eval_cfg is not None and evaluates and (cfg.dataset.eval_path or cfg.dataset.name):
        rows = _rows(cfg.dataset, "eval")
        examples = rows.examples
        checks = EvalChecks()
        if eval_cfg.correct:
            fn = _load(eval_cfg.correct, "eval.correct", eval_cfg.plugin_dir)
            calls.append(_call_once(fn, "eval.correct", eval_cfg.correct, rows, "check"))
            checks = EvalChecks(fn, eval_cfg.correct)
        calls += _call_rules(eval_cfg.rewards, "eval.rewards", eval_cfg.plugin_dir, lambda: rows)
        _check_model_sources(eval_cfg.rewards, "eval.rewards")
        rule = accuracy_rule(checks, [e.row for e in examples])
        note = (f"eval/accuracy: {rule}" if rule else
                "eval/accuracy: not logged (the held-out rows have no numeric answers for the GSM8K checker); "
                "set eval.correct: module:function to measure it")
    if not quiet:
        for c in calls:
            print(f"preflight: {c.key} {c.spec} on {c.row} with response {c.response!r:.40} -> {c.value:g}")
        if note:
            print(note)
    return calls
