#!/usr/bin/env bash
# The whole pipeline on the tiny local model, offline, on CPU:
#   make-tiny -> make-data -> SFT -> preference pairs -> reward model -> PPO on the reward model
#   -> side-by-side generations of the SFT and PPO models.
# Usage: scripts/pipeline_debug.sh [OUT]      (OUT defaults to outputs; about 5-8 minutes on 2 cores)
# Each stage is one `rlhflab` command with a debug config; the paths are passed as dotted overrides.
set -euo pipefail
OUT="${1:-outputs}"
RLHFLAB="${RLHFLAB:-rlhflab}"
PYTHON="${PYTHON:-python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
cd "$(dirname "$0")/.."

echo "== 1. a tiny causal LM and the arithmetic task"
$RLHFLAB make-tiny --out "$OUT/tiny-model"
$RLHFLAB make-data --out "$OUT/arith"            # train/test (true answers), sft.jsonl (sloppy demos)

echo "== 2. SFT on the sloppy demonstrations"
$RLHFLAB sft --config configs/sft_debug.yaml \
  model.name_or_path="$OUT/tiny-model" data.path="$OUT/arith/sft.jsonl" data.eval_path="$OUT/arith/test.jsonl" \
  training.output_dir="$OUT/sft_debug"

echo "== 3. preference pairs (right answer chosen, wrong rejected), in the labelling app's export format"
$PYTHON -m rlhflab.data.preferences --out "$OUT/prefs"

echo "== 4. a reward model from the SFT model"
$RLHFLAB rm --config configs/rm_debug.yaml \
  model.name_or_path="$OUT/sft_debug/final" data.path="$OUT/prefs/train.jsonl" data.eval_path="$OUT/prefs/test.jsonl" \
  training.output_dir="$OUT/rm_debug"

echo "== 5. PPO from the SFT model, rewarded by the reward model"
$RLHFLAB ppo --config configs/ppo_rm_debug.yaml \
  model.name_or_path="$OUT/sft_debug/final" dataset.path="$OUT/arith/train.jsonl" dataset.eval_path="$OUT/arith/test.jsonl" \
  "reward.sources=[{type: model, path: $OUT/rm_debug/final, normalize: true, batch_size: 64}]" \
  training.output_dir="$OUT/ppo_rm_debug"

echo "== 6. base, SFT and PPO answers side by side"
$RLHFLAB generate --model "$OUT/tiny-model" --model "$OUT/sft_debug/final" --model "$OUT/ppo_rm_debug/final" \
  --prompts "$OUT/arith/test.jsonl" --template 'Question: {prompt}\nAnswer:' --limit 4 --max-new-tokens 16
