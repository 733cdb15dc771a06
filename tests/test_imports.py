"""No import cycles in pipeline/ (the layers between packages are import-linter's contracts in
pyproject.toml, checked by ``lint-imports``; tests/test_layout.py runs it).

The graph counts module- and function-level imports (an import inside a function is a cycle
waiting for the first call), not those under ``if TYPE_CHECKING:`` or
``if __name__ == "__main__":``. Run it alone to list
cycles: ``python tests/test_imports.py [pipeline]``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(root: Path, f: Path) -> str:
    parts = list(f.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    """``if TYPE_CHECKING:`` (never runs) or ``if __name__ == "__main__":`` (runs only when the
    module is the program, never when it is imported): neither block's imports are edges."""
    t = node.test
    if (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and len(t.comparators) == 1 and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value == "__main__"):
        return True
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(tree: ast.AST, mod: str, is_pkg: bool, known: set[str]) -> set[str]:
    out: set[str] = set()

    own_packages = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}

    def add(name: str) -> None:
        # Importing a.b.c runs a, a.b and a.b.c; a module's own packages are already being
        # imported when it runs, so only a name imported from one of them is an edge to it.
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            cand = ".".join(parts[:i])
            if cand in known and (cand not in own_packages or i == len(parts)):
                out.add(cand)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    add(a.name)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                add(target)
                for a in child.names:
                    add(f"{target}.{a.name}")
            visit(child)

    visit(tree)
    out.discard(mod)
    return out


def graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(root, f): f for f in root.rglob("*.py")}
    known = set(files)
    return {m: imports(ast.parse(f.read_text()), m, f.name == "__init__.py", known)
            for m, f in files.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    n = 0

    def strong(v: str) -> None:
        nonlocal n
        index[v] = low[v] = n
        n += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def _reaches(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in g.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_no_import_cycles_in_pipeline() -> None:
    found = cycles(graph(ROOT / "pipeline"))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


if __name__ == "__main__":
    g = graph(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "pipeline")
    found = cycles(g)
    for comp in found:
        print("cycle:", " <-> ".join(comp))
        for m in comp:
            print("   ", m, "->", sorted(set(g[m]) & set(comp)))
    print(f"{len(g)} modules, {len(found)} cycle(s)")
    sys.exit(1 if found else 0)
