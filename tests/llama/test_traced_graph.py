"""One graph per model and context less its cache sizes and ubatch (fitter.llama.traced_graph._TRACED,
fitter.ggml.symbolic).

A graph is traced once with its KV caches' cell counts and its tokens symbolic; a context that differs only in n_ctx
or n_ubatch reuses it, its shapes evaluated at the new values, where the trace's guards hold. Everything here is
checked against the same compute buffers built from scratch without tracing (no reuse, plain ints): every
architecture, the CPU, CUDA and Metal, sweeps of n_ctx and n_ubatch in both directions, flash attention on and off,
a quantized cache, several sequences, partial offload (the scheduler's copies), MTP heads."""

from __future__ import annotations

import operator

import pytest

from fitter.cache import CACHES
from fitter.ggml.symbolic import MONOMIALS, N_MONO, Sym, form, holds, monomials, trace
from fitter.llama import context as C
from fitter.llama.cparams import ConfigError, Frontend, RunConfig, resolve_context
from fitter.llama.graph_details import graph_details
from fitter.llama.model import load_model_spec
from fitter.llama.traced_graph import predict_once
from tests.synth import build

ARCHS = ("llama", "qwen2", "qwen3", "phi3", "mistral3", "gemma2", "gemma3", "gemma4", "qwen3moe", "qwen35",
         "qwen35moe", "qwen3next", "gpt-oss", "deepseek2", "glm4moe")
# n_ctx up and down, across the 256-cell padding and the SWA window; the first one traces the graph
SWEEP = (4096, 4352, 1024, 33024, 8192, 768, 131072, 2560)
CONFIGS = (
    dict(n_ubatch=512),
    dict(n_ubatch=256, flash_attn="off", n_parallel=2, kv_unified=False),
    dict(n_ubatch=512, type_k="q8_0", type_v="q8_0", flash_attn="on", n_gpu_layers=2),
)


def _count_traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per graph traced (not reused)."""
    traced: list[int] = []

    class Counting(C._Traced):
        __slots__ = ()

        def __init__(self, *a) -> None:
            traced.append(1)
            super().__init__(*a)

    monkeypatch.setattr(C, "_Traced", Counting)
    return traced


def _scratch(spec, cp, backend, ngl, details, mtp, monkeypatch: pytest.MonkeyPatch, **opts):
    """The buffers built from scratch: no cache, no trace."""
    with monkeypatch.context() as m:
        real = C._allocated
        m.setattr(C, "_allocated", lambda c, ga, d, key, *a, **kw: real(c, ga, d, None, *a))
        CACHES.clear("compute")  # (not the traced graphs: the caller counts their reuse)
        return C.compute_buffers(spec, cp, backend, ngl, details=details, mtp=mtp, **opts)


@pytest.mark.parametrize("backend", ["cpu", "cuda", "metal"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_reused_graph_equals_one_built_from_scratch(arch: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mtp_kw = {"n_nextn": 1} if arch in ("qwen35", "qwen35moe", "glm4moe", "deepseek2") else {}
    header, spec = load_model_spec(str(build(arch, **mtp_kw)))
    d = graph_details(header)
    traced = _count_traces(monkeypatch)
    ran = runs = 0
    for kw in CONFIGS:
        ngl = kw.get("n_gpu_layers", -1)
        try:
            resolve_context(spec, RunConfig(**kw), Frontend.SERVER)
        except ConfigError:  # a quantized cache the heads' sizes refuse
            continue
        ran += 1
        for mtp in (False, True) if mtp_kw else (False,):
            for n_ctx in SWEEP:
                cp = resolve_context(spec, RunConfig(n_ctx=n_ctx, **kw), Frontend.SERVER)
                CACHES.clear("compute")
                got = C.compute_buffers(spec, cp, backend, ngl, details=d, mtp=mtp)
                runs += 1
                assert got == _scratch(spec, cp, backend, ngl, d, mtp, monkeypatch), (kw, mtp, n_ctx)
    assert ran and runs - len(traced) >= runs * 5 // 8  # most of the sweep reuses a traced graph


# (n_ctx, n_ubatch), n_tokens a multiple of 256: the ubatch up and down across the sizes `fit` tabulates, n_ctx below
# it (n_tokens = n_ctx); then other units (384: 128; 100: 4; 1001: 1) and, with 4 sequences, n_tokens rounded up (1001
# -> 1004: traced with n_tokens in the key)
UB_SWEEP = ((8192, 512), (8192, 4096), (4096, 256), (33024, 2048), (256, 1024), (8192, 1024), (131072, 512))
UB_OTHER = ((8192, 384), (4096, 100), (3072, 1001))


@pytest.mark.parametrize("backend", ["cpu", "cuda", "metal"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_graph_reused_for_another_ubatch_equals_one_built_from_scratch(arch: str, backend: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokens traced as a variable too (GraphContext.trace_tokens): one graph serves every ubatch of a unit."""
    mtp = arch in ("qwen35", "qwen35moe", "glm4moe", "deepseek2")
    header, spec = load_model_spec(str(build(arch, **({"n_nextn": 1} if mtp else {}))))
    d = graph_details(header)
    traced = _count_traces(monkeypatch)
    ran = 0
    for kw in (dict(), dict(type_k="q8_0", type_v="q8_0", flash_attn="on"), dict(n_parallel=4, kv_unified=False)):
        CACHES.clear("traced")
        before = len(traced)
        for n_ctx, n_ubatch in UB_SWEEP + UB_OTHER:
            try:
                cp = resolve_context(spec, RunConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=4096, **kw),
                                     Frontend.SERVER)
            except ConfigError:  # a quantized cache the heads' sizes refuse
                break
            CACHES.clear("compute")
            got = C.compute_buffers(spec, cp, backend, details=d)
            assert got == _scratch(spec, cp, backend, -1, d, False, monkeypatch), (kw, n_ctx, n_ubatch)
            if mtp:  # the MTP draft context's graph (its own trace)
                got = C.compute_buffers(spec, cp, backend, details=d, mtp=True)
                assert got == _scratch(spec, cp, backend, -1, d, True, monkeypatch), (kw, n_ctx, n_ubatch, "mtp")
            if (n_ctx, n_ubatch) == UB_SWEEP[-1]:  # one graph (and MTP's) for every n_tokens of 256s, n_ctx and unit alike
                assert len(traced) == before + 1 + mtp, kw
                ran += 1
    assert ran


def test_qwen35moe_full_size_reuses_one_graph_for_every_n_ctx_past_the_ubatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.synth.shapes import build_shape

    header, spec = load_model_spec(str(build_shape("qwen36-35b-a3b")))
    d = graph_details(header)
    traced = _count_traces(monkeypatch)
    for n_ctx in (4096, 262144, 65536, 4352):
        cp = resolve_context(spec, RunConfig(n_ctx=n_ctx, n_ubatch=2048, type_k="q8_0", type_v="q8_0"), Frontend.SERVER)
        assert C.compute_buffers(spec, cp, "metal", details=d) == _scratch(spec, cp, "metal", -1, d, False, monkeypatch)
    assert len(traced) == 1


@pytest.mark.parametrize("backend", ["cpu", "cuda", "metal"])
def test_predict_once_traces_nothing_and_reuses_what_is_kept(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """predict_once (`ggfit fit -c`): the graph built for its one prediction is not traced, and gives what one built
    from scratch gives; a graph traced before it is still reused inside it; tracing is back on after it."""
    header, spec = load_model_spec(str(build("qwen35moe")))
    d = graph_details(header)
    traced = _count_traces(monkeypatch)

    def cp(n_ctx: int, **kw):
        return resolve_context(spec, RunConfig(n_ctx=n_ctx, n_ubatch=512, **kw), Frontend.SERVER)

    with predict_once():
        once = C.compute_buffers(spec, cp(4096), backend, details=d)
    assert traced == [] and not C._TRACED
    assert once == _scratch(spec, cp(4096), backend, -1, d, False, monkeypatch)
    C.compute_buffers(spec, cp(8192, type_k="q8_0", type_v="q8_0"), backend, details=d)  # traced: on again
    assert len(traced) == 1
    with predict_once():
        reused = C.compute_buffers(spec, cp(33024, type_k="q8_0", type_v="q8_0"), backend, details=d)
    assert len(traced) == 1
    assert reused == _scratch(spec, cp(33024, type_k="q8_0", type_v="q8_0"), backend, -1, d, False, monkeypatch)


@pytest.mark.parametrize("backend", ["cpu", "cuda", "metal"])
def test_the_quants_of_one_model_share_a_graph(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another quant of the model (another spec and header, other weight types) reuses the traced graph by content
    where the graph read no weight's type, and gives what a graph built from scratch gives."""
    header, spec = load_model_spec(str(build("qwen3moe")))
    d = graph_details(header)
    types = {k: {il: 12 for il in v} for k, v in d.layer_types.items()}  # every layer weight Q4_K
    other = (spec.model_copy(update={"name": "another quant", "file_size": spec.file_size // 2}),
             d.model_copy(update={"layer_types": types}))
    traced = _count_traces(monkeypatch)
    for (sp, dd), n_ctx in (((spec, d), 4096), (other, 8192), (other, 2560)):
        cp = resolve_context(sp, RunConfig(n_ctx=n_ctx, n_ubatch=512), Frontend.SERVER)
        assert C.compute_buffers(sp, cp, backend, details=dd) == _scratch(sp, cp, backend, -1, dd, False, monkeypatch)
    assert len(traced) == 1


def _k(*linear: int, **products: int) -> tuple[int, ...]:
    """Coefficients over fitter.ggml.symbolic.MONOMIALS: the variables', then products named like x0x2=..."""
    k = list(linear) + [0] * (N_MONO - len(linear))
    for name, a in products.items():
        k[MONOMIALS.index((int(name[1]), int(name[3])))] = a
    return tuple(k)


def test_sym_keeps_affine_forms_and_guards_everything_else() -> None:
    with trace() as guards:
        s = Sym.var(0, 4096)
        x = (s * 2 + 64) // 2 - 1  # affine: no guard
        assert (x.k, x.c, int.__int__(x)) == (_k(1), 31, 4127)
        assert not guards
        assert (s // 3, s % 256) == (1365, 0)  # not exact in s: guarded
        assert s > 512
    assert (_k(1), 0, operator.floordiv, 3, 1365) in guards
    assert holds(list(guards), (4096, 0, 0)) and holds(list(guards), (4096, 123, 7))  # the other variables unused
    assert not holds(list(guards), (4097, 0, 0)) and not holds(list(guards), (4352, 0, 0))  # % 256, // 3
    assert not holds(list(guards), (512, 0, 0))
    with trace() as pinned:
        assert [0] * 2 + [int(s)] == [0, 0, 4096] and f"{s}" == "4096"
    assert holds(list(pinned), (4096, 0, 0)) and not holds(list(pinned), (4352, 0, 0))


def test_sym_keeps_products_of_cells_and_tokens() -> None:
    """A stride over cells x tokens (the scores of attention) keeps its form; the tokens in their unit keep
    GGML_PAD and the chunkings exact; a product of degree three is pinned."""
    with trace() as guards:
        cells, tokens = Sym.var(0, 4096), Sym.var(2, 512, 256)  # 512 tokens: 2 units of 256
        nb = cells * 4 * (tokens + 1)
        assert (nb.k, nb.c, int.__int__(nb)) == (_k(4, 0, 0, x0x2=1024), 0, 4096 * 4 * 513)
        pad = (tokens + 63) // 64 * 64  # GGML_PAD(n_tokens, 64)
        chunks = (tokens + 63) // 64
        assert (pad.k, chunks.k, int.__int__(chunks)) == (_k(0, 0, 256), _k(0, 0, 4), 8)
        assert not guards
        assert int.__int__(nb * tokens) == 4096 * 4 * 513 * 512  # degree three: both pinned
    assert holds(list(guards), (4096, 0, 2)) and not holds(list(guards), (4096, 0, 4))
    assert sum(a * x for a, x in zip(form(nb), (*monomials((8192, 0, 16)), 1))) == 8192 * 4 * (16 * 256 + 1)


@pytest.mark.parametrize("arch", ["qwen35moe", "gpt-oss", "gemma3"])
@pytest.mark.parametrize("flags", [
    dict(n_gpus=2),  # pipeline parallelism: every split input copied GGML_SCHED_MAX_COPIES times
    dict(n_gpus=2, tensor_split=(3.0, 1.0), no_kv_offload=True),  # the caches in host memory
    dict(n_cpu_moe=2, n_ubatch=256),  # experts on the CPU: their copies for the GPU's ops
    dict(override_tensor=("attn_.*=CPU",), no_op_offload=True),
])
def test_placements_reuse_a_graph_exactly(arch: str, flags: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from fitter.fit.memory import placement_of
    from fitter.llama.cparams import Backend

    header, spec = load_model_spec(str(build(arch)))
    d = graph_details(header)
    kw = {k: v for k, v in flags.items() if k != "n_gpus"}
    traced = _count_traces(monkeypatch)
    for i, n_ctx in enumerate(SWEEP):
        cfg = RunConfig(n_ctx=n_ctx, **({"n_ubatch": (512, 2048, 256)[i % 3]} | kw))  # and the ubatch, unless set
        cp = resolve_context(spec, cfg, Frontend.SERVER)
        wp = placement_of(spec, cfg, Backend.CUDA, flags.get("n_gpus", 1))
        opts = dict(placement=wp, kv_host=cfg.no_kv_offload, op_offload=not cfg.no_op_offload)
        CACHES.clear("compute")
        got = C.compute_buffers(spec, cp, "cuda", details=d, **opts)
        assert got == _scratch(spec, cp, "cuda", -1, d, False, monkeypatch, **opts), n_ctx
    assert len(traced) <= 3  # the sweep reuses a traced graph


@pytest.mark.parametrize("release", ["0.3.16", "0.3.20", "0.3.23"])
@pytest.mark.parametrize(("arch", "backend"), [("gemma3", "metal"), ("qwen3moe", "cuda"), ("deepseek2", "cpu")])
def test_older_builds_reuse_a_graph_exactly(release: str, arch: str, backend: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds whose rules pad the caches, the masks and n_batch otherwise (fitter.llama_builds)."""
    from fitter.llama_builds import resolve_build

    build_ = resolve_build(release)
    header, spec = load_model_spec(str(build(arch)))
    d = graph_details(header)
    for kw in (dict(), dict(flash_attn="off", n_parallel=2, kv_unified=False)):
        for i, n_ctx in enumerate(SWEEP):
            n_ubatch = (512, 256, 2048, 1024)[i % 4]  # the ubatch too: 0.3.16 pads the mask's rows to 64
            cp = resolve_context(spec, RunConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, **kw), Frontend.SERVER, build=build_)
            CACHES.clear("compute")
            got = C.compute_buffers(spec, cp, backend, details=d)
            assert got == _scratch(spec, cp, backend, -1, d, False, monkeypatch), (kw, n_ctx, n_ubatch)
