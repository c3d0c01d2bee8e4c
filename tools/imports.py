#!/usr/bin/env python3
"""The import graph of kugetsu (and tools/), read with the standard library's ast only.

Prints each module with its line count, the import cycles (an import inside a function is
"lazy": it runs only when called, so a cycle through one works today but hides a layering
mistake; both kinds are counted), and the longest functions. Used to show the layout before
and after a move (issue 26): `python tools/imports.py [--top N]`.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts).replace("-", "_")


def sources() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "kugetsu").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py")):
        found[module_name(path)] = path
    return found


def resolve(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    """The absolute name an ImportFrom's module part refers to."""
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(mod: str, path: Path, known: set[str]) -> dict[str, bool]:
    """The known modules `mod` imports -> whether every such import is lazy (inside a def)."""
    tree = ast.parse(path.read_text(), str(path))
    out: dict[str, bool] = {}

    def add(target: str, lazy: bool) -> None:
        # A script under tools/ imports its siblings by their bare name (`from run import ...`).
        sibling = f"{mod.rpartition('.')[0]}.{target}"
        if mod.startswith("tools.") and target.partition(".")[0] not in known and sibling in known:
            target = sibling
        # The longest known prefix: `import kugetsu.store.postgres` names the module itself.
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != mod:
            out[target] = out.get(target, True) and lazy

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, lazy)
            elif isinstance(child, ast.ImportFrom):
                if isinstance(child, ast.ImportFrom) and child.module == "__future__":
                    continue
                base = resolve(mod, child, path.name == "__init__.py")
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    add(full if full in known else base, lazy)
            elif isinstance(child, ast.If) and _type_checking(child.test):
                continue  # only for the type checker: never runs
            visit(child, inner)

    visit(tree, False)
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def functions(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((child.end_lineno - child.lineno + 1, name))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15, help="how many longest modules/functions")
    parser.add_argument("--modules", action="store_true", help="list every module")
    args = parser.parse_args()
    found = sources()
    known = set(found)
    graph = {mod: edges(mod, path, known) for mod, path in found.items()}
    lines = {mod: len(path.read_text().splitlines()) for mod, path in found.items()}
    kug = [m for m in found if m.startswith("kugetsu")]
    print(f"modules: {len(kug)} in kugetsu ({sum(lines[m] for m in kug)} lines), "
          f"{len(found) - len(kug)} in tools")
    if args.modules:
        for mod in sorted(kug):
            print(f"  {lines[mod]:5d}  {mod}")
    comps = cycles(graph)
    print(f"import cycles: {len(comps)}")
    for comp in comps:
        members = set(comp)
        links = [f"{a} -> {b}{' (lazy)' if graph[a][b] else ''}"
                 for a in comp for b in sorted(graph[a]) if b in members]
        print(f"  {' , '.join(comp)}")
        for link in links:
            print(f"      {link}")
    print(f"longest modules (top {args.top}):")
    for mod in sorted(kug, key=lambda m: -lines[m])[: args.top]:
        print(f"  {lines[mod]:5d}  {mod}")
    funcs = [(n, f"{mod}.{name}") for mod in kug for n, name in functions(found[mod])]
    print(f"longest functions (top {args.top}):")
    for n, name in sorted(funcs, reverse=True)[: args.top]:
        print(f"  {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
