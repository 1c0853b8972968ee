"""A learner's workspace: writing it (`learn init`) and importing it (check, run).

A workspace is a plain folder holding one file per exercise (ex1_policy_loss.py ...
ex5_minibatch_update.py) and a README. The files import each other by module name
(exercise 5 uses exercises 1-3), so the folder goes on `sys.path` while it is in use.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from importlib import resources
from pathlib import Path
from types import ModuleType

from rlhflab.errors import UserError
from rlhflab.learn.exercises import EXERCISES

README = "README.md"


def template_text(name: str) -> str:
    """The text of a file in rlhflab/learn/templates/ (package data)."""
    return resources.files("rlhflab.learn").joinpath("templates", name).read_text(encoding="utf-8")


def init_workspace(path: str | Path, force: bool = False) -> list[Path]:
    """Write the five exercise stubs and a README into `path`; returns the files written.

    Existing exercise files are never overwritten unless `force` (they hold the
    learner's work).
    """
    out = Path(path)
    names = [e.filename for e in EXERCISES] + [README]
    existing = [n for n in names if (out / n).exists()]
    if existing and not force:
        raise UserError(f"{out}: {', '.join(existing)} already exist(s); they may hold your work. "
                        f"Use another folder, or --force to overwrite them with fresh stubs")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        (out / name).write_text(template_text(name), encoding="utf-8")
        written.append(out / name)
    return written


def _describe_import_error(exc: BaseException, folder: Path) -> str:
    if isinstance(exc, SyntaxError):
        return f"{Path(exc.filename or '?').name} line {exc.lineno}: {exc.msg}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).resolve().parent == folder.resolve()]
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}{where}"


class Workspace:
    """The learner's exercise modules, imported fresh from `path`.

    `modules[n]` is exercise n's module; `errors[n]` says why it could not be imported
    (missing file, syntax error, ...). Use as a context manager, or call `close()`:
    it takes the folder off `sys.path` and forgets the modules, so a second workspace
    in the same process imports its own files.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        self.modules: dict[int, ModuleType] = {}
        self.errors: dict[int, str] = {}
        if not self.path.is_dir():
            raise UserError(f"{path}: no such folder; create a workspace with `rlhflab learn init {path}`")
        if not any((self.path / e.filename).is_file() for e in EXERCISES):
            raise UserError(f"{path}: no exercise files here (ex1_policy_loss.py ...); "
                            f"create them with `rlhflab learn init {path}` or pass --dir")
        self._forget()
        sys.path.insert(0, str(self.path))
        importlib.invalidate_caches()
        dont_write = sys.dont_write_bytecode
        sys.dont_write_bytecode = True  # no __pycache__ in the learner's folder
        try:
            for e in EXERCISES:
                if not (self.path / e.filename).is_file():
                    self.errors[e.number] = (f"{e.filename} is missing; `rlhflab learn init` writes it "
                                             f"(into a new folder, or with --force)")
                    continue
                try:
                    self.modules[e.number] = importlib.import_module(e.module)
                except Exception as exc:  # the learner's file: report it, do not crash the grader
                    self.errors[e.number] = _describe_import_error(exc, self.path)
        finally:
            sys.dont_write_bytecode = dont_write

    @staticmethod
    def _forget() -> None:
        for e in EXERCISES:
            sys.modules.pop(e.module, None)

    def close(self) -> None:
        if str(self.path) in sys.path:
            sys.path.remove(str(self.path))
        self._forget()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
