"""The compute buffers' cache by content (fitter.llama.context._BY_CONTENT): the quants of one model (a new
header, spec and details each) share one replay when the graph never read the weights' types, replay again
when it did (weights left on the CPU next to a GPU are copied, so their types size the copies), and what the
cache serves always equals a replay from scratch."""

from __future__ import annotations

import pytest

from fitter.cache import CACHES
from fitter.fit.quant_fit import quantized_header
from fitter.fit.quants import predict_quant
from fitter.llama import context as C
from fitter.llama.cparams import Frontend, RunConfig, resolve_context
from fitter.llama.graph_details import graph_details
from fitter.llama.model import load_model_spec, model_spec_from_header, requantized_spec
from tests.synth import build

FTYPES = ("Q4_K_M", "Q8_0", "Q2_K", "Q6_K", "BF16")


def _fresh(spec, cp, backend, ngl, details):
    CACHES.clear("compute", "traced")
    return C.compute_buffers(spec, cp, backend, ngl, details=details)


@pytest.mark.parametrize(("arch", "backend", "ngl", "shared"), [
    ("qwen35moe", "metal", -1, True),
    ("qwen35moe", "cuda", -1, True),
    ("gpt-oss", "cuda", -1, True),
    ("qwen35moe", "cpu", -1, True),
    ("qwen35moe", "cuda", 2, False),  # layers 0.. on the CPU: their weights are copied for the GPU's ops
])
def test_quants_share_a_replay_only_when_types_are_unread(arch: str, backend: str, ngl: int, shared: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    header, spec = load_model_spec(str(build(arch)))
    cp = resolve_context(spec, RunConfig(n_ctx=4096, n_ubatch=512, n_gpu_layers=ngl), Frontend.SERVER)
    quants = []
    for ftype in FTYPES:
        qh = quantized_header(header, predict_quant(header, ftype))
        quants.append((model_spec_from_header(qh), graph_details(qh)))
    want = [_fresh(s, cp, backend, ngl, d) for s, d in quants]
    if shared:  # the types were never read: every quant has the same buffers
        assert all(w == want[0] for w in want)

    CACHES.clear("compute", "traced")
    replays = []
    real = C._allocated
    monkeypatch.setattr(C, "_allocated", lambda *a, **k: replays.append(1) or real(*a, **k))
    got = [C.compute_buffers(s, cp, backend, ngl, details=d) for s, d in quants]
    assert got == want
    assert len(replays) == (1 if shared else len(FTYPES))


def test_the_whole_context_keys_it() -> None:
    """Two contexts that differ in any field are two entries (the key is the whole ContextParams)."""
    header, spec = load_model_spec(str(build("qwen3")))
    d = graph_details(header)
    a = resolve_context(spec, RunConfig(n_ctx=4096, n_ubatch=512), Frontend.SERVER)
    for field, value in (("n_ctx", 8192), ("n_ubatch", 256), ("type_k", "q8_0"), ("flash_attn", not a.flash_attn)):
        b = a.model_copy(update={field: value})
        assert C.compute_buffers(spec, b, "cpu", details=d) == _fresh(spec, b, "cpu", -1, d)
        assert C._cp_key(a) != C._cp_key(b)
    assert C._cp_key(a) == C._cp_key(a.model_copy(update={"defaults_applied": {}}))


@pytest.mark.parametrize("backend", ["cpu", "metal", "cuda"])
@pytest.mark.parametrize("arch", ["qwen35moe", "gemma4", "deepseek2"])
def test_the_fields_left_out_of_the_key_do_not_reach_the_graph(arch: str, backend: str) -> None:
    """The ModelSpec fields the content key leaves out (the file's facts) can be anything: the same buffers."""
    header, spec = load_model_spec(str(build(arch)))
    d = graph_details(header)
    cp = resolve_context(spec, RunConfig(n_ctx=4096, n_ubatch=512), Frontend.SERVER)
    other = spec.model_copy(update={
        "name": "x", "file_type": (spec.file_type or 0) + 100, "file_type_name": "x", "file_size": 1, "header_size": 1,
        "tensor_bytes": 1,
        "n_tensors": 1, "n_params": 1, "bytes_by_type": {"Q2_K": 1}, "params_by_type": {"Q2_K": 1},
    })
    assert set(C._NOT_GRAPH_SPEC) == {k for k in type(spec).model_fields if getattr(other, k) != getattr(spec, k)}
    assert _fresh(other, cp, backend, -1, d) == _fresh(spec, cp, backend, -1, d)


def test_a_quant_s_content_key_is_its_model_s_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """requantized_spec's copy and graph_details' share hold the model's very objects in every keyed field: their
    content key is the model's, without a repr made again; any keyed field that differs makes its own key."""
    def fresh_key(obj) -> str:
        CACHES.clear("content-keys")
        return C._content_key(obj)

    header, spec = load_model_spec(str(build("qwen35moe")))
    d = graph_details(header)
    qh = quantized_header(header, predict_quant(header, "Q4_K_M"))
    qs, qd = requantized_spec(spec, qh), graph_details(qh)
    assert qd.layer_types != d.layer_types and qd.layer_tensors is d.layer_tensors
    reprs: list[int] = []
    for base, quant in ((spec, qs), (d, qd)):
        want = fresh_key(quant)
        assert fresh_key(base) == want
        monkeypatch.setattr(C, "repr", lambda v: reprs.append(1) or repr(v), raising=False)
        assert C._content_key(quant) == want and not reprs  # (base keyed last)
        monkeypatch.undo()
    other = graph_details(load_model_spec(str(build("qwen3")))[0])
    C._content_key(d)
    assert C._content_key(other) == fresh_key(other) != fresh_key(d)
    wider = spec.model_copy(update={"n_embd": spec.n_embd * 2})
    C._content_key(spec)
    assert C._content_key(wider) == fresh_key(wider) != fresh_key(spec)
