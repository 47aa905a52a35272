"""The layout of fitter/: no module imports, directly or through others, a module that imports it back
(benchmarks/import_cycles.py prints the cycles; every import counts, in a function or under TYPE_CHECKING too)."""

from __future__ import annotations

from benchmarks.import_cycles import cycles, import_graph


def test_no_import_cycle_in_fitter() -> None:
    graph = import_graph()
    assert "fitter.ggml.alloc" in graph and graph["fitter.gguf.reader"]  # the walk found the modules and their imports
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_module_rebinds_a_global() -> None:
    """State a process keeps lives on objects (fitter.cache.CACHES and what it holds), never in a `global` name."""
    import ast
    from pathlib import Path

    top = Path(__file__).resolve().parents[1]
    found = [f"{p.relative_to(top)}:{n.lineno}" for d in ("fitter", "search") for p in sorted((top / d).rglob("*.py"))
             for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))) if isinstance(n, ast.Global)]
    assert found == []


def test_caches_clear_by_group() -> None:
    from fitter.cache import Caches

    caches = Caches()
    a = caches.keep({1: 2}, "compute")
    b = caches.keep({3}, "traced")
    caches.clear("compute")
    assert a == {} and b == {3} and caches.groups == ["compute", "traced"]
    a[1] = 2
    caches.clear()
    assert a == {} and b == set()


def test_the_process_caches_are_cleared_before_each_test() -> None:
    """tests/conftest.py's autouse fixture: what the fitter modules keep starts empty."""
    from fitter.cache import CACHES
    from fitter.gguf import header_cache
    from fitter.llama import context, traced_graph

    assert {"compute", "traced", "headers"} <= set(CACHES.groups)
    assert not context._CACHE and not traced_graph._TRACED and not header_cache.is_enabled()


def test_trace_state_lives_on_objects_the_fixture_resets() -> None:
    """The two flags a graph's build reads (the guards being recorded, whether to trace) are attributes of objects
    that CACHES holds, so that the tests' fixture resets them as it empties the memos."""
    from fitter.cache import CACHES
    from fitter.ggml.symbolic import RECORDING
    from fitter.llama.traced_graph import TRACING, predict_once

    with predict_once():
        assert not TRACING.on
    assert TRACING.on
    RECORDING.guards, TRACING.on = set(), False
    CACHES.clear("traced")
    assert RECORDING.guards is None and TRACING.on


# a comparison of a backend with one backend's name: Backend.METAL == ..., != "cuda", in ("metal", ...), "cuda" in b,
# or a table keyed by names: {Backend.CUDA: ..., }, {"cpu": ...}
_NAME = r"""(Backend\.(CPU|CUDA|METAL)|["'](cpu|cuda|metal)["'])"""
_NAME_TEST = rf"""(==|!=|\bis|\bin) *\(?{_NAME}|{_NAME} *(==|!=|\bin\b)|\{{ *{_NAME} *:|Backend\.(CPU|CUDA|METAL) *:"""


def test_no_backend_name_test_outside_the_backends() -> None:
    """What differs between backends is an attribute or method of their objects (fitter/ggml/backends/<name>/):
    host or device, one device, a host buffer type, -fa auto's rules, the buffer names; in fitter/ and search/."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [p for d in ("fitter", "search") for p in sorted((root / d).rglob("*.py"))]
    files += sorted(root.glob("cli*.py"))  # the command line's too
    assert root / "cli.py" in files and root / "cli_fit.py" in files
    found = [f"{p.relative_to(root)}:{i}" for p in files
             if "ggml/backends/" not in p.as_posix()
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if re.search(_NAME_TEST, line)]
    assert found == []


def test_the_name_test_pattern() -> None:
    import re

    for line in ('if backend == Backend.METAL:', 'x = "cuda" in b', 'names = {Backend.CUDA: ("CUDA",)}',
                 'move = {"cpu": ""}.get(backend)', 'if b in ("metal", "cpu"):', 'if "cpu" != backend:'):
        assert re.search(_NAME_TEST, line), line
    for line in ('backend: Backend = Backend.CPU,', 'impl = backends.get(Backend.CPU)', '"backend": "metal",'):
        assert not re.search(_NAME_TEST, line), line


def test_no_long_function_or_module() -> None:
    """No function over 60 lines (but one that says `# long because <the llama.cpp function it mirrors>`) and no
    module over 500, in fitter/, search/ and cli*.py (benchmarks/code_limits.py prints them; its paths are
    arguments)."""
    from pathlib import Path

    from benchmarks.code_limits import check

    root = Path(__file__).resolve().parents[1]
    cli = sorted(p.name for p in root.glob("cli*.py"))
    assert "cli.py" in cli
    assert check(["fitter", "search", *cli]) == []


def test_code_limits_finds_a_long_function(tmp_path, monkeypatch) -> None:
    import benchmarks.code_limits as cl

    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n\n\n# long because llama_foo\ndef mirrored():\n{body}\n")
    monkeypatch.setattr(cl, "ROOT", tmp_path)
    assert cl.check(["m.py"]) == ["m.py:1 long: 62 lines"]
