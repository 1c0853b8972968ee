#!/usr/bin/env bash
# The real-model measurements on one CUDA GPU, one after the other, each under a time limit:
#   1. grpo_throughput.py: rlhflab beside TRL 1.16's GRPOTrainer, both in bf16;
#   2. the SmolLM2 GRPO recipe (configs/grpo_smollm2.yaml) on CUDA with bf16 autocast and
#      float32 weights, held-out greedy accuracy before / at step 25 / at step 50, seeds 0
#      and 1 side by side (two processes on the one GPU);
#   3. grpo_throughput.py again with grpo.share_prompt=true on rlhflab's side (auto is off on a GPU);
#   4. packed_prompt.py: the shared prompt's two passes against one packed pass per group;
#   5. rollout_backends.py: the hf backend on the GPU (vLLM too where it is installed);
#   6. ppo_throughput.py: rlhflab (value head, separate critic) and TRL 1.12's PPO, each alone.
# Not run unless named in STAGES: grpo_throughput_static, grpo_throughput with generate's static
# KV cache (transformers compiles the decoding step on a GPU), rlhflab's side (STATIC_SIDES).
# compile_layers, bench/compile_layers.py (model.compile_layers' update step against eager: once
# with transformers' MLP, once with rlhflab's lean MLP, the eager layers a run has by default).
# Reports go to $OUT/<name>.txt (stderr to <name>.err, JSON where a bench writes one); the
# lines to paste are printed at the end and kept in $OUT/paste.txt.
#
#   SMOL=outputs/models/smollm2-135m-instruct bash bench/real_model_gpu.sh
#   QUICK=1 SMOL=DIR bash bench/real_model_gpu.sh     # tiny settings: checks the script end to end
#   OUT=DIR PY=python BUDGET=SECONDS ...              # BUDGET: stop starting stages after this long
#   DEVICE=cpu MP=no QUICK=1 ...                      # the same stages on the CPU (a check of the script)
#   STAGES="grpo_throughput grpo_throughput_static" GRPO_REPEATS=1 ...   # some stages, in this order
#
# TRL lives in .bench/trl (1.12, PPO) and .bench/trl-grpo (1.16, GRPO) as bench/real_model.sh
# installs them. A stage that fails or runs out of time does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the benches' worker processes import rlhflab
PY=${PY:-.venv/bin/python}
QUICK=${QUICK:-0}
SMOL=${SMOL:-outputs/models/smollm2-135m-instruct}
BUDGET=${BUDGET:-3000}
DEVICE=${DEVICE:-cuda}
MP=${MP:-bf16}
# the stages, in this order (a lease too short for all of them names a few)
STAGES=${STAGES:-grpo_throughput grpo_recipe grpo_throughput_shared packed_prompt rollout_backends ppo_throughput}
GRPO_REPEATS=${GRPO_REPEATS:-2}          # grpo_throughput's alternating runs
SHARED_SIDES=${SHARED_SIDES:-rlhflab,trl}  # rlhflab alone when TRL ran in grpo_throughput on the same machine
STATIC_SIDES=${STATIC_SIDES:-rlhflab}
KNOWN="grpo_throughput grpo_recipe grpo_throughput_shared grpo_throughput_static packed_prompt rollout_backends ppo_throughput compile_layers"
for stage in $STAGES; do  # every name checked before anything runs (a lease's minutes are few)
  case " $KNOWN " in *" $stage "*) ;; *) echo "real_model_gpu: unknown stage $stage: pick from $KNOWN" >&2; exit 2;; esac
done
OUT=${OUT:-outputs/bench-gpu/$(date -u +%Y%m%dT%H%M%SZ)$([ "$QUICK" = 1 ] && echo -quick)}
mkdir -p "$OUT"
declare -A RC
START=$SECONDS

note() { echo "[real_model_gpu $(date -u +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$OUT/machine.txt" >&2; }

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "cpu: $(nproc) CPUs visible"
  $PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '| cuda', torch.version.cuda)"
  echo "quick: $QUICK"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" >&2

run() {  # run NAME LIMIT_S ARGS...: one stage, at most LIMIT_S seconds and never past BUDGET
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then note "$name: skipped, $left s of the budget left"; RC[$name]=skipped; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  note "$name (at most $limit s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$PY" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  RC[$name]=$?
  echo "${RC[$name]}" > "$OUT/$name.rc"
  note "$name: exit ${RC[$name]} after $((SECONDS - t0)) s"
}

together() {  # together NAME1 NAME2: the two stages started since the last call (run ... &) have ended
  wait
  local name
  for name in "$@"; do RC[$name]=$(cat "$OUT/$name.rc" 2>/dev/null || echo skipped); done
}

# BACKEND=vllm where vLLM is installed on the GPU machine (the CPU recipe generates with vLLM's CPU build)
GPU=("training.device=$DEVICE" "training.mixed_precision=$MP" "model.name_or_path=$SMOL" "generation.backend=${BACKEND:-hf}")
# RECIPE_EXTRA: more overrides for the recipe's runs, e.g. "generation.hf_cache=dynamic"
read -r -a extra <<< "${RECIPE_EXTRA:-}"
GPU+=("${extra[@]}")
if [ "$QUICK" = 1 ]; then
  for seed in 0 1; do
    run grpo_recipe_s$seed 300 scripts/real_model_recipes.py --recipe grpo --seed $seed --threads 2 \
      --out "$OUT/recipes_s$seed" --results "$OUT/real_model_gpu_s$seed.json" "${GPU[@]}" \
      training.total_steps=2 dataset.num_eval_samples=16 &
  done
  together grpo_recipe_s0 grpo_recipe_s1
  run grpo_throughput 300 bench/grpo_throughput.py --device "$DEVICE" --mixed-precision "$MP" --model-dir "$SMOL" \
    --sides rlhflab,trl --steps 2 --repeats 1 --completions 4 --group-size 2 --max-new-tokens 4 --beta 0.04 \
    --peak-sizes 512 --out "$OUT/grpo-scratch"
  run ppo_throughput 300 bench/ppo_throughput.py --device "$DEVICE" --mixed-precision "$MP" --model-dir "$SMOL" \
    --sides rlhflab,trl --repeats 1 --warmup 0 --episodes 4 --response-length 4 --epochs 1 --no-tensor-memory \
    --peak-sizes 512 --json "$OUT/ppo_throughput.json"
  run rollout_backends 300 bench/rollout_backends.py --device "$DEVICE" --mixed-precision "$MP" --model-dir "$SMOL" \
    --lengths 8 --batches 4 --repeats 1 --peak-sizes 512
else
  for stage in $STAGES; do
    case $stage in
      grpo_throughput)  # GRPO: 8 prompts x 4 completions of up to 32 tokens, beta 0.04, as on the CPU.
        run grpo_throughput 240 bench/grpo_throughput.py --device "$DEVICE" --mixed-precision "$MP" \
          --model-dir "$SMOL" --sides rlhflab,trl --steps 4 --repeats "$GRPO_REPEATS" --completions 32 \
          --group-size 4 --max-new-tokens 32 --beta 0.04 --peak-sizes 8192 --out "$OUT/grpo-scratch" ;;
      grpo_recipe)  # The recipe (50 steps of 4 prompts x 8 completions, up to 48 new tokens), evaluated at
        # 0, 25 and 50; seeds 0 and 1 side by side on the one GPU (at this size a step leaves the GPU
        # mostly idle), each in a folder and results file of its own.
        for seed in 0 1; do
          run grpo_recipe_s$seed 330 scripts/real_model_recipes.py --recipe grpo --seed $seed --threads 6 \
            --out "$OUT/recipes_s$seed" --results "$OUT/real_model_gpu_s$seed.json" "${GPU[@]}" \
            training.eval_interval=25 &
        done
        together grpo_recipe_s0 grpo_recipe_s1 ;;
      grpo_throughput_shared)  # rlhflab computing a group's prompt once (grpo.share_prompt=true, its
        # CPU setting; auto turns it off on a GPU, where it saves FLOPs that cost little and adds passes)
        run grpo_throughput_shared 150 bench/grpo_throughput.py --device "$DEVICE" --mixed-precision "$MP" \
          --model-dir "$SMOL" --sides "$SHARED_SIDES" --share-prompt true --steps 4 --repeats 1 --completions 32 \
          --group-size 4 --max-new-tokens 32 --beta 0.04 --peak-sizes 8192 --out "$OUT/grpo-shared-scratch" ;;
      grpo_throughput_static)  # generate's static KV cache (rlhflab generation.hf_cache; TRL's
        # cache_implementation, which failed under bf16 on 2026-11-28: a float32 cache fed bfloat16 keys):
        # transformers compiles the decoding step; no priming run, so a side compiles once, in its
        # first (untimed) step.
        run grpo_throughput_static 240 bench/grpo_throughput.py --device "$DEVICE" --mixed-precision "$MP" \
          --model-dir "$SMOL" --sides "$STATIC_SIDES" --hf-cache static --no-prime --steps 5 --repeats "$GRPO_REPEATS" \
          --completions 32 --group-size 4 --max-new-tokens 32 --beta 0.04 --peak-sizes 8192 \
          --out "$OUT/grpo-static-scratch" ;;
      packed_prompt)  # the shared prompt's two passes against one packed pass per group
        run packed_prompt 90 bench/packed_prompt.py --device "$DEVICE" --mixed-precision "$MP" --model-dir "$SMOL" \
          --repeats 5 --threads 4 ;;
      rollout_backends)
        run rollout_backends 150 bench/rollout_backends.py --device "$DEVICE" --mixed-precision "$MP" \
          --model-dir "$SMOL" --lengths 64 256 --batches 32 128 --repeats 2 --peak-sizes 8192 ;;
      compile_layers)  # model.compile_layers' update step against eager: transformers' MLP, then rlhflab's
        # lean MLP (the eager layers a run has by default; compile_layers turns it off)
        run compile_layers 90 bench/compile_layers.py --device "$DEVICE" --mixed-precision "$MP" --model-dir "$SMOL" \
          --repeats 10 --threads 4
        run compile_layers_lean 90 bench/compile_layers.py --device "$DEVICE" --mixed-precision "$MP" \
          --model-dir "$SMOL" --repeats 10 --threads 4 --lean-mlp ;;
      ppo_throughput)  # PPO: 32 episodes x 16 tokens, 4 epochs of one 32-episode minibatch, as on the CPU.
        run ppo_throughput 240 bench/ppo_throughput.py --device "$DEVICE" --mixed-precision "$MP" --model-dir "$SMOL" \
          --sides rlhflab,rlhflab-critic,trl --repeats 3 --warmup 1 --peak-sizes 8192 \
          --json "$OUT/ppo_throughput.json" ${PPO_EXTRA:-} ;;  # PPO_EXTRA, e.g. "--hf-cache static"
    esac
  done
fi

{
  echo "== real-model runs on $(sed -n 's/^gpu: //p' "$OUT/machine.txt"), $(sed -n 's/^date: //p' "$OUT/machine.txt")"
  echo "model: $SMOL; outputs: $OUT; $(grep '^torch' "$OUT/machine.txt")"
  for name in grpo_recipe_s0 grpo_recipe_s1 grpo_throughput grpo_throughput_shared grpo_throughput_static \
      packed_prompt ppo_throughput rollout_backends compile_layers compile_layers_lean; do
    [ -n "${RC[$name]:-}" ] || continue
    echo
    echo "-- $name (exit ${RC[$name]})"
    case $name in
      grpo_recipe_*) grep -E '^\| grpo' "$OUT/$name.txt" ;;
      ppo_throughput) sed -n '/^side /,/^$/p; /^MFU per phase/,$p; /^ratios/,/^$/p' "$OUT/$name.txt" ;;
      packed_prompt) grep -E '^(plain|shared|packed) |^largest|^packed_prompt:' "$OUT/$name.txt" ;;
      compile_layers*) grep -E '^(eager|compiled) |^largest|^compile_layers:' "$OUT/$name.txt" ;;
      grpo_throughput*) grep -E '^\| |^per phase|^  (rlhflab|trl):|^step seconds|^grpo_throughput:' "$OUT/$name.txt" ;;
      rollout_backends) grep -E '^matmul peak|^smollm2|^[a-z0-9.-]+ +[0-9.]+M|^targets:|^rollout_backends:' "$OUT/$name.txt" ;;
    esac
    [ "${RC[$name]}" = 0 ] || tail -8 "$OUT/$name.err"
  done
} | tee "$OUT/paste.txt"
