#!/usr/bin/env bash
# TPO on the quickstart's warm-started model, measured against best-of-N at equal samples
# (a few minutes on 2 cores). Three ways to use the extra rounds:
#   resample  the refine prompt is the plain question: no feedback, best-of-N by another name
#   feedback  the refine prompt shows the worst and the best answer so far with their scores
#   critique  as feedback, after the model has written a critique of the two (TPO's textual loss)
# Usage: scripts/tpo_quickstart.sh [OUT] [SEED...]   (OUT defaults to outputs/tpo; seeds to 0 1)
set -euo pipefail
OUT="${1:-outputs/tpo}"
shift || true
if [ $# -gt 0 ]; then SEEDS=("$@"); else SEEDS=(0 1); fi
source "$(dirname "$0")/find_rlhflab.sh"   # RLHFLAB and PYTHON: the repo's .venv, else PATH
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
cd "$(dirname "$0")/.."

if [ ! -d "$OUT/warm/sft/final" ]; then
  echo "== the quickstart's stages 1-3: tiny model, arithmetic task, SFT on sloppy demonstrations"
  $PYTHON -c "from pathlib import Path; from rlhflab.quickstart import prepare_warm_start; prepare_warm_start(Path('$OUT/warm'), quiet=True)"
fi
COMMON=(model.name_or_path="$OUT/warm/sft/final" dataset.eval_path="$OUT/warm/data/test.jsonl")
# Overrides are YAML: a template is quoted ("..."), and \n inside double quotes is a newline.
CRITIQUE='tpo.critique_template="{prompt} {worst}\nScore: {worst_score:.1f}\n{prompt} {best}\nScore: {best_score:.1f}\nWhy is the second answer better?"'
for seed in "${SEEDS[@]}"; do
  for mode in resample feedback critique; do
    case $mode in
      resample) extra=('tpo.refine_template="{prompt}"') ;;
      feedback) extra=() ;;
      critique) extra=("$CRITIQUE" 'tpo.refine_template="{prompt} {best}\nCritique: {critique}\n{prompt}"') ;;
    esac
    echo "== seed $seed, $mode"
    $RLHFLAB tpo --config configs/tpo_quickstart.yaml "${COMMON[@]}" run.seed="$seed" \
      run.output_dir="$OUT/$mode-seed$seed" "${extra[@]}" | grep -v '^preflight'
  done
done
