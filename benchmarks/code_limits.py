"""Print the functions over 60 lines and the modules over 500 lines (`python3 benchmarks/code_limits.py [PATH ...]`;
exit 1 if any).

PATHs are files or folders, relative to the repository root (default: fitter, search and cli*.py). A function
counts from its `def` to its last line, nested functions included; one that mirrors a longer llama.cpp function
may say so in a `# long because <llama.cpp function>` comment (on the line above its `def`, or from the `def` to its
first statement) and is then not counted.
tests/test_layout.py runs it over fitter/ and search/.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
LONG_BECAUSE = "# long because"


def python_files(paths: list[str]) -> list[Path]:
    """The .py files named or under the folders named, sorted."""
    files: set[Path] = set()
    for name in paths:
        path = ROOT / name
        files.update(path.rglob("*.py") if path.is_dir() else [path] if path.suffix == ".py" else [])
    return sorted(files)


def offenders(path: Path) -> list[str]:
    """'path:line name: N lines' for each function over the limit, and the module itself if it is."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    where = path.relative_to(ROOT).as_posix()
    found = [f"{where}: module of {len(lines)} lines"] if len(lines) > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        length = node.end_lineno - node.lineno + 1
        head = lines[max(node.lineno - 2, 0): node.body[0].lineno]  # the line above the def .. the first statement
        if length > MAX_FUNCTION_LINES and not any(LONG_BECAUSE in line for line in head):
            found.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    return found


def check(paths: list[str]) -> list[str]:
    return [o for path in python_files(paths) for o in offenders(path)]


def main(argv: list[str]) -> int:
    paths = argv or ["fitter", "search", *sorted(p.name for p in ROOT.glob("cli*.py"))]
    found = check(paths)
    print("\n".join(found) if found else f"no function over {MAX_FUNCTION_LINES} lines, no module over {MAX_MODULE_LINES}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
