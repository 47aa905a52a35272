"""Print the import cycles among fitter/'s modules (`python3 benchmarks/import_cycles.py`; exit 1 if any).

Every `import` and `from ... import` counts, at module level or inside a function, with or without
`if TYPE_CHECKING:` around it: a cycle hidden in a function is still a cycle a reader has to untangle.
tests/test_layout.py asserts that there is none.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fitter"


def module_name(path: Path) -> str:
    """fitter/ggml/alloc.py -> fitter.ggml.alloc; fitter/ggml/__init__.py -> fitter.ggml."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    """The absolute module a (possibly relative) `from` names."""
    if level == 0:
        return target or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The fitter modules `path` imports (a `from pkg import name` counts as pkg.name when that is a module)."""
    mod = module_name(path)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(mod, is_pkg, node.level, node.module)
            names = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
        else:
            continue
        for name in names:
            # `import fitter.ggml.alloc` names the deepest module that exists
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != mod and name.split(".")[0] == PACKAGE:
                out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """fitter module -> the fitter modules it imports (importing a submodule is not an edge to its package)."""
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main() -> int:
    graph = import_graph()
    found = cycles(graph)
    for comp in found:
        members = set(comp)
        print(" <-> ".join(comp))
        for m in comp:
            print(f"    {m} -> {', '.join(sorted(graph[m] & members))}")
    print(f"{len(found)} import cycle(s) among {len(graph)} modules of {PACKAGE}/")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
