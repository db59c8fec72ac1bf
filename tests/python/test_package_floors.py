"""The Python package has floors (issue 20): no module of ``dwgraph`` imports, directly or
through others, a module that imports it back, and no module imports another of the
package inside a function (the usual way to hide such a cycle). Read from the sources
with ``ast``, so a cycle is found whether or not the code path runs."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "bindings" / "python" / "dwgraph"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path, modules: Set[str]):
    """(top-level imports, imports inside functions) of the package's own modules."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    top: Set[str] = set()
    nested: List[str] = []

    def resolve(node) -> List[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name in modules]
        base = package
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = node.module if node.level == 0 else (f"{base}.{node.module}" if node.module else base)
        out = []
        for a in node.names:
            if f"{target}.{a.name}" in modules:
                out.append(f"{target}.{a.name}")
            elif target in modules:
                out.append(target)
        return out

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            func = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found = [m for m in resolve(child) if m != name]
                (nested.extend(found) if in_function else top.update(found))
            visit(child, in_function or func)

    visit(tree, False)
    return top, nested


def _graph():
    paths = sorted(p for p in PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    edges: Dict[str, Set[str]] = {}
    nested: Dict[str, List[str]] = {}
    for p in paths:
        name = _module_name(p)
        top, inner = _imports(p, modules)
        edges[name] = {m for m in top if m != "dwgraph"}  # the package root re-exports; it is no floor
        if inner:
            nested[name] = inner
    return edges, nested


def test_no_import_cycles_among_the_package_modules():
    edges, _ = _graph()
    cycles = []

    def dfs(node, stack, on_stack, done):
        on_stack.add(node)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt in on_stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                dfs(nxt, stack, on_stack, done)
        stack.pop()
        on_stack.discard(node)
        done.add(node)

    done: Set[str] = set()
    for m in sorted(edges):
        if m not in done and m != "dwgraph":
            dfs(m, [], set(), done)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_package_imports_hidden_in_functions():
    _, nested = _graph()
    assert not nested, f"imports of the package's own modules inside functions: {nested}"


def test_the_floors_are_as_documented():
    # The lowest floors import nothing of the package above them.
    edges, _ = _graph()
    assert edges["dwgraph.errors"] == set()
    assert edges["dwgraph._watch"] <= {"dwgraph._C", "dwgraph.errors"}
    assert "dwgraph.graphed" not in edges["dwgraph.step"] and "dwgraph.step" not in edges["dwgraph.graphed"]
    assert not any(m.startswith("dwgraph.distributed") for m in edges["dwgraph.nn"] | edges["dwgraph.graphed"])
