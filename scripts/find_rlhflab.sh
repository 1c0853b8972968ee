# Sourced by the scripts in this folder: sets RLHFLAB to the rlhflab command to run.
#   $RLHFLAB when set; else the repo's own .venv/bin/rlhflab (built by `make venv`, no need to
#   activate it); else `rlhflab` on PATH (an activated venv, a pip install); else stop with the fix.
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
unset _repo
