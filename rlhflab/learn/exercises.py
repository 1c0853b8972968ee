"""The five exercises: which file, which functions, which docs page explains them.

This is the one table the rest of `rlhflab.learn` reads: `init` copies the template of
each exercise, the grader imports the learner's file and grades the functions named
here, `solution` prints the library functions listed here, and `run` plugs the
learner's functions into the PPO trainer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    number: int
    title: str
    module: str                  # file name in the workspace, without .py
    functions: tuple[str, ...]   # the functions the learner writes, in order
    docs: tuple[str, ...]        # pages of docs/ (with anchors) that explain it
    stub_hint: str               # what to do first, shown while the file is still the stub

    @property
    def filename(self) -> str:
        return f"{self.module}.py"


EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        1, "the PPO clipped policy loss", "ex1_policy_loss", ("compute_policy_loss",),
        ("trpo_to_ppo.md#3-ppo-the-trust-region-moved-into-the-objective",
         "ppo_step.md#the-losses-of-phase-5"),
        "compute the ratio exp(logprobs - old_logprobs), the unclipped and the clipped "
        "surrogate, keep the pessimistic one per token, and average over real response "
        "tokens only"),
    Exercise(
        2, "the clipped value loss", "ex2_value_loss", ("compute_value_loss",),
        ("knobs.md#value_clip-the-value-clip", "actor_critic.md#the-value-head"),
        "clip the new value to within clip_range of old_values, take the larger of the two "
        "squared errors against the returns, halve it, and average over real response tokens"),
    Exercise(
        3, "the entropy bonus", "ex3_entropy_loss", ("compute_entropy_loss",),
        ("knobs.md#entropy_coeff-the-entropy-bonus",),
        "compute H = -sum_v p_v log p_v per position from log_softmax(logits), average it over "
        "real response tokens, and return -H as the loss"),
    Exercise(
        4, "GAE advantages, returns and whitening", "ex4_gae",
        ("compute_gae_advantages", "whiten_advantages"),
        ("advantages.md#gae-a-dial-between-the-two", "advantages.md#why-it-is-computed-backwards",
         "advantages.md#returns-the-critics-targets", "advantages.md#whitening"),
        "walk t from the last position to the first: delta_t = r_t + gamma*V_{t+1} - V_t, "
        "A_t = delta_t + gamma*lam*A_{t+1}, with everything 0 past the last real token; "
        "returns = A + V; then whiten over real tokens only"),
    Exercise(
        5, "the PPO minibatch update", "ex5_minibatch_update", ("minibatch_loss", "update_step"),
        ("ppo_step.md#the-losses-of-phase-5", "batching.md#exact-gradient-accumulation"),
        "minibatch_loss: forward the model, compute the three losses with your exercises 1-3, "
        "combine them; update_step: backward each minibatch weighted by its share of the "
        "group's tokens, clip the gradient norm, step, zero the gradients"),
)

BY_NUMBER: dict[int, Exercise] = {e.number: e for e in EXERCISES}
BY_MODULE: dict[str, Exercise] = {e.module: e for e in EXERCISES}

#: Where the concepts guide lives, relative to the repository root.
DOCS_DIR = "docs"


def doc_link(page: str) -> str:
    """`docs/<page>` as printed to the learner."""
    return f"{DOCS_DIR}/{page}"
