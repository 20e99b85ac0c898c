"""Fail on an import cycle among the project's modules.

``python scripts/check_imports.py [--deferred] [ROOT]`` reads every module of the packages
``hvd_compress`` and ``ps_server`` under ``ROOT`` (default: the repository) without
importing them, and prints each cycle of module-level imports it finds, one per line
(``a -> b -> a``); the exit status is 1 if there is one, else 0.

What counts as an import: ``import x`` and ``from x import y`` (absolute or relative,
``y`` taken as the submodule ``x.y`` where that module exists) executed when the module
is imported: at module level, in class bodies and in ``if``/``try``/``with`` blocks, but
not in function bodies (run later, on call) and not under ``if TYPE_CHECKING:`` (never
run). ``--deferred`` counts the imports in function bodies too: a cycle closed only by
such an import does not fail at import time, but it still ties the modules together. Only
imports of the checked packages' own modules count.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

PACKAGES = ("hvd_compress", "ps_server")
Graph = dict[str, set[str]]


def module_files(root: Path, packages: Sequence[str] = PACKAGES) -> dict[str, Path]:
    """Every ``.py`` file of ``packages`` under ``root``, by dotted module name."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` test is ``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time_nodes(body: Sequence[ast.stmt], deferred: bool = False
                      ) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``body`` that run when the module is imported, and with
    ``deferred`` also those in function bodies (run when the function is called)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if deferred:
                yield from import_time_nodes(node.body, deferred)
        elif isinstance(node, ast.If) and _type_checking(node.test):
            yield from import_time_nodes(node.orelse, deferred)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    stmts = [c for c in children if isinstance(c, ast.stmt)]
                    for child in children:  # except handlers and match cases hold bodies
                        if isinstance(child, (ast.ExceptHandler, ast.match_case)):
                            stmts.extend(child.body)
                    yield from import_time_nodes(stmts, deferred)


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:max(keep, 0)])
    return f"{base}.{node.module}" if node.module else base


def imports_of(module: str, path: Path, known: Mapping[str, Path],
               deferred: bool = False) -> set[str]:
    """The checked modules that ``module`` (read from ``path``) imports at import time (and
    with ``deferred`` in its functions too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in import_time_nodes(tree.body, deferred):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
            continue
        base = _base(module, is_package, node)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in known:
                found.add(submodule)
            elif base in known:
                found.add(base)
    return found


def import_graph(root: Path, packages: Sequence[str] = PACKAGES,
                 deferred: bool = False) -> Graph:
    """Each module's import-time imports of the checked modules (``deferred``: also the
    imports in its functions)."""
    known = module_files(root, packages)
    return {name: imports_of(name, path, known, deferred) for name, path in known.items()}


def _components(graph: Graph) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
                found.append(sorted(component))
    return found


def _shortest_cycle(graph: Graph, members: set[str]) -> list[str]:
    """A shortest cycle through the first member of a component, as a closed path."""
    start = min(members)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else \
                        [start, start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(members)}")


def find_cycles(graph: Graph) -> list[list[str]]:
    """One cycle (a closed path ``[a, b, ..., a]``) per group of modules that import each
    other, sorted; empty when the imports form no cycle."""
    cycles = [_shortest_cycle(graph, set(c)) for c in _components(graph)
              if len(c) > 1 or c[0] in graph[c[0]]]
    return sorted(cycles)


def describe(cycle: Sequence[str]) -> str:
    return " -> ".join(cycle)


def main(argv: Sequence[str]) -> int:
    deferred = "--deferred" in argv
    paths = [a for a in argv if a != "--deferred"]
    root = Path(paths[0]) if paths else Path(__file__).resolve().parent.parent
    cycles = find_cycles(import_graph(root, deferred=deferred))
    scope = " (counting imports in functions)" if deferred else ""
    for cycle in cycles:
        print(f"import cycle{scope}: {describe(cycle)}")
    if not cycles:
        print(f"no import cycles{scope} among {', '.join(PACKAGES)}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
