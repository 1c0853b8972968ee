#!/usr/bin/env bash
# Your own task end to end: word reversal ("cat" -> "tac"), offline, on CPU (about 5 minutes on 2 cores).
#   data -> make-tiny (byte-level tokenizer) -> SFT on sloppy demonstrations -> PPO and GRPO with
#   my_rewards.py -> held-out accuracy of each model by my_rewards:exact.
# Usage: examples/your_own_task/run.sh [SEED]     (everything is written under examples/your_own_task/outputs;
#        a re-run replaces that seed's runs)
set -euo pipefail
SEED="${1:-0}"
source "$(dirname "$0")/../../scripts/find_rlhflab.sh"   # RLHFLAB and PYTHON: the repo's .venv, else PATH
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
cd "$(dirname "$0")"            # the task's folder: my_rewards.py is found here without PYTHONPATH
OUT="outputs/seed$SEED"
EVAL=(--data data/test.jsonl --prompt-field word --answer-field reversed --template $'Reverse: {prompt}\nAnswer:'
      --max-new-tokens 8 --reward my_rewards:score --correct my_rewards:exact)

echo "== 1. data: 2,000 training words, 200 held out, 2,000 sloppy demonstrations"
$PYTHON make_data.py --out data
echo "== 2. a tiny model whose tokenizer is byte-level: --vocab-size 258 leaves no merges, one token per letter"
$RLHFLAB make-tiny --out "$OUT/tiny-model" --vocab-size 258 --seed "$SEED"
echo "== 3. SFT warm start"
$RLHFLAB sft --config sft.yaml model.name_or_path="$OUT/tiny-model" training.output_dir="$OUT/sft" \
  training.seed="$SEED" training.overwrite=true logging.progress_bar=false
echo "== 4. PPO and GRPO from the same warm start, the same 20 x 64 completions"
$RLHFLAB ppo --config ppo.yaml model.name_or_path="$OUT/sft/final" training.output_dir="$OUT/ppo" \
  training.seed="$SEED" training.overwrite=true logging.progress_bar=false
$RLHFLAB grpo --config grpo.yaml model.name_or_path="$OUT/sft/final" training.output_dir="$OUT/grpo" \
  training.seed="$SEED" training.overwrite=true logging.progress_bar=false
echo "== 5. held-out greedy accuracy (my_rewards:exact) of each model"
for stage in sft ppo grpo; do
  acc=$($RLHFLAB eval --model "$OUT/$stage/final" "${EVAL[@]}" | awk '/^accuracy/ {print $2}')
  printf "%-5s accuracy %s\n" "$stage" "$acc" | tee -a "$OUT/accuracy.txt"
done
