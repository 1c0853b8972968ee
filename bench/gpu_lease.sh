#!/usr/bin/env bash
# Runs on the GPU machine, in the second call of a lease (bench/gpu_carry.sh packed what it
# needs): joins the GGUF's two parts (the first call left part00 in /tmp/gpu-carry), checks the
# SHA-256, installs the carried wheels into /tmp/site, unpacks TRL into .bench, imports the
# model with `rlhflab import-gguf`, then runs bench/real_model_gpu.sh with the caller's STAGES,
# BUDGET and other settings, its reports in /tmp/gpu-reports and, packed, in $OUT/reports.tgz
# (the device tool brings back at most 8 files; the benches' scratch folders and the recipes'
# trained models stay behind: 1.6 GB a recipe, which a call's 600 s ran out gzipping once).
#
#   STAGES="grpo_throughput grpo_throughput_static" BUDGET=400 bash bench/gpu_lease.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
CARRY=${CARRY:-/tmp/gpu-carry}
SMOL=${SMOL:-outputs/models/smollm2-135m-instruct}
REPORTS=${REPORTS:-/tmp/gpu-reports}
GGUF=$CARRY/SmolLM2-135M-Instruct.Q4_1.gguf

[ -f "$CARRY/part00" ] || { echo "gpu_lease: $CARRY/part00 is missing: the first call copies .gpu/a/part00 there (on the same, still warm machine)" >&2; exit 3; }
[ -f .gpu/b/part01 ] || { echo "gpu_lease: .gpu/b/part01 is missing: carry .gpu/b (bench/gpu_carry.sh packs it)" >&2; exit 3; }
cat "$CARRY/part00" .gpu/b/part01 > "$GGUF"
if [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$(cat .gpu/b/gguf.sha256)" ]; then
  echo "gpu_lease: $GGUF does not match .gpu/b/gguf.sha256: the parts come from different packs; run bench/gpu_carry.sh again and carry both" >&2
  exit 3
fi
if compgen -G ".gpu/b/whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/b/whl/*.whl \
    || { echo "gpu_lease: installing the carried wheels failed" >&2; exit 4; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p .bench && tar xzf .gpu/b/trl.tgz -C .bench || { echo "gpu_lease: .gpu/b/trl.tgz did not unpack" >&2; exit 4; }
"$PY" -m rlhflab import-gguf "$GGUF" --out "$SMOL" 2>&1 | grep -v 'de-quantizing' || true
[ -f "$SMOL/config.json" ] || { echo "gpu_lease: the import wrote no $SMOL/config.json" >&2; exit 5; }
rm -rf "$REPORTS"
PY=$PY OUT=$REPORTS SMOL=$SMOL bash bench/real_model_gpu.sh
rc=$?
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/reports.tgz" --exclude='*-scratch' --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' -C "$(dirname "$REPORTS")" "$(basename "$REPORTS")"
fi
exit $rc
