"""The package's import graph, read from the source: no import runs up a layer, no two modules import each
other (directly or round a longer loop).

Every ``import`` and ``from ... import`` counts wherever it stands: at module level, inside a function (a
deferred import is still a dependency) and under ``if TYPE_CHECKING:`` (a type a module names is a module it
knows). ``swarmgrad/__init__.py`` exports by name strings (swarmgrad/lazy.py): those are not imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "swarmgrad"

# lowest first; a module may import its own layer and those below it
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(names.split()) for names in (
    "errors version lazy settings after_import eventloop timing hostmemory device",  # the base
    "dht",
    "net",
    "state",
    "averaging",
    "tasks",
    "peer",
    "dashboard console",
    "demo",
    "lab",
    "commands",
    "cli __main__ __init__",  # __init__: the package's own façade
))


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package by its __init__.py)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for each module of the package that ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    root = package.split(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == root:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != root:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"  # `from pkg import module` imports that module
                yield (submodule if submodule in known else source), node.lineno


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """importer -> {imported: line of its first import}, within the package."""
    known = modules(package)
    graph: dict[str, dict[str, int]] = {name: {} for name in known}
    for name, path in known.items():
        for target, line in imports(name, path, known):
            if target != name:
                graph[name].setdefault(target, line)
    return graph


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return next((rank for rank, names in enumerate(LAYERS) if top in names), None)


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """One line per import of a higher layer, or of or by a module that no layer names."""
    found = []
    for importer, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            low, high = layer_of(importer), layer_of(target)
            if low is None or high is None:
                found.append(f"{importer}:{line} -> {target} (add its folder to LAYERS)")
            elif high > low:
                found.append(f"{importer}:{line} -> {target} (layer {low} imports layer {high})")
    return found


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def cycle_edges(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each import inside a cycle, one line each."""
    return [f"{a}:{graph[a][b]} -> {b}" for component in cycles(graph)
            for a in component for b in sorted(graph[a]) if b in component]


def test_no_import_runs_up_a_layer() -> None:
    found = upward_imports(import_graph(PACKAGE))
    assert not found, "imports that run up a layer:\n" + "\n".join(found)


def test_no_modules_import_each_other() -> None:
    found = cycle_edges(import_graph(PACKAGE))
    assert not found, "imports inside a cycle:\n" + "\n".join(found)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checks catch what they are for: a deferred, a relative and a TYPE_CHECKING import."""
    package = tmp_path / "swarmgrad"
    for folder in ("dht", "peer"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "dht" / "node.py").write_text("def f():\n    from swarmgrad.peer import driver\n")
    (package / "dht" / "records.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .node import X\nfrom .. import errors\n")
    (package / "peer" / "driver.py").write_text("import swarmgrad.dht.node\n")
    graph = import_graph(package)
    assert graph["swarmgrad.dht.records"] == {"swarmgrad.dht.node": 3, "swarmgrad.errors": 4}
    assert upward_imports(graph) == ["swarmgrad.dht.node:2 -> swarmgrad.peer.driver (layer 1 imports layer 6)"]
    assert cycle_edges(graph) == ["swarmgrad.dht.node:2 -> swarmgrad.peer.driver",
                                  "swarmgrad.peer.driver:1 -> swarmgrad.dht.node"]
