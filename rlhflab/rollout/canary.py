"""The weight-sync canary: a push that silently leaves the sampler on other weights (a
tensor skipped, a LoRA adapter left out, an engine asleep) goes on sampling plausible
text, and only a log-prob gap shows it. Each gap judged is compared with the median of
the first `BASELINE_ROLLOUTS` gaps of the run (`rlhflab.doctor.sync_gap_tripped`); a jump
stops the run before anything is saved.

Which gap: in the trainer's process (vLLM, s = 0) the next rollout's
`rollout/logprob_gap`; with a producer process (`rlhflab.rollout.service`) the gap on a
fixed probe batch between the weights the trainer sent and the weights the producer
loaded, so every push is judged whatever the staleness."""

from __future__ import annotations

from rlhflab.errors import UserError

BASELINE_ROLLOUTS = 3  # the canary's baseline: the median of the first 3 gaps it judged


class SyncCanary:
    """The gaps judged after each weight push against the median of the first
    `BASELINE_ROLLOUTS` such gaps; beyond `sync_gap_limit` the run stops with a UserError.
    Every process sees the same gap (the trainer reduces it over ranks), so every process
    stops at the same step. `what` names the sampler in the message."""

    def __init__(self, factor: float, floor: float, what: str = "generation.backend=vllm"):
        self.factor, self.floor, self.what = factor, floor, what
        self.gaps: list[float] = []  # the first gaps that passed: the baseline

    def check(self, gap: float, step: int, version: int | None = None) -> None:
        from rlhflab.doctor import gap_baseline, sync_gap_limit, sync_gap_tripped

        if self.gaps:
            base = gap_baseline(self.gaps, BASELINE_ROLLOUTS)
            if sync_gap_tripped(base, gap, self.factor, self.floor):
                limit = sync_gap_limit(base, self.factor, self.floor)
                if version is None:
                    raise UserError(
                        f"step {step}: {self.what}: the weight sync looks broken: after the push, "
                        f"rollout/logprob_gap is {gap:.3g} nats per token against this run's {base:.3g} (limit "
                        f"{limit:.3g}), so the engine is not sampling the weights being trained; stopped before "
                        f"saving this step (any earlier checkpoint is intact). Check the vLLM version and sleep "
                        f"mode, or use generation.backend=hf; generation.vllm.sync_check=false turns the check off")
                raise UserError(
                    f"step {step}: {self.what}: the weight push of version {version} looks broken: on the probe "
                    f"batch the producer's log-probs are {gap:.3g} nats per token from the trainer's (this run's "
                    f"baseline {base:.3g}, limit {limit:.3g}), so it is not sampling the weights being trained; "
                    f"stopped before saving this step (any earlier checkpoint is intact); "
                    f"generation.vllm.sync_check=false turns the check off")
        if len(self.gaps) < BASELINE_ROLLOUTS:
            self.gaps.append(gap)
