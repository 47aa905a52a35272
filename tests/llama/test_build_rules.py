"""Context rules of older llama.cpp builds that the recorded CPU grid (tests/fit/test_eras_recorded.py) does not reach:
n_ctx not a multiple of 256, -np above 64, -fa auto before it existed, MTP before its context type, CLAMP in place.
Each figure is the era's source formula (cited beside the rule in fitter.llama)."""

from __future__ import annotations

from functools import lru_cache

import pytest

from fitter.errors import UnsupportedModelError
from fitter.ggml.alloc import Gallocr
from fitter.ggml.tensor import inp
from fitter.llama import context as compute
from fitter.llama.cparams import ConfigError, Frontend, RunConfig, resolve_context
from fitter.llama.graph import GraphContext
from fitter.llama.graph_details import graph_details
from fitter.llama.kv_cache import memory_caches
from fitter.llama.model import load_model_spec
from fitter.llama.models import default_details
from fitter.llama_builds import PINNED, resolve_build
from tests.synth import build as synth
from tests.synth.shapes import build_shape

OLD = resolve_build("0.3.16")  # llama.cpp 4227c9b, 2025-08-14


@lru_cache(maxsize=None)
def _spec(arch: str):
    return load_model_spec(str(synth(arch)))[1]


def test_kv_padding_before_17046():
    spec = _spec("llama")
    lib = dict(n_ubatch=512, n_parallel=1, kv_unified=False, swa_full=True)
    # 0.3.16 llama_model::create_memory: the cache padded to 32 cells without flash attention, 256 with it
    assert resolve_context(spec, RunConfig(n_ctx=5000, flash_attn="off", **lib), Frontend.LIBRARY, build=OLD).n_ctx_seq == 5024
    assert resolve_context(spec, RunConfig(n_ctx=5000, flash_attn="on", **lib), Frontend.LIBRARY, build=OLD).n_ctx_seq == 5120
    # since #17046: n_ctx padded to 256 in llama_context, FA or not
    assert resolve_context(spec, RunConfig(n_ctx=5000, flash_attn="off", **lib), Frontend.LIBRARY).n_ctx_seq == 5120
    # 4 streams: ceil(5000 / 4) = 1250 -> 1280 cells each (0.3.16); 5120 / 4 = 1280 -> 1280 (pinned)
    four = dict(n_ubatch=512, n_parallel=4, kv_unified=False, swa_full=True, n_ctx=5000, flash_attn="off")
    cp = resolve_context(spec, RunConfig(**four), Frontend.LIBRARY, build=OLD)
    assert (cp.n_ctx_seq, cp.n_ctx) == (1280, 5120)
    kv = memory_caches(spec, cp)[0]
    assert (kv.cells, kv.n_stream) == (1280, 4)


def test_swa_cells_before_17046():
    spec = _spec("gpt-oss")  # n_swa 128 in the synthetic file
    server = dict(n_ctx=4096, n_ubatch=512, n_parallel=4, kv_unified=True, swa_full=False)
    old = resolve_context(spec, RunConfig(flash_attn="off", **server), Frontend.SERVER, build=OLD)
    swa = [c for c in memory_caches(spec, old) if c.name == "kv_swa"][0]
    # min(size_base, GGML_PAD(n_swa * n_seq_max + n_ubatch, 32)) (0.3.16 llama_kv_cache_unified_iswa)
    assert swa.cells == min(4096, -(-(spec.n_swa * 4 + 512) // 32) * 32)
    pinned = resolve_context(spec, RunConfig(flash_attn="off", **server), Frontend.SERVER)
    assert [c for c in memory_caches(spec, pinned) if c.name == "kv_swa"][0].cells == -(-(spec.n_swa * 4 + 512) // 256) * 256


def test_max_seq_64_before_15916():
    spec = _spec("llama")
    cfg = RunConfig(n_ctx=65536, n_parallel=100, kv_unified=True)
    with pytest.raises(ConfigError, match="n_seq_max must be <= 64"):
        resolve_context(spec, cfg, Frontend.SERVER, build=OLD)
    assert resolve_context(spec, cfg, Frontend.SERVER).n_seq_max == 100


def test_fa_auto_before_it_existed_is_off():
    spec = _spec("llama")
    cfg = RunConfig(n_ctx=4096, flash_attn="auto")
    assert resolve_context(spec, cfg, Frontend.LIBRARY, build=OLD).flash_attn is False
    assert resolve_context(spec, cfg, Frontend.LIBRARY).flash_attn is True
    # and a quantized V cache is then refused, as 0.3.16's llama_init_from_model refused it without -fa
    with pytest.raises(ConfigError, match="quantized V cache"):
        resolve_context(spec, RunConfig(n_ctx=4096, type_k="q8_0", type_v="q8_0"), Frontend.LIBRARY, build=OLD)


def test_mtp_needs_its_context_type():
    spec = _spec("qwen35")
    cfg = RunConfig(n_ctx=4096, spec_type="draft-mtp")
    with pytest.raises(ConfigError, match="no MTP draft context"):
        resolve_context(spec, cfg, Frontend.SERVER, build=resolve_build("0.3.23"))


def test_unknown_architecture_names_the_build():
    # gemma4 came with PR #21309 (2026-04-02); 0.3.17's llama.cpp (2026-03-22) refused the file as unknown
    with pytest.raises(UnsupportedModelError, match=r"llama\.cpp 49bfddeca 2026-03-22 does not know architecture gemma4"):
        resolve_context(_spec("gemma4"), RunConfig(n_ctx=4096), Frontend.SERVER, build=resolve_build("0.3.17"))
    resolve_context(_spec("gemma4"), RunConfig(n_ctx=4096), Frontend.SERVER, build=resolve_build("0.3.20"))


def test_clamp_in_place_only_since_0_3_36():
    spec = _spec("qwen3moe")  # build_moe_ffn normalizes the expert weights: sum_rows -> clamp -> div
    for b, inplace in ((PINNED, True), (resolve_build("0.3.35"), False)):
        cp = resolve_context(spec, RunConfig(n_ctx=4096), Frontend.LIBRARY, build=b)
        c = GraphContext(spec, cp, default_details(spec))
        x = inp(c.ctx0, 0, (spec.n_embd, c.n_tokens), "x")
        c.build_moe_ffn(x, spec.layers[0], 0, **c.moe_args(0))
        clamps = [t for t in c.g.nodes if t.op == "CLAMP"]
        assert clamps and all(t.inpl is inplace for t in clamps)


def test_mask_rows_padded_to_64_before_the_ggml_sync():
    spec = _spec("llama")
    cfg = RunConfig(n_ctx=4096, n_batch=40, n_ubatch=40, n_parallel=1, kv_unified=False, flash_attn="off")
    old = resolve_context(spec, cfg, Frontend.LIBRARY, build=OLD)
    assert (old.n_batch, old.n_ubatch) == (64, 40)  # n_batch raised to GGML_KQ_MASK_PAD, n_ubatch kept
    c = GraphContext(spec, old, default_details(spec))
    mask = c._kq_mask(c._kv([0], old.n_ctx_seq))
    assert list(mask.ne) == [4096, 64, 1, 1]  # GGML_PAD(40, 64) rows (0.3.16 build_attn_inp_kv_unified)
    new = resolve_context(spec, cfg, Frontend.LIBRARY)
    c = GraphContext(spec, new, default_details(spec))
    assert list(c._kq_mask(c._kv([0], new.n_ctx_seq)).ne) == [4096, 40, 1, 1]


@pytest.mark.parametrize("release", ["0.3.16", "0.3.23"])
@pytest.mark.parametrize("shape, fa", [("qwen36-35b-a3b", "on"), ("llama-8b", "on"), ("llama-8b", "off")])
def test_old_graphs_simulate_like_the_full_graph(release: str, shape: str, fa: str):
    """The layer-skipping replay stays exact with an older build's graph (the f32 mask cast to f16 in the first layer,
    no embedding input, the mask rows padded to 64): the same buffer as allocating every node."""
    if shape.startswith("qwen36") and release == "0.3.16":
        pytest.skip("qwen35moe is unknown to 0.3.16")
    b = resolve_build(release)
    header, spec = load_model_spec(str(build_shape(shape)))
    cfg = RunConfig(n_ctx=8192, n_ubatch=500, n_batch=2048, n_parallel=1, kv_unified=False, flash_attn=fa)
    cp = resolve_context(spec, cfg, Frontend.LIBRARY, build=b)
    d = graph_details(header)
    r = compute._simulate(GraphContext(spec, cp, d), Gallocr(32))
    assert r.layers_simulated < spec.n_layer
    assert r.size == compute._emulate_full(spec, cp, d)
