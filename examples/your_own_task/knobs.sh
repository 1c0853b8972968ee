#!/usr/bin/env bash
# Which GRPO/RLOO knobs matter on a 2M-parameter model: optimizer steps per rollout and learning rate.
# Every run starts from the same SFT warm start (run.sh makes it), sees the same 20 x 64
# completions, and is judged by held-out greedy accuracy (my_rewards:exact, 200 words).
# Usage: examples/your_own_task/knobs.sh [SEED...]     (default: 0 1)
#        MATCH=RLOO examples/your_own_task/knobs.sh     runs only the variants whose name matches
set -euo pipefail
source "$(dirname "$0")/../../scripts/find_rlhflab.sh"   # RLHFLAB: the repo's .venv, else PATH
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
cd "$(dirname "$0")"
if [ $# -gt 0 ]; then SEEDS=("$@"); else SEEDS=(0 1); fi
WARM="outputs/seed0/sft/final"
[ -d "$WARM" ] || { echo "no warm start at $WARM: run ./run.sh first" >&2; exit 2; }
EVAL=(--data data/test.jsonl --prompt-field word --answer-field reversed --template $'Reverse: {prompt}\nAnswer:'
      --max-new-tokens 8 --reward my_rewards:score --correct my_rewards:exact)
# config | name | overrides (16 prompts x 4 = 64 completions per step, mini-batches of 8)
VARIANTS=(
  "grpo|GRPO, 1 step/rollout, lr 5e-5 (the shipped recipe's shape)|grpo.gradient_accumulation_steps=8 grpo.learning_rate=5e-5"
  "grpo|GRPO, 1 step/rollout, lr 4e-4|grpo.gradient_accumulation_steps=8 grpo.learning_rate=4e-4"
  "grpo|GRPO, 2 steps/rollout, lr 5e-5|grpo.gradient_accumulation_steps=4 grpo.learning_rate=5e-5"
  "grpo|GRPO, 8 steps/rollout, lr 5e-5 (grpo.yaml)|grpo.gradient_accumulation_steps=1 grpo.learning_rate=5e-5"
  "grpo|GRPO, 8 steps/rollout, lr 2e-4|grpo.gradient_accumulation_steps=1 grpo.learning_rate=2e-4"
  "rloo|RLOO, 1 step/rollout, lr 5e-5 (the shipped recipe's shape)|rloo.gradient_accumulation_steps=8 rloo.learning_rate=5e-5"
  "rloo|RLOO, 8 steps/rollout, lr 5e-5 (rloo.yaml)|rloo.gradient_accumulation_steps=1 rloo.learning_rate=5e-5"
)
MATCH="${MATCH:-.}"
mkdir -p outputs/knobs
printf "%-62s %s\n" "variant (20 steps x 64 completions)" "held-out accuracy per seed" | tee outputs/knobs.txt
for i in "${!VARIANTS[@]}"; do
  IFS="|" read -r method name over <<< "${VARIANTS[$i]}"
  [[ "$name" =~ $MATCH ]] || continue
  accs=()
  for seed in "${SEEDS[@]}"; do
    out="outputs/knobs/v$i-seed$seed"
    rm -rf "$out"
    # shellcheck disable=SC2086
    $RLHFLAB "$method" --config "$method.yaml" model.name_or_path="$WARM" training.output_dir="$out" \
      training.seed="$seed" training.eval_interval=0 logging.progress_bar=false logging.plots=false $over \
      > "$out.log" 2>&1
    accs+=("$($RLHFLAB eval --model "$out/final" "${EVAL[@]}" | awk '/^accuracy/ {print $2}')")
  done
  printf "%-62s %s\n" "$name" "${accs[*]}" | tee -a outputs/knobs.txt
done
