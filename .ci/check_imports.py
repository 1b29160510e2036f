#!/usr/bin/env python3
"""Fail on any import circle among the project's modules, and on a Python import in the C layer.

Every `import` and `from ... import` statement counts, wherever it stands: at the top of a
module, inside a function, under `if TYPE_CHECKING:`. An import inside a function hides a
circle from Python at import time, not from the design: a circle is a missing layer, so the
shared piece moves below both modules, or the two become one.

A module is a node; `import a.b` and `from a import b` (when `a.b` is a module) are edges to
`a.b`, and `from a.b import name` is an edge to `a.b`. Importing a submodule does not count as
an edge to its package's `__init__` (which Python runs first), as import-linter counts it too:
otherwise every package that re-exports its submodules would be one circle. A strongly connected
component of more than one module is a circle; the script prints each with one cycle through it.

The layers between packages (the C core, `cncore`, the front ends) are import-linter's contracts
in pyproject.toml; this script adds the one thing import-linter cannot see: the Cython sources
in cython_src/ import none of our Python packages (only the standard library and NumPy).

Usage: python .ci/check_imports.py   (from anywhere; exit status 1 when a circle is found)
"""
from __future__ import annotations

import ast
import itertools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top-level package name -> its directory under the root (setup.cfg's package_dir).
PACKAGES = {
    "cncore": "cncore",
    "cncore_torch": "frontends/cncore_torch",
    "cncore_numpy": "frontends/cncore_numpy",
    "cncore_jax": "frontends/cncore_jax",
    "cn_dlrm": "frontends/cn_dlrm",
}


def module_files(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's __init__)."""
    modules = {}
    for top, relative in PACKAGES.items():
        directory = root / relative
        if not directory.is_dir():
            continue
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join((top, *parts))] = (path, is_package)
    # The compiled core's modules (cncore._core): nodes without Python imports to follow.
    for path in sorted((root / "cython_src" / "cncore").glob("*.pyx")):
        modules[f"cncore.{path.stem}"] = (path, False)
    return modules


def _known(name: str, modules) -> str | None:
    """The module of ours that `import name` loads last: name itself, else its longest module prefix."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(tree: ast.AST, module: str, is_package: bool, modules) -> dict[str, int]:
    """{module of ours: line of its first import} for every import anywhere in the tree.

    `import a.b` and `from a import b` (a.b a module) count as importing a.b; `from a import name`
    (a plain name) as importing a."""
    package = module if is_package else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_known(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                full = f"{prefix}.{alias.name}"
                targets.append(full if full in modules else _known(prefix, modules))
        else:
            continue
        for target in targets:
            if target is not None and target != module and (target not in found or node.lineno < found[target]):
                found[target] = node.lineno
    return found


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, int]]:
    """module -> {module of ours it imports: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in modules.items():
        if path.suffix == ".pyx":
            graph[module] = {}
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[module] = imports_of(tree, module, is_package, modules)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
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


def one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first), as a path."""
    members = set(component)
    start = component[0]
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while (up := parent[path[-1]]) is not None:
                    path.append(up)
                return [*reversed(path), start]
            if child in members and child not in parent:
                parent[child] = node
                queue.append(child)
    return component


_PY_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w.]+))")


def core_python_imports(root: Path) -> list[str]:
    """Lines of cython_src/ that import one of our Python packages (cimports are C-level)."""
    bad = []
    for path in sorted((root / "cython_src").rglob("*.p[yx][xid]")):
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = _PY_IMPORT.match(text)
            name = match and (match.group(1) or match.group(2))
            if name and name.split(".")[0] in PACKAGES:
                bad.append(f"{path.relative_to(root)}:{number}: {text.strip()}")
    return bad


def main(root: Path = ROOT) -> int:
    modules = module_files(root)
    graph = import_graph(modules)
    components = strongly_connected(graph)
    for component in components:
        cycle = one_cycle(graph, component)
        print(f"import circle among {len(component)} modules: {', '.join(component)}")
        print("  one cycle:")
        for a, b in itertools.pairwise(cycle):
            print(f"    {a} -> {b}   ({modules[a][0].relative_to(root)}:{graph[a][b]})")
        print("  every import inside it:")
        for a in component:
            for b in sorted(set(graph[a]) & set(component)):
                print(f"    {a} -> {b}   ({modules[a][0].relative_to(root)}:{graph[a][b]})")
    core = core_python_imports(root)
    for line in core:
        print(f"the C layer imports a package of ours: {line}")
    n_edges = sum(len(e) for e in graph.values())
    if components or core:
        print(f"{len(components)} import circle(s), {len(core)} Python import(s) of ours in cython_src/ "
              f"({len(modules)} modules, {n_edges} imports between them)")
        return 1
    print(f"no import circle ({len(modules)} modules, {n_edges} imports between them); "
          "cython_src/ imports none of ours")
    return 0


if __name__ == "__main__":
    sys.exit(main())
