"""`rlhflab learn run`: train the debug PPO config with the learner's functions plugged in.

The PPO trainer takes its math as a `PPOMath` of pluggable functions; this module wraps
the learner's exercises into that shape (thin adapters: the trainer passes an
aggregation and a gradient-accumulation normalizer, the exercises return a plain token
mean, so the adapter rescales) and calls `rlhflab.trainers.ppo.train`.

What is plugged in:
- exercise 1 -> PPOMath.policy_loss, exercise 2 -> PPOMath.value_loss
- exercise 4 -> PPOMath.advantages (GAE, then the learner's whitening; the trainer's own
  whitening is switched off so it is not done twice)
- exercise 5's minibatch_loss -> PPOMath.minibatch_step; it calls the learner's
  exercises 1-3 itself (exercise 3 takes logits, which only this step sees)
- exercise 5's update_step -> PPOMath.update_group (one optimizer step per accumulation
  group; the scheduler step stays in the trainer). It calls minibatch_loss by name, and
  the adapter takes the logged per-minibatch losses from those calls, so an update_step
  that does not call it once per minibatch is left out (the run says why).
An exercise still left as the stub is replaced by the library's version, and the run
says so. Inputs (the tiny model, the arithmetic task) are made in DIR/inputs/ when
missing; each run writes DIR/runs/NNN/.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from rlhflab import ops
from rlhflab.errors import UserError
from rlhflab.learn import cases, reference
from rlhflab.learn.checks import CheckFailed, MB_FIELDS, call, learner_function, unpack
from rlhflab.learn.workspace import Workspace

PACKAGED_CONFIG = "learn_run_config.yaml"   # in rlhflab/learn/templates/: a resolved copy of configs/ppo_debug.yaml

TABLE = (("step", "step", "{:>4d}"), ("reward", "rollout/reward_mean", "{:>7.3f}"),
         ("kl_to_ref", "params/kl_to_ref", "{:>9.4f}"), ("policy", "loss/policy", "{:>8.4f}"),
         ("value", "loss/value", "{:>8.4f}"), ("entropy", "loss/entropy", "{:>7.3f}"),
         ("clip_frac", "params/policy_clip_frac", "{:>9.3f}"), ("approx_kl", "params/approx_kl", "{:>9.5f}"),
         ("grad_norm", "params/grad_norm", "{:>9.3f}"), ("held-out acc", "eval/accuracy", "{:>12.3f}"))


# --------------------------------------------------------------------------------------
# The config
# --------------------------------------------------------------------------------------
def repo_debug_config() -> Path | None:
    """configs/ppo_debug.yaml of the source checkout this package runs from, if any."""
    import rlhflab
    path = Path(rlhflab.__file__).resolve().parents[1] / "configs" / "ppo_debug.yaml"
    return path if path.is_file() else None


def packaged_config() -> Path:
    return Path(__file__).with_name("templates") / PACKAGED_CONFIG


def debug_config_path() -> Path:
    """The repo's debug config when running from a checkout, else a packaged one."""
    shipped = Path(__file__).resolve().parents[1] / "configs" / "ppo_debug.yaml"  # rlhflab/configs/, if shipped
    return repo_debug_config() or (shipped if shipped.is_file() else packaged_config())


def write_packaged_config(dest: Path | None = None) -> Path:
    """Refresh the packaged copy from configs/ppo_debug.yaml (run after editing that file)."""
    from omegaconf import OmegaConf

    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPORunConfig
    src = repo_debug_config()
    if src is None:
        raise UserError("configs/ppo_debug.yaml not found: refresh the packaged config from a source checkout")
    cfg, _ = load_config(src, PPORunConfig)
    # the loader fills each plug-in folder with the config file's own: left null here, the
    # packaged copy's are its own folder, not this checkout's absolute path
    cfg.reward.plugin_dir = cfg.eval.plugin_dir = cfg.env.plugin_dir = None
    dest = dest or packaged_config()
    header = ("# Generated from configs/ppo_debug.yaml (with its defaults resolved) for `rlhflab learn run`\n"
              "# from an installed package. Refresh: python -m rlhflab.learn.runner\n")
    dest.write_text(header + OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg))), encoding="utf-8")
    return dest


def ensure_inputs(folder: Path, quiet: bool = False, warm: bool = True) -> tuple[Path, Path]:
    """(policy folder, task folder) in `folder`, made once when missing.

    warm: the quickstart's stages 1-3 (tiny model, task, SFT on sloppy demonstrations,
    about a minute once), so the policy answers in the right format and PPO has rewards
    to learn from. cold: the untrained tiny model, whose reward stays at 0.
    """
    if warm:
        sft_final, data_dir = folder / "sft" / "final", folder / "data"
        if not (sft_final / "config.json").is_file() or not (data_dir / "test.jsonl").is_file():
            from rlhflab.quickstart import prepare_warm_start
            if not quiet:
                print(f"warm start in {folder} (once): tiny model, task, SFT ...")
            prepare_warm_start(folder, quiet=quiet)
        return sft_final, data_dir
    model_dir, data_dir = folder / "tiny-model", folder / "arith"
    if not (model_dir / "config.json").is_file():
        from rlhflab.models.tiny import make_tiny_model
        if not quiet:
            print(f"making the tiny model in {model_dir} (once)")
        make_tiny_model(model_dir)
    if not (data_dir / "train.jsonl").is_file() or not (data_dir / "test.jsonl").is_file():
        from rlhflab.data.arith import write_task
        if not quiet:
            print(f"writing the arithmetic task to {data_dir} (once)")
        write_task(data_dir)
    return model_dir, data_dir


# The quickstart's PPO settings, shortened to 10 steps: from the warm start, held-out
# accuracy rises when the learner's functions are right (docs/learner_mode.md quotes what
# scripts/measure_learner.py measured).
WARM_SETTINGS = [
    "ppo.rollout_samples=64", "ppo.batch_size=64", "ppo.mini_batch_size=16", "ppo.epochs=2",
    "ppo.learning_rate=5e-5", "ppo.kl_coeff=0.02", "ppo.vf_coeff=0.1",
    "dataset.max_prompt_length=64", "dataset.max_gen_length=16", "dataset.num_eval_samples=200",
    "training.total_steps=10", "training.eval_interval=5", "training.eval_batch_size=100",
]


def _next_run_dir(runs: Path) -> Path:
    runs.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name) for p in runs.iterdir() if p.is_dir() and p.name.isdigit()]
    return runs / f"{max(taken, default=0) + 1:03d}"


def load_run_config(ws_dir: Path, overrides: list[str], quiet: bool = False, warm: bool = True):
    """The debug PPO config pointed at the workspace's inputs and a fresh run folder
    (with `warm`, the quickstart's warm-started policy and PPO settings)."""
    from rlhflab.config import load_config
    from rlhflab.trainers.ppo import PPORunConfig
    keys = {o.split("=", 1)[0] for o in overrides}
    base: list[str] = ["training.save_interval=0"] + (WARM_SETTINGS if warm else [])
    if not {"model.name_or_path", "dataset.path"} <= keys:
        model_dir, data_dir = ensure_inputs(ws_dir / "inputs", quiet, warm)
        base += [f"model.name_or_path={model_dir}", f"dataset.path={data_dir / 'train.jsonl'}",
                 f"dataset.eval_path={data_dir / 'test.jsonl'}"]
    base.append(f"training.output_dir={_next_run_dir(ws_dir / 'runs')}")
    return load_config(debug_config_path(), PPORunConfig, base + list(overrides))


# --------------------------------------------------------------------------------------
# The learner's functions, shaped for PPOMath
# --------------------------------------------------------------------------------------
def _rescale(loss: torch.Tensor, response_mask: torch.Tensor, normalizer) -> torch.Tensor:
    """A token mean over this minibatch -> its share of the group's token mean."""
    if normalizer is None:
        return loss
    return loss.reshape(()) * response_mask.sum().clamp(min=1).to(loss.dtype) / normalizer


def _policy_adapter(fn: Callable) -> Callable:
    def policy_loss(logprobs, old_logprobs, advantages, response_mask, clip_eps, dual_clip=None,
                    aggregation="token_mean", normalizer=None):
        loss, clip_frac = unpack(fn(logprobs, old_logprobs, advantages, response_mask, clip_eps),
                                 ("loss", "clip_frac"), fn.__name__, "PolicyLoss")
        with torch.no_grad():
            approx_kl = ops.masked_mean(0.5 * (logprobs - old_logprobs).square(), response_mask)
        return ops.PolicyLossOutput(_rescale(loss, response_mask, normalizer),
                                    torch.as_tensor(clip_frac, dtype=torch.float32), approx_kl)
    return policy_loss


def _value_adapter(fn: Callable) -> Callable:
    def value_loss(values, old_values, returns, response_mask, clip_range, aggregation="token_mean",
                   normalizer=None):
        loss, clip_frac = unpack(fn(values, old_values, returns, response_mask, clip_range),
                                 ("loss", "clip_frac"), fn.__name__, "ValueLoss")
        return ops.ValueLossOutput(_rescale(loss, response_mask, normalizer),
                                   torch.as_tensor(clip_frac, dtype=torch.float32))
    return value_loss


def _advantages_adapter(gae_fn: Callable, whiten_fn: Callable | None) -> Callable:
    def advantages(rewards, values, response_mask, gamma, lam):
        adv, ret = unpack(gae_fn(rewards, values, response_mask, gamma, lam), ("advantages", "returns"),
                          gae_fn.__name__, "GAE")
        if whiten_fn is not None:
            adv = whiten_fn(adv, response_mask)
        return adv, ret
    return advantages


def _minibatch_stats(out: tuple, mb: dict, logits: torch.Tensor | None, normalizer: float):
    """The trainer's MinibatchStats from the MinibatchLoss fields of one minibatch (token means)."""
    from rlhflab.trainers.ppo import MinibatchStats
    scale = float(mb["response_mask"].sum().clamp(min=1)) / normalizer
    approx_kl = 0.0
    if logits is not None:
        with torch.no_grad():
            lp = ops.logprobs_from_logits(logits.detach(), mb["response_ids"])
            approx_kl = float(ops.masked_mean(0.5 * (lp - mb["old_logprobs"]).square(), mb["response_mask"]))
    # The trainer sums the minibatches' loss stats over an accumulation group, so
    # each carries its share of the group, as the library's own step reports them.
    return MinibatchStats(float(out[1]) * scale, float(out[2]) * scale, float(out[3]) * scale,
                          float(out[0].detach()) * scale, float(out[4]), float(out[5]), approx_kl)


def _minibatch_adapter(fn: Callable) -> Callable:
    def minibatch_step(ac, mb, p, temperature, math_, normalizer):
        model = reference.ResponseModel(ac, temperature)
        out = unpack(fn(model, mb, p), MB_FIELDS, fn.__name__, "MinibatchLoss")
        scale = float(mb["response_mask"].sum().clamp(min=1)) / normalizer
        return out[0].reshape(()) * scale, _minibatch_stats(out, mb, model.last_logits, normalizer)
    return minibatch_step


class _Watched:
    """For one call of update_step: exercise 5's `minibatch_loss` replaced by a wrapper
    that keeps each minibatch, its result and its logits. The learner's update_step
    returns only the group's loss and grad norm; the trainer also logs each minibatch's
    parts, which are these results."""

    def __init__(self, module):
        self.module = module
        self.calls: list[tuple[dict, tuple, torch.Tensor | None]] = []

    def __enter__(self) -> "_Watched":
        self.original = original = self.module.minibatch_loss

        def minibatch_loss(model, mb, settings):
            res = original(model, mb, settings)
            out = unpack(res, MB_FIELDS, getattr(original, "__name__", "minibatch_loss"), "MinibatchLoss")
            self.calls.append((mb, out, getattr(model, "last_logits", None)))
            return res
        self.module.minibatch_loss = minibatch_loss
        return self

    def __exit__(self, *exc) -> bool:
        self.module.minibatch_loss = self.original
        return False


def _update_adapter(fn: Callable, module) -> Callable:
    """The learner's update_step(model, minibatches, optimizer, settings) as PPOMath.update_group.

    The learner's code does the backward passes, the clip and the optimizer step (the
    trainer's `params` are `model.parameters()`); the per-minibatch stats come from the
    minibatch_loss calls it makes, scaled to their share of the group as above."""

    def update_group(ac, minibatches, optimizer, params, p, temperature, math_, normalizer):
        model = reference.ResponseModel(ac, temperature)
        with _Watched(module) as watched:
            res = fn(model, minibatches, optimizer, p)
        _, grad_norm = unpack(res, ("loss", "grad_norm"), fn.__name__, "UpdateStats")
        if len(watched.calls) != len(minibatches):
            raise UserError(f"exercise 5: update_step called minibatch_loss {len(watched.calls)} time(s) for "
                            f"{len(minibatches)} minibatch(es); `learn run` needs one call per minibatch")
        stats = []
        for mb, out, logits in watched.calls:
            st = _minibatch_stats(out, mb, logits, normalizer)
            if not math.isfinite(st.total):  # as the library's step, so the trainer names the step
                raise FloatingPointError(f"loss/total is {st.total}; policy={st.policy} "
                                         f"value={st.value} entropy={st.entropy}")
            stats.append(st)
        return float(grad_norm), stats
    return update_group


@dataclass
class Plugged:
    """The PPOMath for the run and, per function, whose code it uses."""

    math: object
    whiten: bool
    used: dict[str, str] = field(default_factory=dict)


def _probe(ws: Workspace, number: int, name: str, probe: Callable[[Callable], object]) -> Callable | None:
    """The learner's function if it is written (runs on a small case), None if still the stub."""
    try:
        fn = learner_function(ws, number, name)
        probe(fn)
        return fn
    except CheckFailed as exc:
        if "still the stub" in exc.finding.what:
            return None
        raise UserError(f"exercise {number} ({name}) fails on a small input: {exc.finding.what}; "
                        f"`rlhflab learn check {number} --dir {ws.path}` says more") from None


def plug(ws: Workspace, whiten: bool) -> Plugged:
    """Wrap what the learner has written into a PPOMath; the library fills the gaps."""
    from rlhflab.trainers.ppo import PPOMath

    def run(number, fn, *args):
        return call(ws, number, fn, *args)

    pc, vc, ec, gc = cases.policy_hand(), cases.value_hand(), cases.entropy_hand(), cases.gae_hand()
    found = {
        "compute_policy_loss": _probe(ws, 1, "compute_policy_loss", lambda f: run(
            1, f, pc["logprobs"], pc["old_logprobs"], pc["advantages"], pc["response_mask"], 0.2)),
        "compute_value_loss": _probe(ws, 2, "compute_value_loss", lambda f: run(
            2, f, vc["values"], vc["old_values"], vc["returns"], vc["response_mask"], 0.2)),
        "compute_entropy_loss": _probe(ws, 3, "compute_entropy_loss", lambda f: run(
            3, f, ec["logits"], ec["response_mask"])),
        "compute_gae_advantages": _probe(ws, 4, "compute_gae_advantages", lambda f: run(
            4, f, gc["rewards"], gc["values"], gc["response_mask"], 0.9, 0.95)),
        "whiten_advantages": _probe(ws, 4, "whiten_advantages", lambda f: run(
            4, f, gc["values"], gc["response_mask"])),
    }
    # Exercise 5 calls exercises 1-3 by name: where one is still the stub, the library's
    # version stands in for it inside the learner's module too.
    for name in ("compute_policy_loss", "compute_value_loss", "compute_entropy_loss"):
        if found[name] is None and 5 in ws.modules and hasattr(ws.modules[5], name):
            setattr(ws.modules[5], name, reference.REFERENCE_FUNCTIONS[name])
    mb, settings = cases.toy_minibatches()[0], cases.toy_settings()
    found["minibatch_loss"] = _probe(ws, 5, "minibatch_loss", lambda f: run(
        5, f, reference.ResponseModel(cases.ToyActorCritic()), mb, settings))
    # update_step calls minibatch_loss by name: the library's stands in for a stub there too.
    if found["minibatch_loss"] is None:
        ws.modules[5].minibatch_loss = reference.minibatch_loss
    toy_minibatches = cases.toy_minibatches()
    update_calls: list[int] = []  # how often the probe's update_step called minibatch_loss

    def probe_update(f):
        model = reference.ResponseModel(cases.ToyActorCritic())
        with _Watched(ws.modules[5]) as watched:
            run(5, f, model, toy_minibatches, torch.optim.SGD(model.parameters(), lr=1.0), settings)
        update_calls.append(len(watched.calls))
    found["update_step"] = _probe(ws, 5, "update_step", probe_update)

    used = {name: ("yours" if fn is not None else "the library's (yours is still the stub)")
            for name, fn in found.items()}
    if found["update_step"] and update_calls[0] != len(toy_minibatches):
        # The trainer logs each minibatch's losses; the adapter takes them from these calls.
        used["update_step"] = (f"the library's: yours called minibatch_loss {update_calls[0]} time(s) for "
                               f"{len(toy_minibatches)} minibatches;\n{'':27}the run logs the losses it "
                               "returns, so it needs one call per minibatch")
        found["update_step"] = None
    math_ = PPOMath()
    if found["compute_policy_loss"]:
        math_.policy_loss = _policy_adapter(found["compute_policy_loss"])
    if found["compute_value_loss"]:
        math_.value_loss = _value_adapter(found["compute_value_loss"])
    gae_fn = found["compute_gae_advantages"] or reference.compute_gae_advantages
    whiten_fn = (found["whiten_advantages"] or reference.whiten_advantages) if whiten else None
    math_.advantages = _advantages_adapter(gae_fn, whiten_fn)
    if found["minibatch_loss"]:
        math_.minibatch_step = _minibatch_adapter(found["minibatch_loss"])
    elif found["compute_entropy_loss"]:
        used["compute_entropy_loss"] = ("not run: it takes logits, which only exercise 5's minibatch_loss\n"
                                        f"{'':27}sees; the library's step computes the entropy itself")
    if found["update_step"]:
        math_.update_group = _update_adapter(found["update_step"], ws.modules[5])
    if not whiten:
        used["whiten_advantages"] = "not run: ppo.whiten_advantages is false"
    return Plugged(math_, whiten, used)


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------
def format_table(history: list[dict]) -> str:
    head = "  ".join(f"{name:>{len(fmt.format(0) if 'd' in fmt else fmt.format(0.0))}}" for name, _, fmt in TABLE)
    rows = [head]
    for h in history:
        cells = []
        for _, key, fmt in TABLE:
            v = h.get(key)
            width = len(fmt.format(0) if "d" in fmt else fmt.format(0.0))
            cells.append(f"{'-':>{width}}" if v is None else fmt.format(v))
        rows.append("  ".join(cells))
    return "\n".join(rows)


def _check_supported(cfg) -> None:
    p = cfg.ppo
    problems = []
    if p.loss_aggregation != "token_mean":
        problems.append("ppo.loss_aggregation must be token_mean (the exercises' losses are token means)")
    if p.dual_clip is not None:
        problems.append("ppo.dual_clip must be null (exercise 1 has no dual clip)")
    if p.kl_in != "reward":
        problems.append("ppo.kl_in must be reward (exercise 5 has no KL term in the loss)")
    if problems:
        raise UserError("learn run: " + "; ".join(problems))


def run_learner(ws_dir: str | Path, overrides: list[str] | None = None, compare: bool = False,
                quiet: bool = False, warm: bool = True) -> dict:
    """Train with the learner's functions (and, with `compare`, once more with the library's)."""
    from rlhflab.trainers.ppo import PPOMath, train
    ws_dir = Path(ws_dir)
    overrides = list(overrides or [])
    cfg, effective = load_run_config(ws_dir, overrides, quiet, warm)
    _check_supported(cfg)
    with Workspace(ws_dir) as ws:
        plugged = plug(ws, cfg.ppo.whiten_advantages)
        if not quiet:
            print("plugged into the PPO trainer:")
            for name, who in plugged.used.items():
                print(f"  {name:<24} {who}")
            print(f"config: {debug_config_path()} + {' '.join(overrides) or 'no overrides'}")
            print(f"output: {cfg.training.output_dir}")
        # The learner's whitening runs inside PPOMath.advantages; the trainer's is switched off.
        run_cfg = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, whiten_advantages=False))
        mine = train(run_cfg, math_=plugged.math, effective=effective, quiet=quiet)
    result = {"yours": mine}
    if not quiet:
        print("\nyour functions:")
        print(format_table(mine.history))
    if compare:
        lib_cfg = dataclasses.replace(cfg, training=dataclasses.replace(
            cfg.training, output_dir=str(Path(cfg.training.output_dir) / "library")))
        lib = train(lib_cfg, math_=PPOMath(), quiet=quiet)
        result["library"] = lib
        if not quiet:
            print("\nthe library's functions (same seed, same first rollout):")
            print(format_table(lib.history))
            print(compare_text(mine.history, lib.history))
    elif not quiet:
        print(f"\nmetrics: {mine.output_dir / 'metrics.jsonl'}; add --compare to run the library's "
              "functions beside yours")
    return result


def compare_text(mine: list[dict], lib: list[dict]) -> str:
    """Step 1 starts from the same model and the same rollout in both runs."""
    if not mine or not lib:
        return ""
    keys = [k for _, k, _ in TABLE[3:] if not k.startswith("eval/")]
    worst = max(abs(mine[0][k] - lib[0][k]) / max(1e-3, abs(lib[0][k])) for k in keys)
    if worst < 1e-3:
        verdict = "step 1 matches the library's (relative difference below 1e-3)"
    else:
        diffs = [f"{k}: {mine[0][k]:.5g} vs {lib[0][k]:.5g}" for k in keys
                 if abs(mine[0][k] - lib[0][k]) / max(1e-3, abs(lib[0][k])) >= 1e-3]
        verdict = "step 1 differs from the library's: " + "; ".join(diffs) + \
                  ". Both runs start from the same rollout, so `rlhflab learn check` should show why"
    note = ("(Later steps sample new rollouts from slightly different policies, so small differences "
            "there grow and are expected.)")
    return "\n" + textwrap.fill(verdict + ".", 100) + "\n" + textwrap.fill(note, 100)


def main() -> None:  # python -m rlhflab.learn.runner: refresh the packaged config
    print(f"wrote {write_packaged_config()}")


if __name__ == "__main__":
    main()
