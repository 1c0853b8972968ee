"""Every `rlhflab ...` command the README, docs/*.md and the configs' header comments show,
resolved against the CLI without running anything.

For each command: the subcommand is one of `rlhflab --help`'s (`cli.COMMANDS`); its
arguments parse with that command's own argparse parser (built as `rlhflab` builds it, so
an unknown `--flag`, a bad choice or a missing required option fails here); its
`--config FILE` exists; each `key=value` override names a key of the command's config
schema (`rlhflab config show`), and, where the command is written out in full (no
placeholder), the config file and the overrides load as `rlhflab config resolve` would
load them. An `accelerate launch` line's `--config_file` exists, and a ZeRO-3 launch does
not run a config that ZeRO-3 refuses (LoRA, a vLLM backend).

Where commands are found: fenced and indented code blocks (one command a line, `\\`
continuations joined, `cd DIR` followed), inline code spans, and the comment lines at
the top of every config file. A code block or a config header is a command to run, so
it must be complete (every required option given); an inline span may be a mention
(`rlhflab label export --db FILE`), so only what it shows is checked. Words in capitals
(`FILE`, `DIR`), `<...>`, `...` and shell variables are placeholders.

Commands that deliberately show an error are in ALLOWED with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

from rlhflab import cli
from rlhflab.config.cli import SCHEMAS, schema_for, schema_rows
from rlhflab.config.loader import ALIASES, load_config
from rlhflab.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml")) + sorted((ROOT / "examples").glob("*/*.yaml"))

# (file relative to the repo, a substring of the command): why it is shown although it fails.
ALLOWED: dict[tuple[str, str], str] = {}

PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|<|\.\.\.|…|\$")
OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "(", ")", "$(", "`"}


@dataclasses.dataclass
class Command:
    where: str            # file:line
    tokens: list[str]     # from the subcommand on
    cwd: Path             # where a relative --config is looked up
    complete: bool        # a command to run (code block, config header), not a mention
    text: str             # the whole simple command, launcher included


# ----------------------------------------------------------------------- extraction

def _split(text: str) -> list[list[str]]:
    """Shell words of `text`, cut at operators and comments into simple commands."""
    if "=[" not in text and "${" not in text:  # `[--backend vllm]`: an optional part, shown
        text = text.replace("[", " [ ").replace("]", " ] ")
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
        lex.whitespace_split = True
        words = list(lex)
    except ValueError:  # an unbalanced quote in a prose span
        words = text.split()
    out, cur = [], []
    for w in words:
        if w in OPERATORS or set(w) <= set(";&|<>()"):
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    out.append(cur)
    return [c for c in out if c]


def _commands_in(text: str, where: str, cwd: Path, complete: bool) -> list[Command]:
    found = []
    for words in _split(text):
        for i, w in enumerate(words):
            if (w in ("rlhflab", "$RLHFLAB") or w.endswith("/rlhflab")) and i + 1 < len(words):
                if i > 0 and words[i - 1] not in ("-m",) and not words[0].endswith(("accelerate", "torchrun")):
                    continue  # `rlhflab` as someone's argument, not the program
                tokens = [t for t in words[i + 1:] if t not in ("[", "]")]
                found.append(Command(where, tokens, cwd, complete, " ".join(words)))
                break
    return found


def _page_commands(path: Path) -> list[Command]:
    rel = path.relative_to(ROOT)
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Command] = []
    fenced, cwd, pending, start = False, ROOT, "", 0
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        indented = not fenced and line.startswith("    ") and (
            bool(pending) or not line.lstrip().startswith(("-", "*", "|")))  # not a list item's text
        if fenced or indented:
            body = line.strip()
            if not pending:
                start = n
            if body.endswith("\\"):
                pending += body[:-1] + " "
                continue
            body, pending = pending + body, ""
            m = re.match(r"cd (\S+)\s*(&&|$)", body)
            if m:  # a tutorial's `cd examples/...` holds for the rest of its page
                cwd = (ROOT / m.group(1)).resolve()
            found += _commands_in(body, f"{rel}:{start}", cwd, complete=True)
        else:
            for span in re.findall(r"`([^`]+)`", line):
                if re.search(r"(^|[\s/])rlhflab\s", span):
                    found += _commands_in(span, f"{rel}:{n}", ROOT, complete=False)
    return found


def _config_commands(path: Path) -> list[Command]:
    """Commands in the comment lines at the top of a config file (its header): a line's
    backquoted `rlhflab ...` spans are mentions; else, from `rlhflab <command>` (or a
    launcher) to the end of the line, or to a `(` or `;`, is a command to run. Paths are
    the repo root's for configs/, the config's own folder for an example's."""
    rel = path.relative_to(ROOT)
    cwd = ROOT if rel.parts[0] == "configs" else path.parent
    found: list[Command] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("#"):
            break
        body = line.lstrip("#").strip()
        spans = [s for s in re.findall(r"`([^`]+)`", body) if re.search(r"(^|[\s/])rlhflab\s", s)]
        if spans:
            for span in spans:
                found += _commands_in(span, f"{rel}:{n}", cwd, complete=False)
            continue
        m = re.search(r"(?:\S*accelerate launch|torchrun)\s.*|(?<![\w/.`])\S*rlhflab\s+(\S+).*", body)
        if m and (m.group(1) is None or difflib.get_close_matches(m.group(1), list(cli.COMMANDS), n=1, cutoff=0.75)):
            found += _commands_in(m.group(0), f"{rel}:{n}", cwd, complete=True)  # not prose: "rlhflab builds"
    return found


def _script_commands(path: Path) -> list[Command]:
    """`$RLHFLAB ...` lines of a shell script (continuations joined), looked up from the
    folder the script moves to: the repo root for scripts/, its own folder for examples/."""
    rel = path.relative_to(ROOT)
    cwd = ROOT if rel.parts[0] == "scripts" else path.parent
    found, pending, start = [], "", 0
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        body = line.strip()
        if not pending:
            start = n
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        body, pending = pending + body, ""
        if "$RLHFLAB " in body and not body.startswith("#"):
            found += _commands_in(body, f"{rel}:{start}", cwd, complete=True)
    return found


SCRIPTS = sorted((ROOT / "scripts").glob("*.sh")) + sorted((ROOT / "examples").glob("*/*.sh"))
ALL = ([c for p in PAGES for c in _page_commands(p)] + [c for p in CONFIGS for c in _config_commands(p)]
       + [c for p in SCRIPTS for c in _script_commands(p)])


# ----------------------------------------------------------------------- resolution

class _ParseError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting (subparsers inherit the class)."""

    def error(self, message):  # noqa: D401
        raise _ParseError(message)

    def exit(self, status=0, message=None):
        raise _ParseError(message or f"exit {status}")


_PARSERS: dict[str, argparse.ArgumentParser] = {}


def parser_for(name: str) -> argparse.ArgumentParser:
    if name not in _PARSERS:
        parser = _Parser(prog=f"rlhflab {name}", add_help=False)
        importlib.import_module(cli.COMMANDS[name][0]).add_parser(parser)
        _PARSERS[name] = parser
    return _PARSERS[name]


def _schema_keys(command: str) -> tuple[set[str], set[str]]:
    """(every key, the keys whose value is a free mapping) of a command's config."""
    rows = schema_rows(schema_for(command))
    keys = {r[0].replace("[]", "") for r in rows} | set(ALIASES)
    return keys, {r[0] for r in rows if r[1] in ("mapping", "any")}


def _key_problem(command: str, key: str) -> str | None:
    if PLACEHOLDER.search(key) or key in ("key", "KEY"):
        return None
    keys, free = _schema_keys(command)
    bare = re.sub(r"\[\d*\]", "", key)
    if bare in keys or any(bare.startswith(k + ".") for k in free):
        return None
    return f"{key}: not a key of `rlhflab {command}`'s config (rlhflab config show {command})"


def _placeholder_in(message: str, tokens: list[str]) -> bool:
    return any(PLACEHOLDER.search(t) and t in message for t in tokens)


def problems(cmd: Command) -> list[str]:
    toks = cmd.tokens
    if not toks or PLACEHOLDER.search(toks[0]):
        return []                                    # `rlhflab <command>`
    name = toks[0]
    if name in ("--help", "-h", "--version"):
        return []
    if name not in cli.COMMANDS:
        return [f"unknown command {name!r} (rlhflab --help lists {', '.join(cli.COMMANDS)})"]
    rest = toks[1:]
    parser = parser_for(name)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub and rest and "/" in rest[0]:
        # `rlhflab label generate/import/serve/stats/export`: each action must exist
        return [f"{name} has no action {a!r}" for a in rest[0].split("/") if a not in sub.choices]
    if not rest and not cmd.complete:
        return []                                    # a mention of the command
    try:
        args, extra = parser.parse_known_args(rest)
    except _ParseError as exc:
        msg = str(exc)
        if _placeholder_in(msg, rest):
            return []                                # e.g. invalid choice: 'CMD'
        if "arguments are required" in msg and (not cmd.complete or any("$" in t for t in rest)):
            return []                                # a mention, or options in a shell variable
        return [f"does not parse: {msg}"]
    out = [f"unknown option {e}" for e in extra if e.startswith("-")]
    # a shell variable (`"${EVAL[@]}"`) holds options the parser cannot see
    out += [f"unexpected argument {e!r}" for e in extra if not e.startswith("-") and "$" not in e]
    out += _config_problems(name, args, cmd)
    return out


def _config_problems(name: str, args: argparse.Namespace, cmd: Command) -> list[str]:
    if name == "config" and getattr(args, "action", None) == "resolve":
        command = args.command
        config, overrides = (args.config or [None])[0], [*(args.config or [])[1:], *args.overrides]
    elif name in SCHEMAS:
        command, config, overrides = name, getattr(args, "config", None), list(getattr(args, "overrides", []))
    elif name == "quickstart":
        command, config, overrides = None, None, list(args.overrides)
    else:
        return []
    out = []
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item:
            if not PLACEHOLDER.search(item):
                out.append(f"{item!r} is not a key=value override")
            continue
        target = command or ("sft" if key.startswith("sft.") else "ppo")
        if target in SCHEMAS:
            problem = _key_problem(target, key)
            if problem:
                out.append(problem)
    if config is None or PLACEHOLDER.search(config):
        return out
    path = cmd.cwd / config
    if config.startswith("outputs/"):
        return out                                   # a run's own effective_config.yaml
    if not path.is_file():
        return out + [f"--config {config}: no such file (from {cmd.cwd.relative_to(ROOT) or '.'})"]
    if out or not command or any(PLACEHOLDER.search(o) for o in overrides):
        return out
    try:  # written out in full: load it as `rlhflab config resolve` does
        load_config(path, schema_for(command), overrides)
    except ConfigError as exc:
        out.append(f"does not load: {exc}")
    return out


def _launch_problems(cmd: Command) -> list[str]:
    """`accelerate launch --config_file X -m rlhflab ...`: X exists; under ZeRO-3, no LoRA or vLLM."""
    m = re.search(r"--config_file\s+(\S+)", cmd.text)
    if not m:
        return []
    path = ROOT / m.group(1)
    if PLACEHOLDER.search(m.group(1)) or "{" in m.group(1):
        return []
    if not path.is_file():
        return [f"--config_file {m.group(1)}: no such file"]
    launch = yaml.safe_load(path.read_text())
    if (launch.get("deepspeed_config") or {}).get("zero_stage") != 3:
        return []
    name, rest = cmd.tokens[0], cmd.tokens[1:]
    if name not in SCHEMAS:
        return []
    args, _ = parser_for(name).parse_known_args(rest)
    if not args.config or PLACEHOLDER.search(args.config):
        return []
    cfg, _ = load_config(ROOT / args.config, schema_for(name), [o for o in args.overrides if "=" in o])
    out = []
    if cfg.lora.enabled:
        out.append(f"{args.config} has lora.enabled: true, which ZeRO-3 refuses; add lora.enabled=false")
    if cfg.generation.backend != "hf":
        out.append(f"{args.config} samples with {cfg.generation.backend}, which ZeRO-3 refuses")
    return out


# ----------------------------------------------------------------------- tests

def test_commands_are_found_in_every_kind_of_place():
    # The extraction itself: a broken regex that found nothing would pass every check below.
    wheres = {c.where.split(":")[0] for c in ALL}
    assert "README.md" in wheres and "configs/ppo_debug.yaml" in wheres and "docs/labelling.md" in wheres
    assert "scripts/sentiment_demo.sh" in wheres and "examples/your_own_task/run.sh" in wheres
    assert any(c.complete and c.where.startswith("docs/") for c in ALL)          # code blocks
    assert any(not c.complete for c in ALL)                                      # inline spans
    assert any(c.tokens[0] == "grpo" and c.where.startswith("configs/accelerate/zero3.yaml") for c in ALL)
    assert len(ALL) > 150, len(ALL)


def test_the_checks_catch_what_the_docs_once_got_wrong():
    # Each mistake the docs-commands issue listed, written as a command: each must fail.
    def check(text: str, complete: bool = True) -> list[str]:
        (cmd,) = _commands_in(text, "probe", ROOT, complete)
        return problems(cmd) + _launch_problems(cmd)

    assert check("rlhflab label export --out outputs/prefs.jsonl")                 # --db is required
    assert check("rlhflab reinforce_pp --config configs/reinforce_pp_debug.yaml")  # the command is reinforce-pp
    assert check("rlhflab ppo --config configs/ppo_debug.yaml --steps 3")          # no such option
    assert check("rlhflab ppo --config configs/no_such.yaml")                      # no such file
    assert check("rlhflab sft --config configs/sft_debug.yaml sft.save_steps=10")  # no such key
    assert check("rlhflab ppo --config configs/ppo_debug.yaml model.reference=lora_disabled")  # does not load
    assert check("accelerate launch --config_file configs/accelerate/zero3.yaml -m rlhflab grpo "
                 "--config configs/grpo_gsm8k.yaml")                                # LoRA under ZeRO-3
    # ... and the right forms pass, placeholders included.
    assert not check("rlhflab label export --db pairs.db --out prefs.jsonl")
    assert not check("rlhflab label export --out FILE", complete=False)            # a mention
    assert not check("rlhflab config resolve CMD --config FILE")
    assert not check("rlhflab sft --config FILE [key=value ...]")
    assert not check("accelerate launch --config_file configs/accelerate/zero3.yaml -m rlhflab grpo "
                     "--config configs/grpo_gsm8k.yaml lora.enabled=false model.reference=copy")


@pytest.mark.parametrize("script", [p for p in SCRIPTS if p.name != "find_rlhflab.sh"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_find_the_venvs_rlhflab_and_leave_openmp_to_the_cli(script):
    # The README says rlhflab is in .venv/, not on PATH: a script that calls a bare `rlhflab`
    # fails from a fresh clone. And every rlhflab command sets how idle OpenMP threads wait
    # (rlhflab/openmp.py); a script forcing OMP_WAIT_POLICY=PASSIVE is slower on a quiet machine.
    text = script.read_text()
    code = [line.split(" #")[0] for line in text.splitlines() if not line.lstrip().startswith("#")]
    if not any("rlhflab" in line or "$PYTHON" in line for line in code):
        return
    assert any(re.match(r'\s*source "\$\(dirname "\$0"\)/(\.\./\.\./scripts/)?find_rlhflab\.sh"', line)
               for line in code), f"{script.name}: source scripts/find_rlhflab.sh to find rlhflab"
    bare = [line for line in code if re.match(r"\s*(\w+=\S*\s+)*rlhflab\s", line)]
    assert not bare, f"{script.name}: runs a bare rlhflab (use $RLHFLAB): {bare[0]}"
    assert not re.search(r"\bOMP_WAIT_POLICY=", "\n".join(code)), f"{script.name}: sets OMP_WAIT_POLICY"
    assert not re.search(r'PYTHON="\$\{PYTHON:-python\}"', text), f"{script.name}: PYTHON comes from find_rlhflab.sh"


@pytest.mark.parametrize("cmd", ALL, ids=lambda c: f"{c.where} {' '.join(c.tokens[:4])}")
def test_every_documented_command_resolves(cmd):
    found = problems(cmd) + _launch_problems(cmd)
    allowed = [why for (file, text), why in ALLOWED.items() if cmd.where.startswith(file) and text in cmd.text]
    if allowed:
        assert found, f"{cmd.where}: `{cmd.text}` is allowed to fail ({allowed[0]}) but resolves: drop it from ALLOWED"
        return
    assert not found, f"{cmd.where}: `rlhflab {' '.join(cmd.tokens)}`: " + "; ".join(found)
