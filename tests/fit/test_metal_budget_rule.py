"""Which buffers count against a Metal budget, one rule for `fit` and `quants` (issue 49, item 8).

llama.cpp keeps the input layer (the token embedding) on the CPU (llama_model::load_tensors: dev_input is the CPU with
the CPU buffer types; Metal has no host buffer type, ggml_backend_metal_device_i.get_host_buffer_type = NULL), so with
mmap it is a CPU_Mapped buffer: plain mapped file pages, not a Metal buffer, outside recommendedMaxWorkingSetSize. The
Metal tensors get one MTL0_Mapped buffer per file spanning their file range (get_mapping_range: first to last byte,
ggml_backend_metal_device_buffer_mapped wraps it with newBufferWithBytesNoCopy), which holds the token embedding's
bytes too when the file puts it between them, as llama-quantize does (weights_map order: output.weight,
output_norm.weight, token_embd.weight, blk.0 ...). The converter writes token_embd first, outside the range.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.oracle.user_log import read_user_log
from tests.fit.test_seed_figures import seed_file, twin

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "tests" / "data" / "llama_logs"
MiB = 2**20
METAL = ("--backend", "metal", "--budget", "24576MiB", "--llama-build", "b9430", "-np", "1", "--json")


def _cli(*args: str) -> dict:
    r = subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


def test_the_metal_range_holds_the_token_embedding_in_a_quantized_file():
    """llama.cpp's numbers: unsloth's Qwen3.5-9B Q4_K_S on b8999 prints MTL0_Mapped 5,133.75 MiB while its breakdown
    counts 4,588 MiB of Metal tensors (ggml_backend_alloc_ctx_tensors_from_buft_size in the fit pass): the 545.75 MiB
    between them are the 545.62 MiB CPU_Mapped token embedding (and the breakdown's rounding)."""
    log = read_user_log(LOGS / "03-metal-b8999.log")
    printed = {b: n / MiB for k, b, n in log.buffers() if k == "model"}
    mtl = next(r for r in log.breakdown if r.name == "MTL0")
    assert abs(printed["MTL0_Mapped"] - mtl.model_mib - printed["CPU_Mapped"]) <= 0.5, (printed, mtl.model_mib)


@pytest.mark.parametrize("layout", ["llama-quantize", "converter"])
def test_fit_counts_the_metal_range_and_never_cpu_mapped(layout):
    path = seed_file("qwen36-35b-a3b", "Q4_K_M", n_nextn=0) if layout == "llama-quantize" else \
        twin("qwen36-35b-a3b", "Q4_K_M", n_nextn=0)
    out = _cli("fit", path, "-c", "65536", *METAL)
    rows = {b["device"]: b for b in out["buffers"] if b["kind"] == "model"}
    cpu, mtl = rows["CPU_Mapped"], rows["MTL0_Mapped"]
    assert not cpu["counts"] and mtl["counts"] and cpu["bytes"] == 286064640  # token_embd, 248,320 x 2,048 Q6_K
    inside = mtl["bytes"] - mtl["tensor_bytes"]  # bytes of the range that are no Metal tensor's
    assert (cpu["bytes"] <= inside < cpu["bytes"] + 4096) if layout == "llama-quantize" else inside < 4096, inside
    assert out["total_device_bytes"] == sum(b["bytes"] for b in out["buffers"] if b["counts"])
    said = "272.81 MiB of other buffers' tensors between them in the file" in mtl["detail"]
    assert said is (layout == "llama-quantize"), mtl["detail"]  # the table says what the range holds besides


CONFIGS = [("-ub", "2048", "-ctk", "q8_0", "-ctv", "q8_0"), ("-ub", "2048"), ("-ub", "512", "-ctk", "q4_0", "-ctv", "q4_0")]


@pytest.mark.parametrize("layout", ["llama-quantize", "converter"])
@pytest.mark.parametrize("flags", CONFIGS, ids=" ".join)
def test_fit_and_quants_agree_on_metal(layout, flags):
    """The same file and config: `quants`' row of the file's own quant is the file as `fit` reads it (the same
    total, headroom and largest context), whichever layout the file has."""
    path = seed_file("qwen36-35b-a3b", "Q4_K_M", n_nextn=0) if layout == "llama-quantize" else \
        twin("qwen36-35b-a3b", "Q4_K_M", n_nextn=0)
    fit = _cli("fit", path, "-c", "262144", *flags, *METAL)
    quants = _cli("quants", path, "-c", "262144", *flags, *METAL)
    row = next(c for c in quants["candidates"] if c["source"] == "this file")
    assert row["name"] == "Q4_K_M"
    assert (row["total_device_bytes"], row["headroom_bytes"]) == (fit["total_device_bytes"], fit["headroom_bytes"])
    assert quants["margin_bytes"] == fit["margin_bytes"]
    table = _cli("fit", path, *flags, *METAL)  # no -c: the largest context at these settings
    ub, tk = int(flags[1]), flags[3] if "-ctk" in flags else "f16"
    largest = next(s["n_ctx"] for s in table["solutions"] if s["n_ubatch"] == ub and s["type_k"] == tk and not s["draft"])
    assert row["largest_ctx"] == largest, (row["largest_ctx"], largest)
