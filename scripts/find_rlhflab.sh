# Sourced by the scripts in this folder and in examples/: sets RLHFLAB to the rlhflab command to run
# and PYTHON to the interpreter it runs on (for the scripts' own Python steps, which import rlhflab).
#   RLHFLAB: $RLHFLAB when set; else the repo's own .venv/bin/rlhflab (built by `make venv`, no need to
#   activate it); else `rlhflab` on PATH (an activated venv, a pip install); else stop with the fix.
#   PYTHON: $PYTHON when set; else the interpreter named on the first line of $RLHFLAB (a pip console
#   script's #!); else python3.
# The OpenMP wait policy is left to rlhflab itself (rlhflab/openmp.py; docs/quickstart.md has the timings).
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${RLHFLAB:-}" ]]; then
  if [[ -x "$_repo/.venv/bin/rlhflab" ]]; then
    RLHFLAB="$_repo/.venv/bin/rlhflab"
  elif command -v rlhflab >/dev/null 2>&1; then
    RLHFLAB="$(command -v rlhflab)"
  else
    echo "error: rlhflab not found: run \`make venv\` in $_repo (it builds .venv/ with rlhflab in it)," \
         "activate a venv that has it, or set RLHFLAB=/path/to/rlhflab" >&2
    exit 2
  fi
fi
if [[ -z "${PYTHON:-}" ]]; then
  _shebang="$(head -n 1 "$RLHFLAB" 2>/dev/null || true)"
  _shebang="${_shebang#\#!}"
  if [[ "$_shebang" == /* && -x "${_shebang%% *}" ]]; then
    PYTHON="${_shebang%% *}"
  else
    PYTHON=python3
  fi
  unset _shebang
fi
unset _repo
