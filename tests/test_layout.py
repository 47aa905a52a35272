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
