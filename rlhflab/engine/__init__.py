"""The policy-optimisation engine every method shares.

- `minibatch`: rows of a rollout as a typed `MiniBatch`, padding columns trimmed;
- `scoring`: teacher-forced passes without gradients (old log-probs, values, reference);
- `update`: the one minibatch update (epochs × minibatches × accumulation, clipping,
  the loss parts, the per-minibatch stats).
"""
