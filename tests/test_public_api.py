"""fitter's public surface: every name in fitter.__all__ resolves, and `import fitter` stays light."""

import subprocess
import sys
import types

import fitter


def test_every_public_name_resolves():
    for name in fitter.__all__:
        assert getattr(fitter, name) is not None, name
    assert isinstance(fitter.fit.calibration, types.ModuleType)
    from fitter import RunConfig, predict  # noqa: F401


def test_unknown_name_is_an_attribute_error():
    try:
        fitter.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("fitter.no_such_name resolved")


def test_import_fitter_loads_no_pydantic():
    # the llama.cpp child processes run `python -m fitter...`: the package itself must not load the model
    code = "import sys, fitter, fitter.errors; print('pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=fitter.__path__[0] + "/..")
    assert out.stdout.strip() == "False"


def test_all_and_the_type_checking_imports_name_the_same_exports():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(fitter.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    typed = {a.asname or a.name for n in block.body for a in n.names}
    assert sorted(fitter.__all__) == sorted(fitter._EXPORTS) == sorted(typed)
