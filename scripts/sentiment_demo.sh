#!/usr/bin/env bash
# The TRL sentiment example, offline, on CPU (a few minutes on 2 cores):
#   make-tiny -> make-reviews -> classifier (the reward) -> SFT (the policy) -> PPO toward positive
#   -> before/after: the classifier's score and the lexicon's positive-rate (a held-out check)
#   -> the classifier on a few hand-written continuations.
# Usage: scripts/sentiment_demo.sh [OUT] [SEED]     (OUT defaults to outputs/sentiment, where
#        configs/ppo_sentiment.yaml looks; SEED to 0; a re-run replaces the runs in OUT)
#        HACK=1 scripts/sentiment_demo.sh [OUT] [SEED]   adds stage 7: PPO without the KL penalty for
#        40 steps, then `rlhflab doctor` on it: the policy learns to game the classifier.
set -euo pipefail
OUT="${1:-outputs/sentiment}"
SEED="${2:-0}"
source "$(dirname "$0")/find_rlhflab.sh"   # RLHFLAB and PYTHON: the repo's .venv, else PATH
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
cd "$(dirname "$0")/.."

echo "== 1. a tiny causal LM (2.4M parameters) and the generated review task"
$RLHFLAB make-tiny --out "$OUT/tiny-model"
$RLHFLAB make-reviews --out "$OUT/reviews" --seed "$SEED"

echo "== 2. the reward: a sentiment classifier trained on labelled sentences"
$RLHFLAB classifier --config configs/classifier_debug.yaml model.name_or_path="$OUT/tiny-model" \
  data.path="$OUT/reviews/labelled_train.jsonl" data.eval_path="$OUT/reviews/labelled_test.jsonl" \
  training.output_dir="$OUT/classifier" training.seed="$SEED" training.overwrite=true logging.progress_bar=false

echo "== 3. the policy: SFT on review continuations from a grumpy critic (mostly negative)"
$RLHFLAB sft --config configs/sft_sentiment.yaml model.name_or_path="$OUT/tiny-model" \
  data.path="$OUT/reviews/sft.jsonl" training.output_dir="$OUT/sft" training.seed="$SEED" training.overwrite=true logging.progress_bar=false

echo "== 4. PPO toward positive, rewarded by the classifier; the lexicon check logged beside it"
$RLHFLAB ppo --config configs/ppo_sentiment.yaml model.name_or_path="$OUT/sft/final" \
  dataset.path="$OUT/reviews/prompts_train.jsonl" dataset.eval_path="$OUT/reviews/prompts_test.jsonl" \
  "reward.sources=[{type: classifier, path: $OUT/classifier/final, label: POSITIVE, text: response}]" \
  training.output_dir="$OUT/ppo" training.seed="$SEED" training.overwrite=true logging.progress_bar=false

echo "== 5. before and after PPO, 200 held-out openings, greedy"
$PYTHON - "$OUT/ppo/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
evals = [r for r in rows if "eval/reward_mean" in r]
steps = [r for r in rows if "rollout/reward_mean" in r]
first, last = evals[0], evals[-1]
print(f"{'':52}{'after SFT':>10}{'after PPO':>11}")
for key, name in [("eval/reward_mean", "classifier P(POSITIVE), greedy (the reward)"),
                  ("eval/accuracy", "positive-rate by the lexicon, greedy"),
                  ("eval/lexicon", "lexicon score in [-1, 1], greedy")]:
    print(f"{name:52}{first[key]:>10.3f}{last[key]:>11.3f}")
print(f"{'classifier P(POSITIVE), sampled (rollout, step 1/last)':52}"
      f"{steps[0]['rollout/reward_mean']:>10.3f}{steps[-1]['rollout/reward_mean']:>11.3f}")
print(f"(greedy: 200 held-out openings at steps {first['step']} and {last['step']}; every evaluation: {sys.argv[1]})")
PY

echo "== 6. the classifier on hand-written continuations: what can it be fooled by?"
$PYTHON scripts/probe_classifier.py "$OUT/classifier/final"

if [ "${HACK:-0}" = 1 ]; then
  echo "== 7. no KL penalty, 40 steps: does the policy game the classifier? (the lexicon and the doctor say)"
  $RLHFLAB ppo --config configs/ppo_sentiment.yaml model.name_or_path="$OUT/sft/final" \
    dataset.path="$OUT/reviews/prompts_train.jsonl" dataset.eval_path="$OUT/reviews/prompts_test.jsonl" \
    "reward.sources=[{type: classifier, path: $OUT/classifier/final, label: POSITIVE, text: response}]" \
    training.output_dir="$OUT/ppo_kl0" training.seed="$SEED" training.overwrite=true ppo.kl_coeff=0 training.total_steps=40 \
    training.eval_interval=10 logging.progress_bar=false | grep -E "^eval at|^    -> |doctor"
  $RLHFLAB doctor "$OUT/ppo_kl0" --no-plot || true   # exits 1 when a rule fired
fi
