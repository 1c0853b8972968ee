#!/usr/bin/env bash
# The whole pipeline on a tiny local model, offline, on CPU (a few minutes on 2 cores; its wall
# time, with the machine's load, is what `scripts/measure_readme.py` prints for it):
#   make-tiny -> make-data -> SFT (policy, sloppy demonstrations) -> SFT (judge, worked solutions)
#   -> preference pairs -> reward model on the judge -> PPO of the policy on the reward model
#   -> base / SFT / PPO answers side by side.
# Usage: scripts/pipeline_debug.sh [OUT]      (OUT defaults to outputs)
# It runs $RLHFLAB when set, else the repo's .venv/bin/rlhflab (from `make venv`; no need to
# activate it), else `rlhflab` on PATH. Running it again replaces the runs under OUT
# (training.overwrite=true on each training stage).
# Each stage is one `rlhflab` command with a debug config; paths and the settings for the small
# tiny model (64 wide, 2 layers) are passed as dotted overrides.
set -euo pipefail
OUT="${1:-outputs}"
source "$(dirname "$0")/find_rlhflab.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
cd "$(dirname "$0")/.."
SMALL_SFT=(sft.epochs=4 sft.batch_size=8 sft.learning_rate=2e-3 training.overwrite=true)

echo "== 1. a small tiny causal LM and the arithmetic task"
$RLHFLAB make-tiny --out "$OUT/tiny-model" --hidden-size 64 --layers 2 --heads 4
$RLHFLAB make-data --out "$OUT/arith"     # train/test.jsonl: true answers; sft.jsonl: 60% off by one

echo "== 2. the policy: SFT on the sloppy demonstrations"
$RLHFLAB sft --config configs/sft_debug.yaml "${SMALL_SFT[@]}" \
  model.name_or_path="$OUT/tiny-model" data.path="$OUT/arith/sft.jsonl" data.eval_path="$OUT/arith/test.jsonl" \
  training.output_dir="$OUT/sft_debug"

echo "== 3. the judge: SFT on the worked solutions (the reward model's base)"
$RLHFLAB sft --config configs/sft_debug.yaml "${SMALL_SFT[@]}" \
  model.name_or_path="$OUT/tiny-model" data.path="$OUT/arith/train.jsonl" data.eval_path="$OUT/arith/test.jsonl" \
  training.output_dir="$OUT/sft_judge"

echo "== 4. preference pairs in the labelling app's export format (chosen: right answer, rejected: wrong)"
$RLHFLAB make-prefs --out "$OUT/prefs"
# or, the policy's own samples labelled by the GSM8K checker:
#   $RLHFLAB make-prefs --policy "$OUT/sft_debug/final" --data "$OUT/arith" --out "$OUT/prefs"

echo "== 5. the reward model"
$RLHFLAB rm --config configs/rm_debug.yaml \
  model.name_or_path="$OUT/sft_judge/final" data.path="$OUT/prefs/train.jsonl" data.eval_path="$OUT/prefs/test.jsonl" \
  training.output_dir="$OUT/rm_debug" training.overwrite=true

echo "== 6. PPO from the policy, rewarded by the reward model only"
$RLHFLAB ppo --config configs/ppo_rm_debug.yaml \
  model.name_or_path="$OUT/sft_debug/final" dataset.path="$OUT/arith/train.jsonl" dataset.eval_path="$OUT/arith/test.jsonl" \
  "reward.sources=[{type: model, path: $OUT/rm_debug/final, normalize: true, batch_size: 64}]" \
  training.output_dir="$OUT/ppo_rm_debug" training.overwrite=true

echo "== 7. base, SFT and PPO answers side by side"
$RLHFLAB generate --model "$OUT/tiny-model" --model "$OUT/sft_debug/final" --model "$OUT/ppo_rm_debug/final" \
  --prompts "$OUT/arith/test.jsonl" --template 'Question: {prompt}\nAnswer:' --limit 4 --max-new-tokens 16
