"""Weights, KV cache and recurrent state: exact to the byte against llama.cpp's own dry run.

llama.cpp's memory breakdown (model / context bytes per buffer type) is exact; its log lines give the
cell and layer counts of each cache. Where ggfit refuses a config, llama.cpp must refuse it too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fitter.llama.cparams import Backend, ConfigError, Frontend, RunConfig, resolve_context
from fitter.llama.kv_cache import memory_caches
from fitter.llama.model import load_model_spec
from fitter.llama.weights import weight_buffers
from fitter.oracle.check import llama_params, measured_by_kind
from fitter.oracle.llama_run import measure
from tests.synth import REGISTRY, build

# (n_ctx, -np, unified, -ctk, -ctv, -fa, swa_full, -ub)
GRID = [
    (512, 1, False, "f16", "f16", "on", False, 512),
    (4096, 4, False, "q8_0", "q8_0", "on", False, 256),
    (5000, 4, True, "q4_0", "f16", "off", True, 128),
    (2048, 2, True, "bf16", "q5_1", "on", False, 64),
    (262144, 4, True, "f16", "q8_0", "on", False, 2048),
]
ALL_KV_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]


def _check(path: str, cfg: RunConfig) -> None:
    header, spec = load_model_spec(path)
    try:
        cp = resolve_context(spec, cfg, Frontend.LIBRARY)
    except ConfigError as refused:
        # ggfit refuses: llama.cpp must refuse the same params (build them without our checks)
        from fitter.oracle.llama_run import LlamaParams

        raw = LlamaParams(n_ctx=cfg.n_ctx, n_seq_max=cfg.n_parallel, kv_unified=cfg.kv_unified, type_k=cfg.type_k,
                          type_v=cfg.type_v, flash_attn=cfg.flash_attn, swa_full=cfg.swa_full, n_ubatch=cfg.n_ubatch)
        run = measure(path, raw, mode="dry", log_level="info")
        assert run.status == "error", f"ggfit refused ({refused}) but llama.cpp accepted"
        return
    caches = memory_caches(spec, cp)
    run = measure(path, llama_params(cp, cfg), mode="dry", log_level="info").raise_for_status()
    got = measured_by_kind(run)

    # a dry run allocates nothing, so its model bytes are those of an allocating (no-mmap) load
    weights = weight_buffers(header, spec, Backend.CPU, use_mmap=False)
    assert got["model"] == sum(w.bytes for w in weights)
    assert run.breakdown_total("context") == sum(c.bytes for c in caches)  # KV + recurrent state, exact bytes
    kv = [c for c in caches if c.kind == "kv"]
    assert [(c.cells, c.layers, c.n_stream) for c in run.report.kv_caches] == [
        (c.cells, len(c.layers), c.n_stream) for c in kv
    ]
    for theirs, ours in zip(run.report.kv_caches, kv):
        assert abs(theirs.k_bytes - ours.k_bytes) <= 5243 and abs(theirs.v_bytes - ours.v_bytes) <= 5243  # 0.01 MiB print
    rs = [c for c in caches if c.kind == "rs"]
    if rs:
        assert abs(sum(r.bytes for r in run.report.recurrent) - rs[0].bytes) <= 3 * 5243
    assert got["output"] is not None and abs(got["output"] - spec.n_vocab * cp.n_seq_max * 4) <= 5243


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(REGISTRY))
@pytest.mark.parametrize("grid", GRID, ids=lambda g: f"c{g[0]}-np{g[1]}{'u' if g[2] else ''}-{g[3]}-{g[4]}-fa{g[5]}")
def test_weights_kv_rs_exact(arch: str, grid: tuple) -> None:
    n_ctx, n_par, uni, tk, tv, fa, swa_full, ub = grid
    cfg = RunConfig(n_ctx=n_ctx, n_parallel=n_par, kv_unified=uni, type_k=tk, type_v=tv, flash_attn=fa,
                    swa_full=swa_full, n_ubatch=ub)
    _check(str(build(arch)), cfg)


@pytest.mark.slow
@pytest.mark.parametrize("kv_type", ALL_KV_TYPES)
def test_every_kv_type_on_gemma3_swa(kv_type: str) -> None:
    # head size 64 so every block size divides it; SWA full and not
    path = str(build("gemma3", n_embd=256, n_head=4, head_dim=64))
    for swa_full in (False, True):
        _check(path, RunConfig(n_ctx=8192, n_parallel=4, kv_unified=False, type_k=kv_type, type_v=kv_type,
                               flash_attn="on", swa_full=swa_full, n_ubatch=512))


@pytest.mark.slow
def test_real_gemma_server_defaults_at_training_context() -> None:
    from fitter.bundled import resolve_model

    # llama-server defaults: -np auto = 4 slots, unified KV, swa_full off
    _check(resolve_model("gemma3-270m"), RunConfig(n_ctx=32768, n_parallel=4, kv_unified=True, swa_full=False))


@pytest.mark.slow
@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "no-mmap"])
@pytest.mark.parametrize("arch", sorted(REGISTRY))
def test_weights_real_load(arch: str, use_mmap: bool) -> None:
    """The model buffer of a real load: a mapped file range with mmap, padded allocations without."""
    from fitter.oracle.llama_run import LlamaParams

    path = str(build(arch))
    header, spec = load_model_spec(path)
    run = measure(path, LlamaParams(n_ctx=256, use_mmap=use_mmap), mode="load", log_level="info").raise_for_status()
    ours = weight_buffers(header, spec, Backend.CPU, use_mmap=use_mmap)
    rows = [r for r in run.breakdown or [] if r.model]
    assert [(r.buffer_type, r.model) for r in rows] == [(w.buffer, w.bytes) for w in ours]


def _resplit(src: str, directory: Path, per_shard: int) -> Path:
    """The model of `src` as convert_hf_to_gguf writes a split one (gguf.GGUFWriter with split_max_tensors): the same
    keys and tensors, `per_shard` tensors a file. Returns the first file."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(directory / "model.gguf", r.fields["general.architecture"].contents(), split_max_tensors=per_shard)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue  # the writer's own
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, f.types[-1] if vt == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=tuple(int(d) for d in reversed(t.shape)), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = sorted(directory.glob("model-00001-of-*.gguf"))
    assert len(first) == 1
    return first[0]


@pytest.mark.slow
@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "no-mmap"])
def test_weights_of_a_split_model_real_load(tmp_path: Path, use_mmap: bool) -> None:
    """A model split over five files: with mmap llama.cpp maps each file's range of tensors (a CPU_Mapped buffer per
    file, each printed, their sum in the breakdown); without, one allocation. Asked after the same model in one file
    (the same tensor names), so that nothing of that file's layout is reused."""
    from fitter.oracle.llama_run import LlamaParams

    whole = str(build("llama"))
    header, spec = load_model_spec(whole)
    one = weight_buffers(header, spec, Backend.CPU, use_mmap=use_mmap)
    path = _resplit(whole, tmp_path, per_shard=5)
    header, spec = load_model_spec(str(path))
    assert len(header.shards) == 5
    ours = weight_buffers(header, spec, Backend.CPU, use_mmap=use_mmap)
    run = measure(str(path), LlamaParams(n_ctx=256, use_mmap=use_mmap), mode="load", log_level="info")
    run.raise_for_status()
    rows = [r for r in run.breakdown or [] if r.model]
    assert [(r.buffer_type, r.model) for r in rows] == [(ours[0].buffer, sum(w.bytes for w in ours))]
    printed = run.report.rows("model")
    assert [(b.buffer, round(b.mib, 2)) for b in printed] == [(w.buffer, round(w.bytes / 2**20, 2)) for w in ours]
    if use_mmap:
        assert [w.shard for w in ours] == [0, 1, 2, 3, 4] and len(one) == 1
    else:
        assert [(w.buffer, w.bytes) for w in ours] == [(w.buffer, w.bytes) for w in one]
