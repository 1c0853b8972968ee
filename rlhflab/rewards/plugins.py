"""Your own Python functions as rewards and correctness checks.

A plug-in is named by a *spec* in a config (``reward.sources[].name``, ``eval.correct``,
``eval.rewards[].name``) or on the command line (``rlhflab eval --correct``):

    gsm8k                      a rule registered in `rlhflab.rewards.REGISTRY`
    my_rewards:score           function `score` of module `my_rewards`
    mypkg.tasks.reverse:score  a dotted module path works too
    my_rewards.py:score        function `score` of a file; also ./my_rewards.py:score,
    rewards/my_rewards.py:score, /abs/path/my_rewards.py:score

Where it is looked for, in order: the current directory, then the config file's folder
(`plugin_dir`, which `load_config` fills in), then the installed packages. So a config
that sits next to its reward file works from any directory, and `rlhflab` finds a module
in the current directory without PYTHONPATH. Module names are imported the usual way,
with those folders put at the front of `sys.path` (as `python -m` does for the current
directory); a file is loaded from its path, with its folder appended to `sys.path` so it
can import its neighbours.

The call forms (docs/rewards.md has the whole contract):

    per example  fn(prompt: str, response: str, example: dict) -> float   (or bool for a check)
    batched      fn(prompts: list[str], responses: list[str], examples: list[dict]) -> list[float]

    TRL's form   fn(prompts, completions, **columns) -> list[float]

A batched function says so with the `batched` decorator (it sets ``fn.batched = True``,
which a file that does not import rlhflab may also set by hand). A function with a
parameter named ``completions`` (and not marked batched) is written TRL's way and is
called as TRL's GRPOTrainer calls its reward functions: keyword arguments ``prompts``,
``completions`` and one list per other column of the rows (``answer`` among them); when
the rows' ``prompt`` column holds messages, ``prompts`` are those message lists and each
completion is ``[{"role": "assistant", "content": text}]``. A column the function does
not name is left out unless it takes ``**kwargs``. Every error here is a `UserError` of
one line that names the spec and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from rlhflab.errors import UserError

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def batched(fn: Callable) -> Callable:
    """Mark `fn` as batched: called once per batch as fn(prompts, responses, examples)."""
    fn.batched = True
    return fn


def is_batched(fn: Callable) -> bool:
    return bool(getattr(fn, "batched", False))


def _parameters(fn: Callable):
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some C functions
        return None


def is_trl_form(fn: Callable) -> bool:
    """True for a reward written TRL's way, ``fn(prompts, completions, **columns)``: a
    parameter named ``completions``, and not marked batched."""
    params = _parameters(fn)
    return not is_batched(fn) and params is not None and "completions" in params


def _trl_call(fn: Callable, prompts: Sequence[str], responses: Sequence[str], examples: Sequence[dict]):
    """`fn` called as TRL's GRPOTrainer calls a reward function (see the module docstring)."""
    from rlhflab.data.prompts import is_messages

    params = _parameters(fn) or {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    chat = bool(examples) and all(is_messages(e.get("prompt")) for e in examples)
    kwargs: dict[str, Any] = {
        "prompts": [e["prompt"] for e in examples] if chat else list(prompts),
        "completions": [[{"role": "assistant", "content": r}] for r in responses] if chat else list(responses)}
    columns = list(dict.fromkeys(k for e in examples for k in e if k not in ("prompt", "completion", "completion_ids")))
    for k in columns:
        if k not in kwargs and (takes_all or k in params):
            kwargs[k] = [e.get(k) for e in examples]
    if "prompts" not in params and not takes_all:
        del kwargs["prompts"]
    return fn(**kwargs)


def search_dirs(plugin_dir: str | os.PathLike | None = None) -> list[Path]:
    """The folders a plug-in is looked for in: the current directory, then `plugin_dir`."""
    dirs = [Path.cwd()]
    if plugin_dir is not None and Path(plugin_dir).resolve() != dirs[0].resolve():
        dirs.append(Path(plugin_dir))
    return dirs


def is_plugin_spec(spec: str) -> bool:
    """True for ``module:function`` / ``file.py:function`` (as opposed to a registered name)."""
    return ":" in spec


def _where(dirs: Sequence[Path]) -> str:
    names = [f"the current directory ({dirs[0]})"] + [f"the config's folder ({d})" for d in dirs[1:]]
    return ", ".join(names)


def _import_failure(spec: str, exc: BaseException) -> UserError:
    """One line for an exception raised while a plug-in's own code ran: the plug-in's
    last frame (file:line) and the exception."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    if isinstance(exc, SyntaxError) and exc.filename:
        at = f" at {Path(exc.filename).name}:{exc.lineno}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return UserError(f"plug-in {spec!r}: importing it raised {type(exc).__name__}"
                     f"{': ' + first if first else ''}{at}; fix that file")


def _load_file(spec: str, file_part: str, dirs: Sequence[Path]):
    candidates = [Path(file_part).expanduser()] if Path(file_part).expanduser().is_absolute() else \
        [d / file_part for d in dirs]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        looked = ", ".join(str(c) for c in candidates)
        raise UserError(f"plug-in {spec!r}: file {file_part} not found (looked at {looked}); give a path "
                        "relative to the current directory or to the config file, or an absolute one")
    path = path.resolve()
    # One module per file, whatever relative path named it; a name no real module can have.
    name = f"rlhflab_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # so the file can import its neighbours
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _import_failure(spec, exc) from None
    return module


def _import_module(spec: str, module_name: str, dirs: Sequence[Path]):
    if not _MODULE.match(module_name):
        raise UserError(f"plug-in {spec!r}: {module_name!r} is neither a module name nor a .py file; "
                        "write module:function or path/to/file.py:function")
    for d in reversed(dirs):  # the current directory ends up first
        if str(d) in sys.path:
            sys.path.remove(str(d))
        sys.path.insert(0, str(d))
    importlib.invalidate_caches()  # a file written since the last import must be seen
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.split(".")[0] == exc.name.split(".")[0]:
            raise UserError(f"plug-in {spec!r}: no module {module_name!r} in {_where(dirs)} or the installed "
                            f"packages; check the name, or give the file: path/to/{module_name.split('.')[-1]}.py:"
                            f"function") from None
        raise _import_failure(spec, exc) from None
    except Exception as exc:
        raise _import_failure(spec, exc) from None


def _check_callable(spec: str, fn: Any) -> None:
    if not callable(fn):
        raise UserError(f"plug-in {spec!r} is a {type(fn).__name__}, not a function; name a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C functions: nothing to check
        return
    if is_trl_form(fn):
        return  # keyword arguments, the columns known only when it is called
    try:
        sig.bind(None, None, None)
    except TypeError:
        form = "(prompts, responses, examples)" if is_batched(fn) else "(prompt, response, example)"
        raise UserError(f"plug-in {spec!r} takes {sig} but is called as fn{form}; give it those three "
                        "parameters (or TRL's: prompts, completions, **kwargs)") from None


def load_function(spec: str, plugin_dir: str | os.PathLike | None = None) -> Callable:
    """The function named by ``module:function`` or ``path/to/file.py:function``."""
    fn = load_object(spec, plugin_dir)
    _check_callable(spec, fn)
    return fn


def load_object(spec: str, plugin_dir: str | os.PathLike | None = None) -> Any:
    """Whatever ``module:name`` or ``path/to/file.py:name`` names (a function, a class),
    found as a plug-in is; nothing about its signature is checked here. Environments
    and tools (`rlhflab.envs`) are loaded with it."""
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise UserError(f"plug-in {spec!r}: write module:function or path/to/file.py:function")
    dirs = search_dirs(plugin_dir)
    looks_like_file = module_part.endswith(".py") or "/" in module_part or "\\" in module_part
    module = (_load_file if looks_like_file else _import_module)(spec, module_part, dirs)
    if not hasattr(module, attr):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                  and getattr(v, "__module__", None) == module.__name__]
        near = difflib.get_close_matches(attr, public, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise UserError(f"plug-in {spec!r}: {module_part} has no {attr!r}; {hint}"
                        f"it defines: {', '.join(public) or 'no functions'}")
    return getattr(module, attr)


# --------------------------------------------------------------------------------------
# Calling a plug-in: both forms, one checked list of values, one-line errors.
# --------------------------------------------------------------------------------------
def _number(value: Any) -> float | None:
    """A real number (bool, int, float, numpy or 0-d torch scalar) as float; None otherwise."""
    if isinstance(value, (bool, numbers.Real)):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        item = value.item()
        return float(item) if isinstance(item, (bool, numbers.Real)) else None
    return None


def _describe_row(prompt: str) -> str:
    short = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    return f"prompt {short!r}"


def call_plugin(fn: Callable, spec: str, prompts: Sequence[str], responses: Sequence[str],
                examples: Sequence[dict], what: str = "reward") -> list[float]:
    """`fn` on a batch, in its own form; one float per response, each finite.

    `what` names the value in errors ("reward" or "check"). An exception raised by `fn`,
    a wrong return type or length, or a NaN becomes a one-line `UserError` naming `spec`
    and the prompt it failed on.
    """
    trl = is_trl_form(fn)
    if trl or is_batched(fn):
        try:
            out = _trl_call(fn, prompts, responses, examples) if trl else fn(list(prompts), list(responses),
                                                                                 list(examples))
        except Exception as exc:
            raise _call_failure(spec, exc, f"a batch of {len(prompts)} starting with {_describe_row(prompts[0])}"
                                if prompts else "an empty batch", fn) from None
        if hasattr(out, "tolist") and getattr(out, "ndim", 1) == 1:
            out = out.tolist()
        if not isinstance(out, (list, tuple)):
            form = "written TRL's way" if trl else "batched"
            raise UserError(f"plug-in {spec!r} is {form} but returned a {type(out).__name__}; return a list "
                            f"with one {what} per response")
        if len(out) != len(prompts):
            raise UserError(f"plug-in {spec!r} returned {len(out)} values for {len(prompts)} responses; "
                            f"return one {what} per response, in order")
        values = list(out)
    else:
        values = []
        for p, r, e in zip(prompts, responses, examples):
            try:
                values.append(fn(p, r, e))
            except Exception as exc:
                raise _call_failure(spec, exc, _describe_row(p), fn) from None
    wanted = "True or False" if what == "check" else "a number"
    floats = []
    for i, v in enumerate(values):
        x = _number(v)
        if x is None:
            hint = (" (a list: mark a function that scores whole batches with @rlhflab.rewards.batched)"
                    if isinstance(v, (list, tuple)) and not is_batched(fn) else "")
            raise UserError(f"plug-in {spec!r} returned {type(v).__name__} {v!r:.40} for "
                            f"{_describe_row(prompts[i])}; return {wanted}{hint}")
        if not math.isfinite(x) or (what == "check" and x not in (0.0, 1.0)):
            raise UserError(f"plug-in {spec!r} returned {x} for {_describe_row(prompts[i])}; "
                            f"a {what} must return {'True or False' if what == 'check' else 'a finite number'}")
        floats.append(x)
    return floats


def _call_failure(spec: str, exc: Exception, where: str, fn: Callable) -> UserError:
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # drop call_plugin's own frame
    # The plug-in's own line, even when the exception came from a library it called.
    home = getattr(getattr(fn, "__code__", None), "co_filename", None)
    own = [f for f in frames if f.filename == home] or frames
    at = f" at {Path(own[-1].filename).name}:{own[-1].lineno}" if own else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return UserError(f"plug-in {spec!r} raised {type(exc).__name__}{': ' + first if first else ''}{at} "
                     f"on {where}; fix the function (or the data it reads)")


def short_name(spec: str) -> str:
    """The function's name in a spec: 'my_rewards:score' -> 'score'; 'gsm8k' -> 'gsm8k'."""
    return spec.rpartition(":")[2] or spec
