"""Quantized K/V types that share one compute graph on Metal (fitter.llama.context._shared_kv_types).

With flash attention at 32 queries or more per stream, Metal's compute buffers are the same bytes for q4_0, q4_1,
q5_0, q5_1 and q8_0 K/V, so those contexts are computed as q8_0's. Each case here is checked against the type's own
graph, built with the rule off and the caches empty: every architecture, with and without an MTP head, several
ubatches and contexts, one and several streams. Where the rule does not apply (under 32 queries, another backend,
the cache or a layer on the CPU, two types), the type's own graph is built, and under 32 queries it differs.
"""

from __future__ import annotations

import pytest

from fitter.llama import context as C
from fitter.llama.cparams import ConfigError, Frontend, RunConfig, resolve_context
from fitter.llama.graph_details import graph_details
from fitter.llama.model import load_model_spec
from fitter.llama.weights import weight_placement
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


def _own(spec, cp, details, mtp, monkeypatch: pytest.MonkeyPatch, **opts):
    """The compute buffers of cp's own types: the rule off, no cache, no traced graph."""
    with monkeypatch.context() as m:
        m.setattr(C, "_shared_kv_types", lambda spec, cp, *a: cp)
        m.setattr(C, "_CACHE", {})
        m.setattr(C, "_BY_CONTENT", {})
        m.setattr(C, "_TRACED", {})
        m.setattr(C, "_TRACED_BY_CONTENT", {})
        return C.compute_buffers(spec, cp, "metal", details=details, mtp=mtp, **opts)


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_types_give_their_own_graph_s_bytes(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    header, spec = load_model_spec(str(build(arch, **ARCHS[arch], **({"n_nextn": 1} if arch in MTP else {}))))
    d = graph_details(header)
    shared = 0
    for n_ctx, n_ubatch, n_parallel, unified in CASES:
        for kv in SHARED:
            try:
                cp = resolve_context(spec, RunConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=4096, type_k=kv, type_v=kv,
                                                     flash_attn="on", n_parallel=n_parallel, kv_unified=unified),
                                     Frontend.SERVER)
            except ConfigError:  # a context the model refuses (more ubatch than n_ctx_train)
                continue
            impl = C.backends.get("metal").for_build(cp.build)
            assert C._shared_kv_types(spec, cp, impl, -1, None, False).type_k == "q8_0"
            for mtp in (False, True) if arch in MTP else (False,):
                got = C.compute_buffers(spec, cp, "metal", details=d, mtp=mtp)
                assert got == _own(spec, cp, d, mtp, monkeypatch), (kv, n_ctx, n_ubatch, n_parallel, unified, mtp)
                shared += 1
    assert shared


def test_the_rule_keeps_the_type_where_it_reaches_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under 32 queries per stream FLASH_ATTN_EXT's pad reads the views' own strides: q4_0 and q8_0 differ there, and
    q4_0 keeps its own graph. So it does on CUDA, with the cache or a layer on the CPU, and with two types."""
    header, spec = load_model_spec(str(build("qwen3")))
    d = graph_details(header)

    def cp_of(n_ubatch: int, kv: str = "q4_0", kv_v: str | None = None, **kw):
        return resolve_context(spec, RunConfig(**{"n_ctx": 4096, "n_ubatch": n_ubatch, "type_k": kv, "type_v": kv_v or kv,
                                                  "flash_attn": "on", "n_parallel": 1, **kw}), Frontend.SERVER)

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
