"""The code's shape, checked: no import cycles, no import from a lower floor to a higher one,
no hand-written module over 600 lines.

Floors, lowest first: ``engine`` < ``services`` < ``bench``. Every import counts — module level
and inside functions — except those under ``if TYPE_CHECKING:``. Run as a script
(``python tests/test_code_shape.py``) for the report without pytest.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("engine", "services", "bench")   # lowest first
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every hand-written module of the floors, by dotted name."""
    return {_module_name(p): p for floor in FLOORS for p in sorted((ROOT / floor).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in tree, nested ones included, typing-only blocks aside."""
    if isinstance(tree, ast.If) and _is_type_checking(tree.test):
        for child in tree.orelse:
            yield from _import_nodes(child)
        return
    if isinstance(tree, (ast.Import, ast.ImportFrom)):
        yield tree
    for child in ast.iter_child_nodes(tree):
        yield from _import_nodes(child)


def _from_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The dotted module a ``from X import ...`` in module names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Dotted names this module imports anywhere (typing-only blocks aside)."""
    out: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        else:
            prefix = _from_module(node, module, is_package)
            out.add(prefix)
            out.update(f"{prefix}.{alias.name}" for alias in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        names = _imported_names(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py")
        graph[name] = {n for n in names if n in modules and n != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
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
            strongconnect(v)
    return sorted(found)


def _package_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """An import of a package's own __init__ from inside it is not a cycle of the design; keep
    only edges between modules, dropping module -> its own enclosing package."""
    return {(a, b) for a, targets in graph.items() for b in targets if not a.startswith(b + ".")}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    floor = {name: FLOORS.index(name.split(".")[0]) for name in graph}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if floor[b] > floor[a])


def oversized_modules() -> list[str]:
    sizes = {name: len(path.read_text().splitlines()) for name, path in project_modules().items()}
    return sorted(f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_LINES)


def _graph_without_self_packages() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in import_graph()}
    for a, b in _package_edges(import_graph()):
        graph[a].add(b)
    return graph


def test_no_import_cycles() -> None:
    found = cycles(_graph_without_self_packages())
    assert not found, "import cycles (function-level imports count):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_from_a_lower_floor_to_a_higher_one() -> None:
    found = upward_imports(import_graph())
    assert not found, f"imports from a lower floor ({' < '.join(FLOORS)}) to a higher one:\n" + "\n".join(found)


def test_no_hand_written_module_over_the_line_limit() -> None:
    found = oversized_modules()
    assert not found, f"modules over {MAX_LINES} lines:\n" + "\n".join(found)


def imported_project_names() -> list[tuple[str, str, str]]:
    """(importing module, imported module, name) of every ``from X import name`` of a project
    module, function-level ones included (they run only when called, so nothing else sees a
    stale one), typing-only blocks aside."""
    modules = project_modules()
    found = []
    for name, path in modules.items():
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                target = _from_module(node, name, path.name == "__init__.py")
                if target in modules:
                    found.extend((name, target, alias.name) for alias in node.names if alias.name != "*")
    return found


def test_every_imported_name_exists() -> None:
    import importlib

    missing = []
    for importer, target, name in imported_project_names():
        if f"{target}.{name}" in project_modules():
            continue
        if not hasattr(importlib.import_module(target), name):
            missing.append(f"{importer}: from {target} import {name}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_the_checker_sees_cycles_and_upward_imports(tmp_path: Path) -> None:
    """The checks above are only as good as the graph: a known cycle and a known upward edge
    (function-level, relative) are found; a TYPE_CHECKING import is not."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine import typed\n"
                     "def f():\n    from .sibling import thing\n")
    names = _imported_names(tree, "engine.pkg.mod", is_package=False)
    assert "engine.pkg.sibling" in names and "engine.pkg.sibling.thing" in names
    assert "engine.typed" not in names and "engine" not in names
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert upward_imports({"engine.x": {"services.y"}, "services.y": set()}) == ["engine.x -> services.y"]


if __name__ == "__main__":
    g = _graph_without_self_packages()
    print("cycles:", *[" <-> ".join(c) for c in cycles(g)] or ["none"], sep="\n  ")
    print("upward imports:", *upward_imports(import_graph()) or ["none"], sep="\n  ")
    print("oversized:", *oversized_modules() or ["none"], sep="\n  ")
