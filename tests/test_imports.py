"""The package's import graph: no circles, and the floors of DESIGN.md's data flow hold.

Every `import` and `from ... import` in every module of mop_train counts, at any depth (a lazy import
inside a function, or one under `if TYPE_CHECKING:`, is still a dependency: two modules that need each
other are one concept, or a third is missing). Read from the source with `ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "mop_train"

FORBIDDEN = {
    # floor: what it must not import (prefixes)
    "mop_train.ops": ("mop_train.config", "mop_train.train", "mop_train.plan", "mop_train.cli", "mop_train.sweep"),
    "mop_train.models": ("mop_train.config", "mop_train.train", "mop_train.plan", "mop_train.cli",
                         "mop_train.parallel"),
    "mop_train.layout": ("mop_train.config", "mop_train.train", "mop_train.plan", "mop_train.cli"),
    "mop_train.parallel": ("mop_train.train", "mop_train.plan", "mop_train.cli"),
    "mop_train.plan": ("mop_train.train", "mop_train.cli", "mop_train.sweep"),
    "mop_train.hf": ("mop_train.config", "mop_train.train", "mop_train.plan", "mop_train.cli", "mop_train.parallel"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The mop_train module `name` refers to (itself, or the package holding an attribute of that name)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the mop_train modules it imports (anywhere in its source)."""
    modules, graph = _modules(), {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule pkg.sub when there is one
                targets |= {f"{base}.{alias.name}" for alias in node.names} | {base}
        graph[name] = {t for t in (_resolve(t, modules) for t in targets if t.startswith("mop_train"))
                       if t and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_edges_only(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop the edges from a package's __init__ to its own submodules and back to their package:
    Python runs a package's __init__ before any submodule, so a submodule importing a sibling through
    the package, or the package re-exporting its submodules, is not a circle between concepts."""
    out = {}
    for v, targets in graph.items():
        out[v] = {w for w in targets if not (w.startswith(v + ".") or v.startswith(w + "."))}
    return out


def test_the_graph_is_read():
    graph = import_graph()
    assert "mop_train.plan.terms" in graph["mop_train.plan.job"]
    assert "mop_train.ops.bound" in graph["mop_train.ops.moe_dispatch.memory"]
    assert "mop_train.plan.job" in graph["mop_train.train.build"]


def test_no_import_circles():
    cycles = _cycles(_package_edges_only(import_graph()))
    assert not cycles, "import circles (each a set of modules that import each other):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("floor", sorted(FORBIDDEN))
def test_floors_import_only_downwards(floor):
    graph = import_graph()
    bad = sorted(f"{v} imports {w}" for v, targets in graph.items() if v == floor or v.startswith(floor + ".")
                 for w in targets if w.startswith(FORBIDDEN[floor]))
    assert not bad, f"{floor} must not import {FORBIDDEN[floor]}:\n  " + "\n  ".join(bad)


def test_the_checker_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"p": {"p.q"}, "p.q": {"p"}}) == [["p", "p.q"]]
    assert _cycles(_package_edges_only({"p": {"p.q"}, "p.q": {"p"}})) == []
