"""ggfit's compute graph against llama.cpp's, node by node (recorded by benchmarks/eras/graph_nodes.py).

Metal reorders each split before ggml-alloc sizes it (fitter.ggml.backends.metal.common), so a Metal prediction
needs the graph itself right, not only its tensors' sizes and lifetimes: the same ops in the same order, views
included, each node used as often (the fusion checks read the use counts). llama.cpp's own list
(GGML_SCHED_DEBUG=2: ggml_backend_sched_print_assignments) is compared with the graph ggfit hands to Metal's
graph_optimize, for the pinned build and for 0.3.23 (which computes the gated delta net's L2 norm as one node and
picks qwen35's output rows in the last layer).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.cache import CACHES
from fitter.ggml.backends.metal import common as metal_common
from fitter.ggml.tensor import VIEW_OPS, Tensor
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from fitter.llama_builds import resolve_build

ROOT = Path(__file__).resolve().parents[2]
RECORDS = {r: json.loads((ROOT / f"benchmarks/results/graph-nodes-{r}.json").read_text()) for r in ("0.3.36", "0.3.23")}
CASES = [(r, m) for r, d in RECORDS.items() for m, e in d["models"].items() if e["ok"]]
_TYPES = {1: "f16", 8: "q8_0"}


def _desc(t: Tensor) -> str:  # ggml_op_desc, as printed (%10.10s)
    return t.op[:10]


def _same_op(printed: str, t: Tensor) -> bool:
    if t.op == "UNARY":
        return printed in ("SILU", "SIGMOID", "SOFTPLUS", "GELU", "GELU_ERF", "GELU_QUICK", "TANH", "EXP", "NEG", "RELU",
                           "ABS", "SGN", "STEP", "ELU", "HARDSIGMOI", "HARDSWISH", "EXPM1", "XIELU")
    if t.op == "GLU":
        return "GLU" in printed
    return printed == _desc(t)


def _ggfit_graph(release: str, model: str, monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """The target's graph as ggfit hands it to Metal's graph_optimize: placed, split, the inputs' copies in, not yet
    reordered."""
    from tests.synth import build

    e = RECORDS[release]["models"][model]
    header, spec = load_model_spec(str(build(e["builder"], **e["overrides"])))
    c = RECORDS[release]["context"]
    kv = _TYPES[e.get("type_kv", c["type_k"])]
    cfg = RunConfig(n_ctx=c["n_ctx"], n_batch=c["n_batch"], n_ubatch=c["n_ubatch"], n_parallel=c["n_seq_max"],
                    flash_attn=c["flash_attn"], type_k=kv, type_v=kv)
    seen: list[list[Tensor]] = []
    inner = metal_common.graph_optimize

    def capture(nodes: list[Tensor], *args: object) -> list[Tensor]:
        seen.append(list(nodes))
        return inner(nodes, *args)  # type: ignore[arg-type]

    monkeypatch.setattr("fitter.ggml.backends.metal.backend.metal_graph_optimize", capture)
    # the whole graph, as llama.cpp prints it (not the chunks of fitter.ggml.backends.metal.segments)
    monkeypatch.setattr("fitter.ggml.backends.metal.backend.optimize_segments", lambda *args: None)
    CACHES.clear("compute", "traced")  # built again, so that it is captured
    from fitter.fit.memory import predict

    predict(header, spec, cfg, Backend.METAL, Frontend.LIBRARY, build=resolve_build(release), calibrated=False)
    assert seen, "Metal's graph_optimize was not called"
    return seen[0]


@pytest.mark.parametrize("release, model", CASES)
def test_the_graph_is_llama_cpps_node_for_node(release: str, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    e = RECORDS[release]["models"][model]
    printed = {i: (op, name, uses) for i, op, name, uses in e["nodes"]}
    placed = _ggfit_graph(release, model, monkeypatch)
    uses = metal_common.graph_uses(placed)
    nodes = [t for t in placed if t.sid >= 0]  # the scheduler's input copies are graph_copy's, not the graph's
    assert len(nodes) == e["n_nodes"]
    for i, t in enumerate(nodes):
        if t.op in VIEW_OPS:
            assert i not in printed, (i, t.name, printed.get(i))  # views are not printed
            continue
        op, name, n = printed[i]
        assert _same_op(op, t), (i, t.op, t.name, op, name)
        assert uses.get(id(t), 0) == n, (i, t.op, t.name, op, name, n)
