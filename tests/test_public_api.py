"""fitter's package is plain: `import fitter` loads only its errors, and callers import each name from the module
that defines it (`from fitter.fit.memory import predict`), never `fitter.<name>` from the package."""

import ast
import subprocess
import sys
from pathlib import Path

import fitter

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_exports_only_its_error_and_nothing_lazily():
    assert fitter.__all__ == ["GGFitError"] and fitter.GGFitError.__module__ == "fitter.errors"
    tree = ast.parse(Path(fitter.__file__).read_text())
    assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.If))]  # no __getattr__, no TYPE_CHECKING


def test_import_fitter_loads_no_pydantic():
    # the llama.cpp child processes run `python -m fitter...`: the package itself must not load the model
    code = "import sys, fitter, fitter.errors; print('pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_no_caller_takes_a_name_from_the_package():
    """`from fitter import X` and `fitter.X` (X neither a submodule nor in fitter.__all__) name the package, not X's
    module: the import edge that tools read (benchmarks/import_cycles.py, mypy) is lost."""

    def allowed(name: str) -> bool:
        return (name in fitter.__all__ or name.startswith("__") or (ROOT / "fitter" / name).is_dir()
                or (ROOT / "fitter" / f"{name}.py").is_file())

    found = []
    for path in sorted(ROOT.glob("*.py")) + sorted(p for d in ("fitter", "search", "benchmarks", "tests")
                                                      for p in (ROOT / d).rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom) and n.module == "fitter" and n.level == 0:
                bad = [a.name for a in n.names if not allowed(a.name)]
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "fitter":
                bad = [] if allowed(n.attr) else [n.attr]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{n.lineno} {name}" for name in bad]
    assert found == []
