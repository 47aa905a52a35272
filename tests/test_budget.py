"""--budget / --margin parsing, `auto` on this machine and (stubbed) on Metal and CUDA, and the
backend alloc-size rules of fitter/compute_backend.py (Metal and CUDA cannot run here, so their
formulas are checked against values worked out by hand from the pinned ggml sources)."""

from __future__ import annotations

import platform
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from fitter import compute_backend as cb
from fitter.budget import (
    DEFAULT_MARGIN_BYTES,
    Budget,
    BudgetError,
    auto_budget,
    available_bytes,
    metal_recommended_max_working_set,
    nvml_free_bytes,
    parse_budget,
    parse_margin,
    parse_size,
)
from fitter.errors import GGFitError

MiB = 2**20
GiB = 2**30

# --- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("25559MiB", 25559 * MiB),
        ("24GiB", 24 * GiB),
        ("26800MB", 26_800_000_000),
        ("26.8GB", 26_800_000_000),
        ("26800000000", 26_800_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("24 gib", 24 * GiB),
        ("24gb", 24_000_000_000),
        ("512KiB", 512 * 1024),
        ("512kb", 512_000),
        ("2TiB", 2 * 1024**4),
        ("1TB", 10**12),
        ("100B", 100),
        ("  25559MiB  ", 25559 * MiB),
        ("0.0000001KiB", 0),  # rounds down to whole bytes
        ("1.0005KB", 1000),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["24GB5", "-1MiB", "lots", "", "24G", "24M", "1.5", "1e9", "24 GiB extra", "GiB", "1,024MiB", "0x100", "24GiBs", "+5GB"]
)
def test_parse_size_refuses(text):
    with pytest.raises(BudgetError) as e:
        parse_size(text, what="--budget")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("--budget ")
    assert "MiB" in msg and "GB" in msg  # says what is accepted


def test_errors_are_ggfit_errors():
    assert issubclass(BudgetError, GGFitError)
    assert issubclass(cb.BackendError, GGFitError)


def test_negative_says_so():
    with pytest.raises(BudgetError, match="negative"):
        parse_size("-1MiB")


def test_unknown_unit_names_it():
    with pytest.raises(BudgetError, match="unknown unit 'G'"):
        parse_size("24G")


def test_parse_budget_explicit():
    b = parse_budget("24GiB", "metal")
    assert b == Budget(bytes=24 * GiB, source="--budget 24GiB")
    assert b.mib == 24 * 1024


def test_budget_zero_refused_margin_zero_allowed():
    with pytest.raises(BudgetError, match="more than zero"):
        parse_budget("0", "cpu")
    with pytest.raises(BudgetError):
        parse_budget("0MiB", "cpu")
    assert parse_margin("0") == 0
    assert parse_size("0MiB") == 0


def test_margin_default_is_fit_target():
    # common/common.h: fit_params_target = 1024*1024*1024 per device
    assert DEFAULT_MARGIN_BYTES == 1024 * MiB
    assert parse_margin(None) == DEFAULT_MARGIN_BYTES
    assert parse_margin("512MiB") == 512 * MiB
    with pytest.raises(BudgetError, match="--margin"):
        parse_margin("auto")
    with pytest.raises(BudgetError, match="--margin"):
        parse_margin("lots")


def test_available_bytes():
    b = Budget(bytes=25559 * MiB, source="x")
    assert available_bytes(b, DEFAULT_MARGIN_BYTES) == 24535 * MiB
    with pytest.raises(BudgetError, match="leaves nothing"):
        available_bytes(b, 25559 * MiB)


def test_auto_unknown_backend():
    with pytest.raises(BudgetError, match="unknown backend"):
        auto_budget("vulkan", run=lambda cmd: None)


# --- auto: CPU -----------------------------------------------------------------------------------


def _mem_available() -> int:
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    assert m
    return int(m.group(1)) * 1024


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/meminfo")
def test_auto_cpu_on_this_machine():
    before = _mem_available()
    b = parse_budget("auto", "cpu")
    after = _mem_available()
    assert b.source.startswith("MemAvailable")
    assert b.note
    lo, hi = min(before, after), max(before, after)
    assert lo - 256 * MiB <= b.bytes <= hi + 256 * MiB


def test_auto_cpu_meminfo_file(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       32768000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    b = auto_budget("cpu", system="Linux", meminfo=f)
    assert b.bytes == 20_000_000 * 1024


def test_auto_cpu_meminfo_without_available(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       32768000 kB\n")
    with pytest.raises(BudgetError, match="pass --budget"):
        auto_budget("cpu", system="Linux", meminfo=f)


def test_auto_cpu_macos_vm_stat():
    vm_stat = (
        "Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"
        "Pages free:                               10000.\n"
        "Pages active:                            500000.\n"
        "Pages inactive:                          200000.\n"
        "Pages speculative:                         5000.\n"
        "Pages purgeable:                           1000.\n"
    )
    b = auto_budget("cpu", system="Darwin", run=lambda cmd: vm_stat if cmd == ["vm_stat"] else None)
    assert b.bytes == (10000 + 200000 + 5000 + 1000) * 16384
    assert "vm_stat" in b.source


def test_auto_cpu_unsupported_system():
    with pytest.raises(BudgetError, match="Windows"):
        auto_budget("cpu", system="Windows", run=lambda cmd: None)


# --- auto: CUDA (nvidia-smi / NVML stubbed) ------------------------------------------------------


def _smi(out: str | None):
    calls = []

    def run(cmd):
        calls.append(cmd)
        if cmd[0] == "nvidia-smi":
            assert cmd[1:] == ["--query-gpu=memory.free", "--format=csv,noheader,nounits"]
            return out
        return None

    return run, calls


def test_auto_cuda_nvidia_smi(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run, calls = _smi("142311\n80000\n")
    b = auto_budget("cuda", run=run, nvml=lambda i: pytest.fail("NVML not needed"))
    assert b.bytes == 142311 * MiB
    assert b.source == "nvidia-smi memory.free (GPU 0)"
    assert "CUDA context" in b.note
    assert len(calls) == 1
    assert auto_budget("cuda", run=run, device=1).bytes == 80000 * MiB


def test_auto_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    run, _ = _smi("142311\n80000\n")
    b = parse_budget("auto", "cuda", run=run)
    assert b.bytes == 80000 * MiB and "GPU 1" in b.source


def test_auto_cuda_nvml_fallback(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run, _ = _smi(None)
    b = auto_budget("cuda", run=run, nvml=lambda i: 150 * GiB if i == 0 else None)
    assert b.bytes == 150 * GiB and b.source.startswith("NVML")


def test_auto_cuda_garbage_then_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run, _ = _smi("[N/A]\n")
    b = auto_budget("cuda", run=run, nvml=lambda i: 1234)
    assert b.bytes == 1234


def test_auto_cuda_nothing(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run, _ = _smi(None)
    with pytest.raises(BudgetError, match="CUDA device 0"):
        auto_budget("cuda", run=run, nvml=lambda i: None)


def test_nvml_absent_here():
    try:
        import ctypes

        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        assert nvml_free_bytes(0) is None
    else:  # pragma: no cover - a machine with an NVIDIA driver
        pytest.skip("NVML present")


# --- auto: Metal (Metal runtime / sysctl stubbed) ------------------------------------------------


def _sysctl(values: dict[str, str]):
    def run(cmd):
        if cmd[:2] == ["sysctl", "-n"]:
            return values.get(cmd[2])
        return None

    return run


def test_auto_metal_device():
    b = auto_budget("metal", system="Darwin", metal_probe=lambda: 26_800_603_136,
                    run=_sysctl({"iogpu.wired_limit_mb": "0"}))
    assert b.bytes == 26_800_603_136
    assert b.source == "Metal recommendedMaxWorkingSetSize"


def test_auto_metal_wired_limit():
    b = auto_budget("metal", system="Darwin", metal_probe=lambda: None,
                    run=_sysctl({"iogpu.wired_limit_mb": "26000\n", "hw.memsize": str(32 * GiB)}))
    assert b.bytes == 26000 * MiB
    assert b.source == "sysctl iogpu.wired_limit_mb"


def test_auto_metal_probe_error_falls_back():
    def boom():
        raise OSError("no Metal")

    b = auto_budget("metal", system="Darwin", metal_probe=boom, run=_sysctl({"iogpu.wired_limit_mb": "12000"}))
    assert b.bytes == 12000 * MiB


def test_auto_metal_table_fallback():
    run = _sysctl({"iogpu.wired_limit_mb": "0", "hw.memsize": str(32 * GiB)})
    b = parse_budget("auto", "metal", system="Darwin", metal_probe=lambda: None, run=run)
    assert b.bytes == 25559 * MiB
    assert "fallback" in b.note and "table" in b.source


def test_auto_metal_table_unknown_size():
    run = _sysctl({"iogpu.wired_limit_mb": "0", "hw.memsize": str(8 * GiB)})
    b = auto_budget("metal", system="Darwin", metal_probe=lambda: None, run=run)
    assert b.bytes == 8 * GiB * 2 // 3
    assert "2/3" in b.note


def test_auto_metal_nothing():
    with pytest.raises(BudgetError, match="Metal"):
        auto_budget("metal", system="Darwin", metal_probe=lambda: None, run=lambda cmd: None)


def test_auto_metal_off_mac():
    if platform.system() == "Darwin":  # pragma: no cover
        pytest.skip("this is a Mac")
    with pytest.raises(BudgetError, match="25559MiB"):
        parse_budget("auto", "metal")


def test_metal_probe_absent_here():
    if platform.system() == "Darwin":  # pragma: no cover
        pytest.skip("this is a Mac")
    assert metal_recommended_max_working_set() is None


# --- compute_backend: buffer rules -----------------------------------------------------------------


def test_buffer_rules():
    assert cb.buffer_alignment("cpu") == 32
    assert cb.buffer_alignment("cuda") == 128
    assert cb.buffer_alignment("metal") == 32
    assert cb.host_buffer_alignment("cuda") == 32
    assert cb.buffer_rules("cuda").max_size == cb.SIZE_MAX
    assert cb.buffer_rules("metal", metal_max_buffer_length=17 * GiB).max_size == 17 * GiB
    assert cb.metal_buffer_resident_size(1) == 16384
    assert cb.metal_buffer_resident_size(16384) == 16384
    assert cb.metal_buffer_resident_size(0) == 0
    with pytest.raises(cb.BackendError, match="use cpu, cuda or metal"):
        cb.buffer_alignment("vulkan")


def test_cuda_quant_row_padding():
    # ggml_backend_cuda_buffer_type_get_alloc_size: + ggml_row_size(type, 512 - ne0 % 512)
    assert cb.cuda_quant_row_padding("q8_0", 512) == 0
    assert cb.cuda_quant_row_padding("q8_0", 256) == 256 // 32 * 34
    assert cb.cuda_quant_row_padding("q4_k", 2816) == (512 - 2816 % 512) // 256 * 144
    assert cb.cuda_quant_row_padding("f16", 100) == 0
    # a weight: once per tensor, then aligned to 128
    base = cb.nbytes("q4_k", (2816, 2048))
    assert cb.cuda_weight_alloc_size("q4_k", (2816, 2048)) == cb.pad(base + 256 // 256 * 144, 128)
    assert cb.weight_alloc_size("metal", "q4_k", (2816, 2048)) == base
    # K cache q8_0 with 2 KV heads of 128 (n_embd_k_gqa 256): one padded row, aligned to 128
    k = cb.row_size("q8_0", 256) * 4096
    assert cb.kv_tensor_alloc_size("cuda", "q8_0", 256, 4096, 1) == cb.pad(k + 272, 128)
    assert cb.kv_tensor_alloc_size("cuda", "q8_0", 512, 4096, 1) == cb.row_size("q8_0", 512) * 4096
    assert cb.kv_tensor_alloc_size("metal", "q8_0", 256, 4096, 1) == k


# --- compute_backend: FLASH_ATTN_EXT ---------------------------------------------------------------

# Qwen3.6-35B-A3B full-attention layer: 16 heads, 2 KV heads of 256, ctx 262,144, ubatch 2048, q8_0
QWEN = dict(d_k=256, d_v=256, n_head=16, n_head_kv=2, n_kv=262144)


def test_metal_fa_qwen35moe_prefill():
    s = cb.FlashAttnShape(n_q=2048, type_k="q8_0", type_v="q8_0", **QWEN)
    assert cb.metal_fa_use_kv_f16(s) and not cb.metal_fa_use_vec(s)
    e = cb.metal_fa_extras(s)
    assert e["pad"] == 64 * (2 * 256 * 2 + 2 * 256 * 2 + 2 * 2048)  # f16 strides after the dequant
    assert e["blk"] == (262144 // 64) * (2048 // 8)
    assert e["tmp"] == 4 * 32 * 16 * 32 * 258
    assert e["kv_f16"] == 2 * (2 * 256 * 262144 * 2)
    assert e["idx"] == 0
    assert s.out_nbytes == 32 * MiB
    assert cb.metal_fa_alloc_size(s) == 32 * MiB + 393216 + MiB + 16_908_288 + 512 * MiB
    assert s.mask_nbytes == 1024 * MiB


def test_metal_fa_kv_f16_always_reserved():
    f16 = cb.FlashAttnShape(n_q=2048, **QWEN)
    assert not cb.metal_fa_use_kv_f16(f16)
    assert cb.metal_fa_extra_kv_f16(f16) == 512 * MiB
    assert cb.metal_fa_extra_pad(f16) == 64 * (1024 * 2 + 1024 * 2 + 2 * 2048)  # nb11 = 2*512 per cell
    tg = cb.FlashAttnShape(n_q=1, type_k="q8_0", type_v="q8_0", **QWEN)
    assert not cb.metal_fa_use_kv_f16(tg) and cb.metal_fa_use_vec(tg)
    assert cb.metal_fa_extra_kv_f16(tg) == 512 * MiB
    assert cb.metal_fa_extra_pad(tg) == 64 * (544 * 2 + 544 * 2 + 2)  # q8_0 row of 512 = 544 B
    assert cb.metal_fa_extra_blk(tg) == cb.pad(262144 // 32, 32)
    assert cb.metal_fa_extra_tmp(tg) == 4 * 1 * 16 * 32 * 258


def test_metal_fa_kv_f16_threshold():
    assert not cb.metal_fa_use_kv_f16(cb.FlashAttnShape(n_q=31, type_k="q4_0", type_v="q4_0", **QWEN))
    assert cb.metal_fa_use_kv_f16(cb.FlashAttnShape(n_q=32, type_k="q4_0", type_v="q4_0", **QWEN))
    assert not cb.metal_fa_use_kv_f16(cb.FlashAttnShape(n_q=512, type_k="bf16", type_v="bf16", **QWEN))


def test_metal_fa_mla_v_view_of_k():
    s = cb.FlashAttnShape(d_k=576, d_v=512, n_q=512, n_head=16, n_head_kv=1, n_kv=4096,
                          type_k="f16", type_v="f16", v_is_view_of_k=True)
    assert cb.metal_fa_extra_kv_f16(s) == 2 * 576 * 4096
    assert s.nb21 == s.nb11 == 2 * 576


def test_metal_fa_sparse_idx():
    s = cb.FlashAttnShape(n_q=4, n_kv_max=2048, **QWEN)
    assert cb.metal_fa_extra_idx(s) == 4 * 2048 * 4
    assert cb.metal_fa_extra_idx(cb.FlashAttnShape(n_q=4, n_kv_max=8192, **QWEN)) == 0


def test_cuda_fa_prefill_converts_quantized_kv():
    s = cb.FlashAttnShape(n_q=2048, type_k="q8_0", type_v="q8_0", **QWEN)
    assert cb.cuda_fa_kernel(s, 900) == "mma_f16"
    e = cb.cuda_fa_extras(s, 900)
    assert e == {"f16_k": 256 * MiB, "f16_v": 256 * MiB}
    assert cb.cuda_fa_alloc_size(s) == 32 * MiB + 512 * MiB
    f16 = cb.FlashAttnShape(n_q=2048, **QWEN)
    assert cb.cuda_fa_extras(f16) == {"f16_k": 0, "f16_v": 0}


def test_cuda_fa_decode_kernels():
    tg = cb.FlashAttnShape(n_q=1, type_k="q8_0", type_v="q8_0", **QWEN)
    assert cb.cuda_fa_kernel(tg, 900) == "vec"
    assert cb.cuda_fa_extras(tg, 900) == {"f16_k": 0, "f16_v": 0}
    # a K-V pair without a compiled vec kernel (default GGML_CUDA_FA_QUANTS) converts both to f16
    mixed = cb.FlashAttnShape(n_q=1, type_k="q8_0", type_v="q4_0", **QWEN)
    assert cb.cuda_fa_kernel(mixed, 900) == "vec"
    assert cb.cuda_fa_extras(mixed, 900) == {"f16_k": 256 * MiB, "f16_v": 256 * MiB}
    assert cb.cuda_fa_extras(mixed, 900, cb.CUDA_FA_VEC_PAIRS_ALL) == {"f16_k": 0, "f16_v": 0}
    # 4 slots in one stream (llama-server -np auto): 4 queries -> MMA on Ada/Hopper
    tg4 = cb.FlashAttnShape(n_q=4, type_k="q8_0", type_v="q8_0", **QWEN)
    assert cb.cuda_fa_kernel(tg4, 900) == "mma_f16"
    # f16 decode with GQA 8 and head 256: not the vec kernel on Hopper
    assert cb.cuda_fa_kernel(cb.FlashAttnShape(n_q=1, **QWEN), 900) == "mma_f16"
    # Pascal: tile kernel for a batch
    assert cb.cuda_fa_kernel(cb.FlashAttnShape(n_q=512, **QWEN), 610) == "tile"


def test_cuda_fa_unsupported():
    assert cb.cuda_fa_kernel(cb.FlashAttnShape(n_q=8, type_k="iq4_nl", type_v="iq4_nl", **QWEN)) == "none"
    r = cb.flash_attn_unsupported_reason("cuda", cb.FlashAttnShape(d_k=192, d_v=128, n_q=8, n_head=16, n_head_kv=4, n_kv=4096))
    assert r and "192" in r
    assert cb.flash_attn_unsupported_reason("cuda", cb.FlashAttnShape(d_k=192, d_v=128, n_q=8, n_head=16, n_head_kv=2, n_kv=4096)) is None
    assert cb.flash_attn_unsupported_reason("cuda", cb.FlashAttnShape(d_k=48, d_v=48, n_q=8, n_head=4, n_head_kv=4, n_kv=256))
    assert cb.flash_attn_unsupported_reason("cpu", cb.FlashAttnShape(n_q=8, type_k="iq4_nl", type_v="iq4_nl", **QWEN)) is None


def test_metal_fa_support():
    assert cb.metal_fa_unsupported_reason(256, 256, "q8_0", "q8_0") is None
    assert "differ" in cb.metal_fa_unsupported_reason(256, 256, "q8_0", "f16")
    assert "iq4_nl" in cb.metal_fa_unsupported_reason(128, 128, "iq4_nl", "iq4_nl")
    assert cb.metal_fa_unsupported_reason(72, 64, "f16", "f16")
    assert cb.metal_fa_unsupported_reason(128, 256, "f16", "f16")
    assert cb.metal_fa_unsupported_reason(576, 512, "f16", "f16") is None
    assert cb.metal_fa_unsupported_reason(200, 200, "f16", "f16")
    assert cb.metal_fa_unsupported_reason(128, 128, "bf16", "bf16", has_bfloat=False)


def test_other_op_support():
    assert cb.gated_delta_net_unsupported_reason("metal", 128) is None
    assert cb.gated_delta_net_unsupported_reason("metal", 100)
    assert cb.gated_delta_net_unsupported_reason("cuda", 100) is None
    assert cb.ssm_conv_unsupported_reason("cuda", 4096 + 2 * 16 * 128) is None
    assert cb.ssm_conv_unsupported_reason("cuda", 1000)
    assert cb.ssm_conv_unsupported_reason("metal", 1000) is None
    assert cb.mul_mat_unsupported_reason("metal", "nvfp4")
    assert cb.mul_mat_unsupported_reason("cuda", "tq2_0")
    assert cb.mul_mat_unsupported_reason("cuda", "q4_k") is None
    assert cb.mul_mat_unsupported_reason("cuda", "q4_k", mul_mat_id=True, prec_f32_src1=True)


# --- compute_backend: MUL_MAT_ID, ARGSORT, TOP_K, and the dispatcher --------------------------------


def test_metal_mul_mat_id():
    e = cb.metal_mul_mat_id_extras(256, 2048)
    assert e == {"tpe": 1024, "ids": 4 * 256 * 2048, "amax": 1032}
    assert cb.metal_mul_mat_id_alloc_size(512, 8, 2048, 256) == 4 * 512 * 8 * 2048 + sum(e.values())


def _t(op, type_, ne, src=(), **kw):
    return SimpleNamespace(op=op, type=type_, ne=ne, src=list(src), **kw)


def test_dispatcher_matches_functions():
    q = _t("PERMUTE", "f32", (256, 2048, 16, 1))
    k = _t("PERMUTE", "q8_0", (256, 262144, 2, 1))
    v = _t("PERMUTE", "q8_0", (256, 262144, 2, 1))
    mask = _t("NONE", "f16", (262144, 2048, 1, 1))
    fa = _t("GGML_OP_FLASH_ATTN_EXT", "f32", (256, 16, 2048, 1), (q, k, v, mask))
    s = cb.FlashAttnShape(n_q=2048, type_k="q8_0", type_v="q8_0", **QWEN)
    assert cb.alloc_size("metal", fa) == cb.metal_fa_alloc_size(s)
    assert cb.alloc_size("cuda", fa) == cb.cuda_fa_alloc_size(s)
    assert cb.alloc_size("cpu", fa) == s.out_nbytes

    w = _t("NONE", "q4_k", (2048, 512, 256))
    b = _t("VIEW", "f32", (2048, 8, 2048))
    ids = _t("VIEW", "i32", (8, 2048))
    mmid = _t("MUL_MAT_ID", "f32", (512, 8, 2048), (w, b, ids))
    assert cb.alloc_size("metal", mmid) == cb.metal_mul_mat_id_alloc_size(512, 8, 2048, 256)
    assert cb.alloc_size("cuda", mmid) == 4 * 512 * 8 * 2048

    logits = _t("SOFT_MAX", "f32", (256, 2048))
    srt = _t("ARGSORT", "i32", (256, 2048), (logits,))
    assert cb.alloc_size("metal", srt) == 2 * 4 * 256 * 2048
    topk = _t("TOP_K", "i32", (8, 2048), (logits,))
    assert cb.alloc_size("metal", topk) == 2 * 4 * 256 * 2048
    cs = _t("CUMSUM", "f32", (64, 100))
    assert cb.alloc_size("metal", cs) == 2 * 4 * 64 * 100
    assert cb.alloc_size("cuda", cs) == 4 * 64 * 100

    wq = _t("NONE", "q8_0", (256, 10))
    assert cb.alloc_size("cuda", wq) == cb.row_size("q8_0", 256) * 10 + 272
    assert cb.alloc_size("metal", wq) == cb.row_size("q8_0", 256) * 10


def test_metal_alloc_dep_patterns_cover_fusion_table():
    pats = set(cb.METAL_ALLOC_DEP_PATTERNS)
    assert ("MUL", "VIEW", "VIEW", "ADD") in pats
    assert ("MUL",) + ("VIEW",) * 8 + ("ADD",) * 7 in pats
    assert ("GATED_DELTA_NET", "CPY") in pats
    assert ("ADD",) * 7 in pats and ("ADD",) * 8 not in pats


def test_tensor_info_hook_for_weights():
    from fitter.gguf.reader import TensorInfo
    from gguf import GGMLQuantizationType as T

    t = TensorInfo(name="blk.0.ffn_down.weight", shape=(2816, 2048), ggml_type=T.Q4_K, offset=0,
                   nbytes=cb.nbytes("q4_k", (2816, 2048)))
    assert cb.tensor_info_alloc_size(t, "cuda") == t.nbytes + 144
    assert cb.tensor_info_alloc_size(t, "metal") == t.nbytes
    assert cb.tensor_info_alloc_size(t, cb.Backend.CPU) == t.nbytes


def test_dispatcher_on_compute_tensors():
    """fitter.compute's _T: int types, nbytes() a method, view source in .vs, MUL_MAT_ID src (b, ids)."""
    from gguf import GGMLQuantizationType as T

    class _T(SimpleNamespace):
        def nbytes(self):
            return cb.nbytes(self.type, self.ne)

    kcache = _T(op="NONE", type=T.F16.value, ne=(576, 4096, 1, 1), src=(), vs=None)
    q = _T(op="PERMUTE", type=T.F32.value, ne=(576, 512, 16, 1), src=(), vs=None)
    k = _T(op="PERMUTE", type=T.F16.value, ne=(576, 4096, 1, 1), src=(), vs=kcache)
    v = _T(op="PERMUTE", type=T.F16.value, ne=(512, 4096, 1, 1), src=(), vs=kcache)
    mask = _T(op="NONE", type=T.F16.value, ne=(4096, 512, 1, 1), src=(), vs=None)
    fa = _T(op="FLASH_ATTN_EXT", type=T.F32.value, ne=(512, 16, 512, 1), src=(q, k, v, mask), vs=None)
    s = cb.FlashAttnShape(d_k=576, d_v=512, n_q=512, n_head=16, n_head_kv=1, n_kv=4096, v_is_view_of_k=True)
    assert cb.flash_attn_shape_of(fa).v_is_view_of_k
    assert cb.alloc_size("metal", fa) == cb.metal_fa_alloc_size(s)

    b = _T(op="VIEW", type=T.F32.value, ne=(2048, 1, 2048, 1), src=(), vs=None)
    ids = _T(op="VIEW", type=T.I32.value, ne=(8, 2048, 1, 1), src=(), vs=None)
    mmid = _T(op="MUL_MAT_ID", type=T.F32.value, ne=(512, 8, 2048, 1), src=(b, ids), vs=None, n_expert=256)
    assert cb.alloc_size("metal", mmid) == cb.metal_mul_mat_id_alloc_size(512, 8, 2048, 256)
    del mmid.n_expert
    with pytest.raises(ValueError):
        cb.alloc_size("metal", mmid)
