"""Quantized K/V types that share one compute graph on the CPU and Metal (fitter.llama.context._shared_kv_types).

With flash attention, the compute buffers are the same bytes for q4_0, q4_1, q5_0, q5_1 and q8_0 K/V on the CPU, and
on Metal at 32 queries or more per stream, so those contexts are computed as q8_0's. Each case here is checked
against the type's own graph, built with the rule off and the caches empty: every architecture, with and without an
MTP head, several ubatches and contexts, one and several streams. Where the rule does not apply (on Metal under 32
queries, the cache or a layer on the CPU, a tensor override; CUDA; two types), the type's own graph is built, and on
Metal under 32 queries it differs. On the CPU, llama.cpp's own dry run reserves the same compute bytes for the types.
"""

from __future__ import annotations

import pytest

from fitter.bundled import resolve_model
from fitter.cache import CACHES
from fitter.llama import context as C
from fitter.llama.cparams import ConfigError, Frontend, RunConfig, resolve_context
from fitter.llama.graph_details import graph_details
from fitter.llama.model import load_model_spec
from fitter.llama.weights import weight_placement
from fitter.oracle.check import llama_params
from fitter.oracle.llama_run import measure
from tests.synth import build

# every architecture, with heads a 32-block type divides and Metal has a flash-attention kernel for (32, 64): the
# synthetic defaults where they do
ARCHS = {"llama": {"head_dim": 64}, "qwen2": {"n_embd": 256}, "qwen3": {}, "phi3": {"n_embd": 256},
         "mistral3": {"head_dim": 64}, "gemma2": {}, "gemma3": {}, "gemma4": {}, "qwen3moe": {}, "qwen35": {},
         "qwen35moe": {}, "qwen3next": {}, "gpt-oss": {}, "deepseek2": {"qk_rope": 32}, "glm4moe": {}}
MTP = ("qwen35", "qwen35moe", "glm4moe", "deepseek2")
SHARED = ("q4_0", "q4_1", "q5_0", "q5_1")
# (n_ctx, n_ubatch, n_parallel, kv_unified): 32 queries per stream and more
CASES = ((4096, 512, 1, True), (33024, 32, 1, True), (8192, 4096, 4, True), (8192, 256, 4, False), (768, 2048, 1, True))
SMALL = ((4096, 1, 1, True), (4096, 16, 4, False))  # and fewer, on the CPU


def _own(spec, cp, details, mtp, monkeypatch: pytest.MonkeyPatch, backend: str = "metal", **opts):
    """The compute buffers of cp's own types: the rule off, no cache, no traced graph (none kept after it either: what
    it made is not what the rule gives)."""
    with monkeypatch.context() as m:
        m.setattr(C, "_shared_kv_types", lambda spec, cp, *a: cp)
        CACHES.clear("compute", "content-keys", "traced")
        try:
            return C.compute_buffers(spec, cp, backend, details=details, mtp=mtp, **opts)
        finally:
            CACHES.clear("compute", "content-keys", "traced")


@pytest.mark.parametrize("backend", ["cpu", "metal"])
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_types_give_their_own_graph_s_bytes(arch: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    header, spec = load_model_spec(str(build(arch, **ARCHS[arch], **({"n_nextn": 1} if arch in MTP else {}))))
    d = graph_details(header)
    shared = 0
    for n_ctx, n_ubatch, n_parallel, unified in CASES + (SMALL if backend == "cpu" else ()):
        for kv in SHARED:
            try:
                cp = resolve_context(spec, RunConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=4096, type_k=kv, type_v=kv,
                                                     flash_attn="on", n_parallel=n_parallel, kv_unified=unified),
                                     Frontend.SERVER)
            except ConfigError:  # a context the model refuses (more ubatch than n_ctx_train)
                continue
            impl = C.backends.get(backend).for_build(cp.build)
            assert C._shared_kv_types(spec, cp, impl, -1, None, False).type_k == "q8_0"
            for mtp in (False, True) if arch in MTP else (False,):
                got = C.compute_buffers(spec, cp, backend, details=d, mtp=mtp)
                assert got == _own(spec, cp, d, mtp, monkeypatch, backend), (kv, n_ctx, n_ubatch, n_parallel, unified,
                                                                             mtp)
                shared += 1
    assert shared


def test_the_rule_keeps_the_type_where_it_reaches_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under 32 queries per stream FLASH_ATTN_EXT's pad reads the views' own strides: q4_0 and q8_0 differ there, and
    q4_0 keeps its own graph. So it does on CUDA, with the cache or a layer on the CPU, with a tensor override, with
    two types and with f16."""
    header, spec = load_model_spec(str(build("qwen3")))
    d = graph_details(header)

    def cp_of(n_ubatch: int, kv: str = "q4_0", kv_v: str | None = None, **kw):
        fields = {"n_ctx": 4096, "n_ubatch": n_ubatch, "type_k": kv, "type_v": kv_v or kv, "flash_attn": "on",
                  "n_parallel": 1, **kw}
        return resolve_context(spec, RunConfig(**fields), Frontend.SERVER)

    metal = C.backends.get("metal").for_build(cp_of(512).build)
    cuda = C.backends.get("cuda").for_build(cp_of(512).build)
    keeps = [
        (cp_of(31), metal, -1, None, False),  # 31 queries
        (cp_of(64, n_parallel=4, kv_unified=False), metal, -1, None, False),  # 16 per stream
        (cp_of(512), cuda, -1, None, False),
        (cp_of(512), metal, -1, None, True),  # -nkvo
        (cp_of(512), metal, 2, None, False),  # -ngl 2
        (cp_of(512), metal, -1, weight_placement(len(spec.layers), metal.kind, -1,
                                                 overrides=[("ffn_.*", "CPU")]), False),  # -ot ffn_.*=CPU
        (cp_of(512, "q8_0", "q4_0"), metal, -1, None, False),
        (cp_of(512, "f16"), metal, -1, None, False),
    ]
    for cp, impl, ngl, placement, kv_host in keeps:
        assert C._shared_kv_types(spec, cp, impl, ngl, placement, kv_host) is cp, (cp.n_ubatch, impl.kind, ngl, kv_host)
    assert C._shared_kv_types(spec, cp_of(32), metal, -1, None, False).type_k == "q8_0"
    small = [C.compute_buffers(spec, cp_of(16, kv), "metal", details=d) for kv in ("q4_0", "q8_0")]
    assert small[0] != small[1]
    assert small[0] == _own(spec, cp_of(16), d, False, monkeypatch)


@pytest.mark.parametrize("model", ["gemma3-270m", "qwen35moe"])
def test_llama_cpp_reserves_the_same_compute_bytes_for_the_shared_types(model: str) -> None:
    """llama.cpp's own dry run on the CPU: one compute buffer for all five types, at 16 and at 512 tokens, and it is
    what ggfit predicts (as q8_0's)."""
    path = resolve_model(model) if model == "gemma3-270m" else str(build(model))
    header, spec = load_model_spec(path)
    d = graph_details(header)
    for n_ubatch in (16, 512):
        got = set()
        for kv in ("q8_0", "q4_0", "q5_1"):
            cfg = RunConfig(n_ctx=8192, n_ubatch=n_ubatch, type_k=kv, type_v=kv, flash_attn="on", n_parallel=1)
            cp = resolve_context(spec, cfg, Frontend.LIBRARY)
            ref = measure(path, llama_params(cp, cfg), mode="dry", log_level="info").raise_for_status()
            pred = C.compute_buffers(spec, cp, "cpu", details=d)
            assert [b.bytes for b in pred] == [ref.breakdown_total("compute")], (kv, n_ubatch)
            got.add(pred[0].bytes)
        assert len(got) == 1, (n_ubatch, got)
