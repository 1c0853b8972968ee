"""A repository file outside the package (a script, an example, a bench helper) loaded as a
module, for the tests that check what it computes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_file(name: str, path: Path) -> ModuleType:
    """The file at `path` run as module `name`, registered in sys.modules first (its
    dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
