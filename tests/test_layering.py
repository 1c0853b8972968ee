"""No import cycles between rlhflab's packages, counting imports inside functions.

Every module's imports are read with `ast` (top level, inside functions, under `if`),
mapped to the unit they land in (a subpackage such as `rlhflab.engine`, or a top-level
module such as `rlhflab.evaluate`), and the graph of units must have no cycle: the way
goes down the floors docs/overview.md lists, never back up. A cycle is printed as the
chain of units with one import (file:line) per arrow.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlhflab"


def _units() -> set[str]:
    return {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}


def _unit_of(module: str, units: set[str]) -> str | None:
    parts = module.split(".")
    if parts[0] != "rlhflab" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in units else None


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, str]]:
    """unit -> {unit it imports: "file:line" of one such import}."""
    units = _units() if package == PACKAGE else {p.stem if p.is_file() else p.name for p in package.iterdir()}
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        module = ".".join(rel.parts)
        here = module.removesuffix(".__init__")
        src = _unit_of(here, units)
        if src is None:  # rlhflab/__init__.py, __main__ (the entry point)
            continue
        pkg = here if path.stem == "__init__" else here.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names] if base == "rlhflab" else [base]
            else:
                continue
            for target in targets:
                dst = _unit_of(target, units)
                if dst is not None and dst != src:
                    graph[src].setdefault(dst, f"{path.relative_to(package.parent)}:{node.lineno}")
    return dict(graph)


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(comps)


def _walk(graph, comp: list[str]) -> list[str]:
    """A cycle through comp's first unit (breadth-first back to it inside comp)."""
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w not in comp:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def describe(graph, comp: list[str]) -> str:
    """One cycle through the component, then every import between its units (one
    file:line each)."""
    units = set(comp)
    lines = [" -> ".join(_walk(graph, comp)) + f"   (one cycle of the knot {', '.join(comp)})"]
    lines += [f"  {a} -> {b}   ({where})" for a in sorted(units) for b, where in sorted(graph.get(a, {}).items())
              if b in units]
    return "\n".join(lines)


def test_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "rlhflab"
    for name in ("a", "b", "c"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from rlhflab.b import y\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from rlhflab.c.z import g\n")
    (pkg / "c" / "z.py").write_text("import rlhflab.a.x\n")
    graph = import_graph(pkg)
    # a -> b (top level), b -> c (inside f), c -> a: one cycle of three
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert describe(graph, ["a", "b", "c"]).splitlines()[0].startswith("a -> b -> c -> a")
    (pkg / "c" / "z.py").write_text("from rlhflab import b\n")  # c -> b: b <-> c only
    assert find_cycles(import_graph(pkg)) == [["b", "c"]]
    (pkg / "c" / "z.py").write_text("import torch\n")  # the way goes down only
    assert find_cycles(import_graph(pkg)) == []


def test_no_import_cycle_between_packages():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between rlhflab's packages:\n" + "\n\n".join(
        describe(graph, c) for c in cycles)


def test_ops_imports_no_other_rlhflab_package():
    """ops/ is the floor: pure tensor maths on torch, no model, config or rank."""
    assert import_graph().get("ops", {}) == {}


def test_ops_hold_no_process_global_switch():
    """No `global` statement in ops/: a setting that changes what an op computes is an
    argument (the CPU seam, rlhflab/cpu/, owns the process's float32 linear library)."""
    found = [f"{p.relative_to(PACKAGE.parent)}:{node.lineno}" for p in sorted((PACKAGE / "ops").rglob("*.py"))
             for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))) if isinstance(node, ast.Global)]
    assert found == []


ENGINE_MODULES = ("rlhflab.rollout.hf", "rlhflab.rollout.vllm")
ABOVE_THE_SEAM = ("trainers", "envs", "engine")


def test_nothing_above_the_rollout_seam_imports_an_engine_module():
    """trainers/, envs/ and engine/ talk to the rollout package (its service and protocol),
    never to an engine module (hf.py, vllm.py): a third engine is one file and its
    registration (docs/adding_a_backend.md). Imports inside functions count."""
    found = []
    for unit in ABOVE_THE_SEAM:
        for path in sorted((PACKAGE / unit).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                for name in names:
                    if any(name == m or name.startswith(m + ".") for m in ENGINE_MODULES):
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {name}")
    assert not found, "\n".join(found)
