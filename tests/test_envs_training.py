"""Multi-turn episodes in training (issue 25, phase 2): a one-turn environment reproduces
the single-turn PPO step bit for bit; the environment's tokens are attended to but carry
no gradient; GAE through PPO's advantage step on a two-turn trajectory by hand; the
outcome methods' episode return; `rlhflab grpo`/`ppo` from a YAML naming env and tool."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

from rlhflab.data.prompts import load_prompts
from rlhflab.engine.minibatch import select
from rlhflab.engine.update import PPOMath, minibatch_loss
from rlhflab.envs.episode import Episode, collate_episodes
from rlhflab.envs.rollout import episodes_to_rollout
from rlhflab.trainers import ppo
from rlhflab.trainers.common import Timer
from rlhflab.trainers.loop import build_run, outcome_scores

from model_helpers import favour_token
from test_grpo_helpers import ROOT, debug_config, easy_task
from test_vllm_backend import HAVE_VLLM, needs_vllm

ONE_TURN_ENV = '''
from rlhflab.envs import StepResult


class OneTurn:
    """The row's prompt as the user's message; the first reply ends the episode."""

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages, assistant_text):
        return StepResult(None, 0.0, True)


class TwoTurns(OneTurn):
    """'again' after the first reply, 0.5 for it; the second reply ends the episode."""

    def __init__(self):
        self.turns = 0

    def step(self, messages, assistant_text):
        self.turns += 1
        if self.turns == 1:
            return StepResult([{"role": "user", "content": "again"}], 0.5, False)
        return StepResult(None, 0.0, True)
'''


def add(a: str, b: str) -> str:
    """add(a, b): the sum of two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return str(int(a) + int(b))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from rlhflab.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("chatml-model")
    # head_dim 32: vLLM's CPU attention has no kernel for 16
    return make_tiny_model(out, hidden_size=64, num_layers=2, num_heads=2, chat_template="chatml")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = easy_task(tmp_path_factory)
    (d / "my_env.py").write_text(ONE_TURN_ENV)
    return d


def _run(chat_model, task_dir, tmp_path, *overrides):
    cfg = debug_config(ppo.PPORunConfig, "ppo_debug.yaml", chat_model, task_dir, tmp_path, 'dataset.prompt_template="{prompt}"',
                       "dataset.use_chat_template=true", "generation.max_new_tokens=6",
                       "generation.seeded_sampling=true", "ppo.rollout_samples=4", "ppo.batch_size=4",
                       "ppo.mini_batch_size=2", "ppo.epochs=1", "ppo.kl_coeff=0.05", *overrides)
    torch.manual_seed(0)
    return cfg, build_run(cfg, ppo.method(cfg))


def test_one_turn_environment_is_the_single_turn_step_bit_for_bit(chat_model, task_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(task_dir)  # the env module is found in the current directory
    cfg_a, run_a = _run(chat_model, task_dir, tmp_path / "a")
    cfg_b, run_b = _run(chat_model, task_dir, tmp_path / "b", "env.name=my_env:OneTurn", "env.max_turns=1")
    examples = load_prompts(cfg_a.dataset, run_a.models.tokenizer, "train")[:4]
    roll_a = ppo.collect_rollout(run_a, examples, Timer(), step=1)
    roll_b = ppo.collect_rollout(run_b, examples, Timer(), step=1)
    assert roll_a.episodes is None and roll_b.episodes is not None
    assert roll_b.response_attention_mask is not None
    t = roll_a.response_ids.shape[1]
    assert roll_b.response_ids.shape[1] == t
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "hit_limit", "scores", "logprobs",
                 "values", "ref_logprobs", "rewards", "advantages", "returns"):
        a, b = getattr(roll_a, name), getattr(roll_b, name)
        assert torch.equal(a, b.to(a.dtype)), name
    assert roll_a.responses == roll_b.responses
    assert torch.equal(roll_b.response_attention_mask, roll_b.response_mask)  # one turn: the same mask
    ppo.run_update(run_a, roll_a, 1)
    ppo.run_update(run_b, roll_b, 1)
    for (name, p), q in zip(run_a.models.actor.named_parameters(), run_b.models.actor.parameters()):
        assert torch.equal(p, q), name


def test_two_turn_episodes_take_the_samplers_old_policy_on_their_action_tokens(chat_model, task_dir, tmp_path,
                                                                               monkeypatch):
    """generation.old_logprobs=sampler on multi-turn episodes (hf): each turn's draw records its
    tokens' log-probs, the environment's tokens get 0, and the old policy equals the
    teacher-forced one over the whole episode (context attended) on every action token."""
    import copy

    from rlhflab.engine import scoring

    monkeypatch.chdir(task_dir)
    cfg, run = _run(chat_model, task_dir, tmp_path, "env.name=my_env:TwoTurns", "env.max_turns=2",
                    "generation.old_logprobs=sampler")
    examples = load_prompts(cfg.dataset, run.models.tokenizer, "train")[:4]
    tok = run.models.tokenizer  # the end of turn made likely, so that second turns happen
    favour_token(run.models.policy, tok, [e.prompt for e in examples], tok.convert_tokens_to_ids("<|im_end|>"), 4.5)
    roll = ppo.collect_rollout(run, examples, Timer(), step=1)
    assert roll.old_from_sampler and roll.response_attention_mask is not None
    context = roll.response_attention_mask.bool() & ~roll.response_mask.bool()
    assert context.any()  # the environment's "again" turn sits between the two replies
    assert torch.all(roll.logprobs[context] == 0) and torch.all(roll.logprobs[roll.response_mask.bool()] < 0)
    exact = scoring.score_rollout(run.models.actor, None, copy.copy(roll), temperature=cfg.generation.temperature,
                                  micro_batch=4).logprobs
    torch.testing.assert_close(roll.logprobs, exact, rtol=0, atol=2e-5)


def _two_turn_episode(prompt, first, context, second) -> Episode:
    ep = Episode(prompt_ids=list(prompt))
    ep.ids = list(first) + list(context) + list(second)
    ep.action_mask = [1] * len(first) + [0] * len(context) + [1] * len(second)
    ep.turn_ends = [len(first) - 1, len(ep.ids) - 1]
    ep.turn_rewards = [0.5, 0.0]
    ep.sample_logprobs = None
    ep.messages = [{"role": "assistant", "content": "x"}]
    return ep


def test_context_tokens_are_attended_but_carry_no_gradient(chat_model, task_dir, tmp_path):
    cfg, run = _run(chat_model, task_dir, tmp_path / "g")
    eps = [_two_turn_episode([5, 6, 7], [10, 11, 3], [20, 21, 22, 23], [12, 3]),
           _two_turn_episode([8, 9], [13, 3], [24, 25], [14, 15, 3])]
    roll = episodes_to_rollout(collate_episodes(eps, 0), run.models.tokenizer)
    b, t = roll.response_ids.shape
    ctx = (roll.response_attention_mask.bool() & ~roll.response_mask.bool())       # (B, T) context tokens
    assert int(ctx.sum()) == 6

    def grads(roll_):
        mb = select(roll_, torch.arange(b), roll_.response_mask)
        run.models.actor.zero_grad(set_to_none=True)
        loss, _ = minibatch_loss(run.models.actor, mb, cfg.ppo, 1.0, PPOMath(), normalizer=float(mb.loss_mask.sum()))
        loss.backward()
        return {n: p.grad.clone() for n, p in run.models.actor.named_parameters() if p.grad is not None}

    torch.manual_seed(1)
    base = dict(advantages=torch.randn(b, t), logprobs=-torch.rand(b, t), values=torch.randn(b, t),
                returns=torch.randn(b, t))
    for k, v in base.items():
        setattr(roll, k, v * roll.response_mask)
    g0 = grads(roll)
    # Targets on the context tokens: huge advantages, old log-probs, returns there change nothing.
    for k in base:
        setattr(roll, k, getattr(roll, k) + 1e3 * ctx.float())
    g1 = grads(roll)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    # ... but the context is attended: attending with the action mask instead moves the loss gradient.
    roll.response_attention_mask = None
    g2 = grads(roll)
    assert any(not torch.allclose(g0[n], g2[n]) for n in g0)


def test_gae_through_ppo_advantage_step_on_a_two_turn_trajectory(chat_model, task_dir, tmp_path, monkeypatch):
    """Response part a0 a1 E | c c | a2 E (actions at 0,1,2 and 5,6); turn rewards 0.5 (turn 1)
    and score 1 on the final answer; γ = 0.9, λ = 0.8, values V = [0.1, 0.2, 0.3, -, -, 0.4, 0.5], no KL.

    Rewards on actions: r2 = 0.5 (turn 1's end), r6 = 1 (the score), others 0.
      t=6: δ = 1 - 0.5 = 0.5;                      A6 = 0.5
      t=5: δ = 0 + 0.9·0.5 - 0.4 = 0.05;           A5 = 0.05 + 0.72·0.5 = 0.41
      t=2: δ = 0.5 + 0.9·0.4 - 0.3 = 0.56;         A2 = 0.56 + 0.72·0.41 = 0.8552   (t' = 5: context skipped)
      t=1: δ = 0 + 0.9·0.3 - 0.2 = 0.07;           A1 = 0.07 + 0.72·0.8552 = 0.685744
      t=0: δ = 0 + 0.9·0.2 - 0.1 = 0.08;           A0 = 0.08 + 0.72·0.685744 = 0.57373568
    """
    cfg, run = _run(chat_model, task_dir, tmp_path / "gae", "ppo.gamma=0.9", "ppo.lam=0.8",
                    "ppo.whiten_advantages=false", "ppo.kl_coeff=0.0")
    ep = _two_turn_episode([5, 6], [10, 11, 3], [20, 21], [12, 3])
    roll = episodes_to_rollout(collate_episodes([ep], 0), run.models.tokenizer)
    values = torch.tensor([[0.1, 0.2, 0.3, 9.0, 9.0, 0.4, 0.5]])

    class Backend:
        def generate(self, *a, **k):
            return roll

    def fake_score(actor, reference, roll_, **kw):
        roll_.logprobs = torch.zeros(1, 7)
        roll_.values = values * roll_.response_mask
        roll_.ref_logprobs = None
        return roll_

    run.backend = Backend()
    run.scorer = type("S", (), {"score": lambda self, p, r, e: torch.tensor([1.0])})()
    monkeypatch.setattr(ppo, "score_rollout", fake_score)
    out = ppo.collect_rollout(run, [type("E", (), {"prompt": "p", "row": {}})()], Timer())
    want = torch.tensor([[0.57373568, 0.685744, 0.8552, 0.0, 0.0, 0.41, 0.5]])
    assert torch.allclose(out.advantages.double(), want.double(), atol=1e-6)
    assert torch.allclose(out.returns, (want + values) * roll.response_mask, atol=1e-6)
    assert out.scores.tolist() == [1.5]  # logged: the episode's return (score + turn rewards)


def test_outcome_methods_sum_turn_rewards():
    eps = [_two_turn_episode([1], [2, 3], [4], [5, 3]), _two_turn_episode([1], [2, 3], [4], [5, 3])]
    eps[1].turn_rewards = [-0.25, 2.0]
    roll = episodes_to_rollout(collate_episodes(eps, 0), type("T", (), {"decode": lambda s, i, **k: ""})())
    # final-answer scores 1 and 0; returns 1 + 0.5 + 0 = 1.5 and 0 - 0.25 + 2 = 1.75
    assert outcome_scores(roll, torch.tensor([1.0, 0.0])).tolist() == [1.5, 1.75]


CALC_TOOL = '''
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return str(int(a) + int(b))
'''


CLI_CASES = [("grpo", "hf"), ("ppo", "hf"), *((c, "vllm") for c in ("grpo", "ppo") if HAVE_VLLM or os.environ.get("CI"))]


@pytest.fixture(scope="module")
def cli_runs(chat_model, task_dir, tmp_path_factory):
    """Every case of the test below as `rlhflab <command> --config run.yaml`, one after another
    in one process (tests/dist_jobs.py: vLLM is imported once, not once per case), with no
    PYTHONPATH. Each case has its own config folder with its env and tool modules beside
    the YAML, named after the case, so that each run finds its own there."""
    from dist_jobs import run_jobs

    base = tmp_path_factory.mktemp("env-cli")
    jobs = {}
    for command, backend in CLI_CASES:
        name = f"{command}_{backend}"
        cfg_dir = base / f"cfg_{name}"
        cfg_dir.mkdir()
        (cfg_dir / f"my_env_{name}.py").write_text(ONE_TURN_ENV)
        (cfg_dir / f"calc_tools_{name}.py").write_text(CALC_TOOL)
        section = {"grpo": "grpo:\n  prompts_per_step: 2\n  group_size: 2\n  batch_size: 4\n  mini_batch_size: 4\n",
                   "ppo": "ppo:\n  rollout_samples: 4\n  batch_size: 4\n  mini_batch_size: 4\n  epochs: 1\n"}[command]
        (cfg_dir / "run.yaml").write_text(textwrap.dedent(f"""\
            defaults: [{ROOT / 'configs' / f'{command}_debug.yaml'}]
            model: {{name_or_path: {chat_model}}}
            dataset: {{path: {task_dir / 'train.jsonl'}, eval_path: {task_dir / 'test.jsonl'}, prompt_template: "{{prompt}}",
                       num_eval_samples: 4}}
            generation: {{max_new_tokens: 8, backend: {backend}{", enforce_eager: true" if backend == "vllm" else ""}}}
            env: {{name: my_env_{name}:TwoTurns, max_turns: 3, tools: [calc_tools_{name}:add], tool_format: plain,
                   max_length: 200}}
            training: {{output_dir: {base / name}, total_steps: 2, save_interval: 0, eval_interval: 2,
                        num_threads: 1}}
            logging: {{progress_bar: false, plots: false, doctor: false}}
            """) + section)
        jobs[name] = [command, "--config", str(cfg_dir / "run.yaml")]
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(base)}
    return run_jobs(base, jobs, env, 1, cwd=base)


@pytest.mark.slow
@pytest.mark.parametrize("command, backend", [("grpo", "hf"), ("ppo", "hf"),
                                              pytest.param("grpo", "vllm", marks=needs_vllm),
                                              pytest.param("ppo", "vllm", marks=needs_vllm)])
def test_cli_trains_from_a_yaml_naming_env_and_tool(cli_runs, command, backend):
    """No PYTHONPATH: the env and the tool modules sit beside the config; hf and vLLM."""
    name = f"{command}_{backend}"
    out = cli_runs.ok(name)
    assert f"preflight: env my_env_{name}:TwoTurns" in cli_runs.text(name, "out") + cli_runs.text(name, "err")
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    turns = [r["episode/turns_mean"] for r in rows if "episode/turns_mean" in r]
    # An untrained model mostly runs out of tokens mid-turn (which ends an episode), so the
    # turns lie between 1 and max_turns; every episode metric is logged at every step.
    assert len(turns) == 2 and all(1 <= t <= 3 for t in turns)
    assert all("episode/tool_error_rate" in r and "episode/hit_max_turns_frac" in r for r in rows
               if "episode/turns_mean" in r)


def test_decode_kwargs_greedy_sampled_and_lockstep():
    """The one builder of generate()'s decoding arguments, shared by single- and multi-turn."""
    from rlhflab.rollout.hf import LOCKSTEP_ATTR, decode_kwargs
    m = torch.nn.Linear(1, 1)
    assert decode_kwargs(m, greedy=True, temperature=0.7, top_k=5, top_p=0.9) == dict(
        do_sample=False, temperature=None, top_k=None, top_p=None)
    assert decode_kwargs(m, greedy=False, temperature=0.7, top_k=0, top_p=1.0) == dict(
        do_sample=True, temperature=0.7, top_k=None, top_p=None)  # top-k 0 / top-p 1: off
    setattr(m, LOCKSTEP_ATTR, True)
    assert decode_kwargs(m, greedy=True, temperature=1.0, top_k=0, top_p=1.0)["synced_gpus"] is True


def test_multiturn_hf_refused_under_sharded_layers():
    """Episodes end after different numbers of turns on different ranks, so lockstep
    generate calls (FSDP / ZeRO-3 sharded layers) would not pair up: one line instead of a hang."""
    from rlhflab.rollout.hf import hf_generate_ids
    from rlhflab.errors import UserError
    from rlhflab.rollout.hf import LOCKSTEP_ATTR
    m = torch.nn.Linear(1, 1)
    setattr(m, LOCKSTEP_ATTR, True)
    with pytest.raises(UserError, match="FSDP or ZeRO-3"):
        hf_generate_ids(m, None, [[1, 2]], max_new_tokens=2, stop_ids=[0])
