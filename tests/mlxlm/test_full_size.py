"""Full-size checkpoints predicted from their headers alone (tests/mlxlm/full_size.py), against the
published sizes of mlx-community/Qwen3.8-27B-4bit, -8bit and -MTP-4bit and of the Qwen3.6-35B-A3B 4-bit.

Sources (each figure is checked at the precision it was published, in the unit it was published in):
- github.com/NathanMaine/qwen-mlx-offline docs/BENCHMARKS.md §2 (measured with mlx-vlm 0.6.14):
  disk 16.1 GB / 28 GB / 253 MB, resident 15.5-15.7 GB / 28.1-28.4 GB under mlx_vlm.server with the
  MTP drafter; §3.1: the converted checkpoints hold no mtp.* tensor; §3.3: ~27 GB for the 8-bit under
  mlx_lm.server;
- the same repository's VERSIONS.md: the Hub API's sum of *.safetensors at pinned revisions,
  16.05 GB / 29.50 GB / 0.24 GB.
The on-disk figures are 1e9 bytes (VERSIONS.md to the hundredth of a GB; 16.1 GB rounds 16.054). The
resident figures are 2^30 bytes: in 1e9 the 4-bit's weights alone (16.29 GB) would exceed its 15.5-15.7
GB; in 2^30 both builds sit 0.4-0.5 GiB above their weights, one runtime overhead this does not model.
"""

from __future__ import annotations

import math

import pytest

from fitter.errors import UnsupportedModelError
from fitter.mlx.cache import CacheSettings
from fitter.mlx.config import load_mlx_model
from fitter.mlx.memory import MlxRun, predict_mlx
from fitter.mlx.safetensors import read_safetensors_header
from fitter.mlx.weights import weight_bytes

GIB = 2**30


@pytest.fixture(scope="module")
def root(tmp_path_factory, mlx_model):
    return tmp_path_factory.mktemp("full")


@pytest.fixture(scope="module")
def full(root):
    from tests.mlxlm.full_size import write

    return lambda name, bits: load_mlx_model(str(write(name, bits, root)))


@pytest.fixture(scope="module")
def drafter(root):
    from tests.mlxlm.full_size import write_drafter

    return write_drafter("qwen3.8-27b", 4, root)


def _drafter_bytes(d) -> int:
    return sum(t.nbytes for t in read_safetensors_header(str(d / "model.safetensors")).values())


def test_qwen38_27b_4bit_on_disk_and_resident(full):
    m = full("qwen3.8-27b", 4)
    w = weight_bytes(m.spec, m.tensors)
    assert w.resident == 15_132_806_656  # the text model mlx-lm loads (4.5 bits a weight)
    assert w.dropped == w.vision == 921_460_192  # the bf16 vision tower (460,730,096 parameters): sanitize drops it
    assert w.mtp == 0  # mlx_vlm.convert stripped the MTP head (BENCHMARKS.md §3.1: 0 matches)
    assert w.on_disk == 16_054_266_848
    assert 16.05e9 <= w.on_disk < 16.15e9  # "16.1 GB" on disk
    assert 16.045e9 <= w.on_disk < 16.055e9  # VERSIONS.md: 16.05 GB
    assert 16.05e9 <= m.file_bytes < 16.15e9  # the file itself, its header included
    p = predict_mlx(m, MlxRun(n_ctx=4096))
    off = [b for b in p.buffers if b.kind == "model" and not b.counts]
    assert [b.bytes for b in off] == [w.dropped] and "vision tower" in off[0].detail
    assert sum(b.bytes for b in p.buffers if b.kind == "model" and b.counts) == w.resident


def test_qwen38_27b_8bit_on_disk(full):
    m = full("qwen3.8-27b", 8)
    w = weight_bytes(m.spec, m.tensors)
    assert w.on_disk == 29_500_943_328
    assert 29.495e9 <= w.on_disk < 29.505e9  # VERSIONS.md: 29.50 GB
    # BENCHMARKS.md's "28 GB" is these bytes in GiB (27.47) rounded up, as `du -h` rounds
    assert math.ceil(w.on_disk / GIB) == 28
    # under mlx_lm.server (the text model only): "~27 GB" (BENCHMARKS.md §3.3), 26.62 GiB
    assert w.resident == 28_579_483_136 and round(w.resident / GIB) == 27


def test_mtp_drafter(drafter):
    n = _drafter_bytes(drafter)
    assert n == 238_930_944  # 4-bit groups of 64: fc, q/k/v/o and the MLP; bf16 norms (31 tensors)
    assert len(read_safetensors_header(str(drafter / "model.safetensors"))) == 31
    assert 0.235e9 <= n < 0.245e9  # VERSIONS.md: 0.24 GB of *.safetensors
    # BENCHMARKS.md's 253 MB is 14 MB more: presumably the directory, where the splitter also copies
    # tokenizer.json, vocab.json and tokenizer_config.json (mtp_split.MTPSplitter.tokenizer_files); not checked
    with pytest.raises(UnsupportedModelError, match="an MTP drafter .*cannot load it as --draft-model"):
        load_mlx_model(str(drafter))


def test_qwen38_27b_resident_under_mlx_vlm(full, drafter):
    """mlx_vlm.server with the drafter keeps the files' every tensor (its sanitize drops only mtp.*, absent
    here) plus the drafter's: published 15.5-15.7 GiB (4-bit) and 28.1-28.4 GiB (8-bit)."""
    gaps = []
    for bits, (lo, hi) in ((4, (15.5, 15.7)), (8, (28.1, 28.4))):
        m = full("qwen3.8-27b", bits)
        weights = weight_bytes(m.spec, m.tensors).on_disk + _drafter_bytes(drafter)
        gaps.append((lo - weights / GIB, hi - weights / GIB))
    assert gaps[0][0] == pytest.approx(0.326, abs=1e-3) and gaps[1][0] == pytest.approx(0.403, abs=1e-3)
    assert all(0 < g < 0.75 for gap in gaps for g in gap)
    assert max(g[0] for g in gaps) < min(g[1] for g in gaps)  # one overhead (0.40-0.53 GiB) fits both


def test_qwen38_27b_cache(full):
    q4 = full("qwen3.8-27b", 4)
    assert q4.spec.layers.count("linear") == 48 and q4.spec.n_attention == 16
    # 16 attention layers x 4 KV heads x 256 x (K, V) x bf16 per token; 48 linear layers' fixed state
    p = predict_mlx(q4, MlxRun(n_ctx=32768, cache=CacheSettings()))
    assert p.by_kind("kv") == 16 * 4 * 256 * 2 * 2 * 32768
    assert p.by_kind("rs") == 48 * (3 * (2 * 16 * 128 + 48 * 128) * 2 + 48 * 128 * 128 * 4)
    p8 = predict_mlx(q4, MlxRun(n_ctx=32768, cache=CacheSettings(kv_bits=8, quantized_kv_start=0)))
    assert p8.by_kind("kv") == 16 * 4 * 32768 * (256 + 2 * 4 * 2) * 2  # 8-bit words + bf16 scale, bias / 64


def test_qwen36_35b_a3b(full):
    m = full("qwen3.6-35b-a3b", 4)
    w = weight_bytes(m.spec, m.tensors)
    assert m.spec.num_experts == 256 and m.spec.n_attention == 10
    # the router gates stay 8-bit: 40 layers x (mlp.gate, mlp.shared_expert_gate) overrides in config.json
    q = m.spec.config["quantization"]
    assert sum(isinstance(v, dict) and v["bits"] == 8 for v in q.values()) == 80
    assert w.resident == 19_508_789_376 and w.dropped == w.vision == 893_142_496
    assert w.on_disk == 20_401_931_872
    assert 19.5e9 <= w.on_disk < 20.5e9  # "Uniform MLX 4-bit: 20 GB" (thetom-ai/Qwen3.6-35B-A3B-ConfigI-MLX)
    assert 18.5 <= w.on_disk / GIB < 19.5  # "mlx-community/*-4bit: 19 GB" on disk (varjosoft/Qwen3.6-35B-A3B-TQ-apex)
