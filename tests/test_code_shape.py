"""The code's shape, checked: no import cycles (between modules, between packages, type-only ones
included), no import from a lower floor to a higher one, no function-level import of a project
module except to keep a heavy library out of a light module, no hand-written module over 600 lines.

Floors, lowest first (a module imports only its own floor and those below):

0. ``pdserve.engine``: the engine core, no roles, no services;
1. ``pdserve.services.common``: the shared floor (settings and flags, ports and topology, security,
   gRPC setup, proto conversion, tracing, metrics);
2. the serving wing: ``api``, ``router``, ``workers``, ``kv_transfer``, ``client``;
3. the operations wing: ``cli``, ``deployment``, ``ray_deploy``, ``planner``, ``loadtest``;
4. the ``pdserve`` package's own public API and ``python -m pdserve``;
5. ``bench`` (not installed).

Run as a script (``python tests/test_code_shape.py``) for the report without pytest.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("engine", "services", "pdserve", "bench")   # folders holding hand-written modules
MAX_LINES = 600
SERVING = ("api", "router", "workers", "kv_transfer", "client")
OPERATIONS = ("cli", "deployment", "ray_deploy", "planner", "loadtest")
FLOOR_NAMES = ("engine", "shared floor", "serving wing", "operations wing", "pdserve API", "bench")
# A function-level import of a project module is allowed only when the module it imports brings one
# of these into a module that does not have it at import time (a light command, a torch-free
# process, an install without an optional extra); it says why in a comment on its line or the line above.
HEAVY = ("torch", "transformers", "fastapi", "uvicorn",                          # heavy to import
         "numpy", "grpc", "cryptography", "prometheus_client",                  # slow for a command that answers at once
         "ray", "opentelemetry", "matplotlib", "flash_attn", "lz4", "yaml", "openai")   # optional extras


def _module_name(path: Path) -> str:
    """The name a module is imported by: engine/ and services/ are installed as pdserve.engine and
    pdserve.services (pyproject's package-dir)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in ("engine", "services"):
        parts.insert(0, "pdserve")
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every hand-written module, by dotted name (the generated stubs in pdserve/v1 aside)."""
    return {_module_name(p): p for top in SOURCES for p in sorted((ROOT / top).rglob("*.py"))
            if "v1" not in p.relative_to(ROOT).parts}


def floor_of(module: str) -> int:
    parts = module.split(".")
    if parts[0] == "bench":
        return 5
    if parts[:2] == ["pdserve", "engine"]:
        return 0
    if parts[:2] != ["pdserve", "services"]:
        return 4   # pdserve, pdserve.__main__
    room = parts[2] if len(parts) > 2 else ""
    if room in SERVING:
        return 2
    if room in OPERATIONS:
        return 3
    return 1       # services.common and the services package itself


def room_of(module: str) -> str:
    """The package a module lives in, for package-level cycles: pdserve.engine's subpackages and
    pdserve.services' rooms (a module directly under them is its own room)."""
    parts = module.split(".")
    if parts[:2] in (["pdserve", "engine"], ["pdserve", "services"]):
        return ".".join(parts[:3])
    return ".".join(parts[:2]) if parts[0] == "bench" else parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, typing_too: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in tree, nested ones included; typing-only blocks only if typing_too."""
    if isinstance(tree, ast.If) and _is_type_checking(tree.test) and not typing_too:
        for child in tree.orelse:
            yield from _import_nodes(child, typing_too)
        return
    if isinstance(tree, (ast.Import, ast.ImportFrom)):
        yield tree
    for child in ast.iter_child_nodes(tree):
        yield from _import_nodes(child, typing_too)


def _from_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The dotted module a ``from X import ...`` in module names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_exports() -> dict[str, dict[str, str]]:
    """package -> {name: module} of the packages whose public names load on first use
    (pdserve.engine.lazy_exports): ``from package import name`` imports that module."""
    found: dict[str, dict[str, str]] = {}
    for name, path in project_modules().items():
        if path.name != "__init__.py" or "lazy_getattr" not in path.read_text():
            continue
        for stmt in ast.parse(path.read_text(), str(path)).body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict):
                try:
                    value = ast.literal_eval(_dict_with_fromkeys_expanded(stmt.value))
                except ValueError:
                    continue
                if value and all(isinstance(v, str) and v.startswith("pdserve.") for v in value.values()):
                    found[name] = value
    return found


def _dict_with_fromkeys_expanded(node: ast.Dict) -> ast.Dict:
    """{**dict.fromkeys(("a", "b"), "m"), "c": "n"} as a plain dict literal."""
    keys, values = [], []
    for k, v in zip(node.keys, node.values):
        if k is None and isinstance(v, ast.Call) and getattr(v.func, "attr", "") == "fromkeys":
            for name in ast.literal_eval(v.args[0]):
                keys.append(ast.Constant(name))
                values.append(v.args[1])
        else:
            keys.append(k)
            values.append(v)
    return ast.Dict(keys=keys, values=values)


_LAZY: dict[str, dict[str, str]] | None = None


def _node_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> set[str]:
    """The dotted names an import statement loads; a lazily exported name counts as its module."""
    global _LAZY
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    prefix = _from_module(node, module, is_package)
    if _LAZY is None:
        _LAZY = {}
        _LAZY = _lazy_exports()
    lazy = _LAZY.get(prefix, {})
    return {prefix} | {f"{prefix}.{alias.name}" for alias in node.names} | \
        {lazy[alias.name] for alias in node.names if alias.name in lazy}


def _imported_names(tree: ast.AST, module: str, is_package: bool, typing_too: bool = False) -> set[str]:
    """Dotted names this module imports anywhere (typing-only blocks only if typing_too)."""
    out: set[str] = set()
    for node in _import_nodes(tree, typing_too):
        out |= _node_names(node, module, is_package)
    return out


def import_graph(typing_too: bool = False) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere; typing-only imports if typing_too)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        names = _imported_names(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", typing_too)
        graph[name] = {n for n in names if n in modules and n != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
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


def module_graph(typing_too: bool = True) -> dict[str, set[str]]:
    """The import graph without a module's import of its own enclosing package (its __init__):
    that is not a cycle of the design."""
    return {a: {b for b in targets if not a.startswith(b + ".")} for a, targets in import_graph(typing_too).items()}


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """room -> the rooms its modules import (a package's __init__ counts as its own room's)."""
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(room_of(a), set()).update(room_of(b) for b in targets if room_of(b) != room_of(a))
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({FLOOR_NAMES[floor_of(a)]}) -> {b} ({FLOOR_NAMES[floor_of(b)]})"
                  for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a))


def oversized_modules() -> list[str]:
    sizes = {name: len(path.read_text().splitlines()) for name, path in project_modules().items()}
    return sorted(f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_LINES)


def _heavy_at_import(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the HEAVY libraries importing it brings in (module-level imports, transitively)."""
    direct: dict[str, set[str]] = {}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        top = [n for stmt in tree.body for n in _top_level_imports(stmt)]
        names = set().union(*(_node_names(n, name, path.name == "__init__.py") for n in top)) if top else set()
        direct[name] = {h for h in HEAVY if any(n == h or n.startswith(h + ".") for n in names)}
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}   # packages run first
        edges[name] = {n for n in names | parents if n in modules and n != name}
    memo: dict[str, set[str]] = {}

    def heavy(m: str, seen: frozenset = frozenset()) -> set[str]:
        if m in memo:
            return memo[m]
        out = set(direct[m])
        for n in edges[m] - seen:
            out |= heavy(n, seen | {m})
        if not seen:
            memo[m] = out
        return out
    return {m: heavy(m) for m in modules}


def _top_level_imports(stmt: ast.stmt) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports run when the module is imported: its body's, in try/if blocks too, not TYPE_CHECKING."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        yield stmt
    elif isinstance(stmt, ast.If) and not _is_type_checking(stmt.test):
        for child in stmt.body + stmt.orelse:
            yield from _top_level_imports(child)
    elif isinstance(stmt, ast.Try):
        for child in stmt.body + stmt.orelse + stmt.finalbody + [s for h in stmt.handlers for s in h.body]:
            yield from _top_level_imports(child)


def function_level_imports() -> list[tuple[str, int, frozenset[str], bool]]:
    """(module, line, the project modules the statement imports, commented) of each import of a
    project module inside a function or class body."""
    modules = project_modules()
    found = []
    for name, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source, str(path))
        top = {id(n) for stmt in tree.body for n in _top_level_imports(stmt)}
        typing = {id(n) for n in _import_nodes(tree, typing_too=True)} - {id(n) for n in _import_nodes(tree)}
        for node in _import_nodes(tree):
            if id(node) in top or id(node) in typing:
                continue
            targets = frozenset(n for n in _node_names(node, name, path.name == "__init__.py")
                                if n in modules and not name.startswith(n + "."))
            commented = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
            if targets:
                found.append((name, node.lineno, targets, commented))
    return found


def unjustified_function_level_imports() -> list[str]:
    """Function-level imports of project modules that keep no heavy library out of their module, or
    say nothing about why."""
    modules = project_modules()
    heavy = _heavy_at_import(modules)
    bad = []
    for module, line, targets, commented in function_level_imports():
        if module.startswith("bench"):
            continue
        kept_out = set().union(*(heavy[t] for t in targets)) - heavy[module]
        what = ", ".join(sorted(t for t in targets if "." in t.removeprefix("pdserve.")))
        if not kept_out:
            bad.append(f"{module}:{line} imports {what} in a function, keeping nothing heavy out")
        elif not commented:
            bad.append(f"{module}:{line} imports {what} in a function (keeps {', '.join(sorted(kept_out))} "
                       f"out) without a comment saying so")
    return sorted(set(bad))


def test_no_import_cycles_between_modules_type_only_ones_included() -> None:
    found = cycles(module_graph(typing_too=True))
    assert not found, "import cycles (function-level and typing-only imports count):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycles_between_packages() -> None:
    found = cycles(package_graph(module_graph(typing_too=True)))
    assert not found, "package-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_from_a_lower_floor_to_a_higher_one() -> None:
    found = upward_imports(module_graph(typing_too=True))
    assert not found, f"imports from a lower floor to a higher one ({' < '.join(FLOOR_NAMES)}):\n" + "\n".join(found)


def test_function_level_imports_only_keep_a_heavy_library_out() -> None:
    found = unjustified_function_level_imports()
    assert not found, "\n".join(found)


def test_no_hand_written_module_over_the_line_limit() -> None:
    found = oversized_modules()
    assert not found, f"modules over {MAX_LINES} lines:\n" + "\n".join(found)


def imported_project_names() -> list[tuple[str, str, str]]:
    """(importing module, imported module, name) of every ``from X import name`` of a project
    module, function-level and typing-only ones included."""
    modules = project_modules()
    found = []
    for name, path in modules.items():
        for node in _import_nodes(ast.parse(path.read_text(), str(path)), typing_too=True):
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


def test_nothing_imports_the_checkout_s_folders_as_top_level_packages() -> None:
    """engine and services are importable only as pdserve.engine and pdserve.services: a test
    importing ``engine`` would pass from the checkout and fail on an installed wheel."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")) + sorted(project_modules().values()):
        tree = ast.parse(path.read_text(), str(path))
        for node in _import_nodes(tree, typing_too=True):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if not getattr(node, "level", 0) and any(n.split(".")[0] in ("engine", "services") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "imports of engine/services as top-level names:\n" + "\n".join(found)


def test_the_checker_sees_cycles_upward_imports_and_lazy_imports() -> None:
    """The checks above are only as good as their graphs: a known cycle, a known upward edge, a
    package cycle made of module edges that are no module cycle, and a typing-only import seen only
    when asked for."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pdserve.engine import typed\n"
                     "def f():\n    from .sibling import thing\n")
    names = _imported_names(tree, "pdserve.engine.pkg.mod", is_package=False)
    assert "pdserve.engine.pkg.sibling" in names and "pdserve.engine.pkg.sibling.thing" in names
    assert "pdserve.engine.typed" not in names
    assert "pdserve.engine.typed" in _imported_names(tree, "pdserve.engine.pkg.mod", False, typing_too=True)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert upward_imports({"pdserve.services.router.x": {"pdserve.services.cli.y"}, "pdserve.services.cli.y": set()}) \
        == ["pdserve.services.router.x (serving wing) -> pdserve.services.cli.y (operations wing)"]
    assert upward_imports({"pdserve.services.common.x": {"pdserve.services.workers.y"}}) != []
    assert upward_imports({"pdserve.services.cli.x": {"pdserve.services.router.y"}}) == []
    modules = {"pdserve.services.router.a": {"pdserve.services.cli.b"}, "pdserve.services.cli.c": {"pdserve.services.router.d"}}
    assert not cycles(modules)
    assert cycles(package_graph(modules)) == [["pdserve.services.cli", "pdserve.services.router"]]
    assert room_of("pdserve.engine.kv.pool") == "pdserve.engine.kv" and room_of("pdserve.services.client") == "pdserve.services.client"


if __name__ == "__main__":
    g = module_graph(typing_too=True)
    print("module cycles:", *[" <-> ".join(c) for c in cycles(g)] or ["none"], sep="\n  ")
    print("package cycles:", *[" <-> ".join(c) for c in cycles(package_graph(g))] or ["none"], sep="\n  ")
    print("upward imports:", *upward_imports(g) or ["none"], sep="\n  ")
    print("function-level imports:", *unjustified_function_level_imports() or ["none"], sep="\n  ")
    print("oversized:", *oversized_modules() or ["none"], sep="\n  ")
