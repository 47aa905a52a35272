"""An mmproj's buffers against the pinned libmtmd's own allocations (tests/mtmd/oracle.py), byte for byte."""

from __future__ import annotations

import pytest

from fitter.ggml.backends.base import Backend
from fitter.gguf.reader import read_header
from fitter.mtmd.memory import mmproj_buffers
from tests.mtmd import oracle
from tests.synth.mmproj import FULL_SHAPES, build_mmproj

pytestmark = pytest.mark.skipif(oracle.binary() is None, reason="no libmtmd oracle (a C++ compiler, libmtmd and the pinned headers)")

CASES = [
    # (projector, synthetic overrides, -fa)
    ("gemma3", {}, "auto"),
    ("gemma3", {}, "off"),
    ("gemma3", {"image_size": 448, "ftype": "q8_0", "n_embd": 96, "n_ff": 256}, "auto"),  # 32 patches a side
    ("gemma3", {"image_size": 336, "n_merge": 2}, "off"),  # the tinygemma3 scale factor key
    ("qwen25vl", {}, "auto"),
    ("qwen25vl", {}, "off"),
    ("qwen25vl", {"patch_size": 16, "n_wa_pattern": 0, "ftype": "q8_0", "n_embd": 128, "n_ff": 256}, "auto"),
    ("qwen25vl", {"v2": True}, "off"),  # Qwen2-VL: layer norm, quick GELU, no window attention
    ("qwen3vl", {}, "auto"),  # 48x48 learned positions interpolated to the 92x92-patch warmup image
    ("qwen3vl", {}, "off"),
    ("qwen3vl", {"n_pos_side": 92, "deepstack": (), "ftype": "q8_0", "n_embd": 128, "n_ff": 256}, "auto"),
    ("gemma4v", {}, "auto"),  # clamp scalars in the file: read by clip, not in the weight buffer
    ("gemma4v", {}, "off"),
    ("gemma4v", {"std": False, "pos_size": 128, "ftype": "q8_0", "n_embd": 128, "n_ff": 256}, "auto"),
    ("pixtral", {}, "auto"),  # Mistral Small 3.1: the patch merger, [IMG_BREAK] after each row
    ("pixtral", {}, "off"),
    ("pixtral", {"merger": False, "ftype": "q8_0", "n_embd": 128, "n_ff": 256}, "auto"),  # Pixtral 12B
    # released models' vision towers, full size (sparse files: clip reads zeros)
    *((k, {**o, "sparse": True}, "auto") for k, o in FULL_SHAPES.values()),
    ("gemma3", {**FULL_SHAPES["gemma3-27b"][1], "sparse": True}, "off"),
]


@pytest.mark.parametrize("kind,over,fa", CASES, ids=[f"{k}-{i}-fa_{fa}" for i, (k, _, fa) in enumerate(CASES)])
def test_cpu_buffers_exact(kind: str, over: dict, fa: str) -> None:
    path = str(build_mmproj(kind, **over))
    ref = oracle.run(path, fa)
    rows = mmproj_buffers(read_header(path), path, Backend.CPU, flash_attn=fa)
    model = [r for r in rows if r.kind == "model"]
    compute = [r for r in rows if r.kind == "compute"]
    assert [(r.device, r.bytes) for r in model] == [ref.allocs[0]]
    # the compute buffer: gallocr's last (largest) reservation on the CPU
    assert compute[0].bytes == max(b for _, b in ref.allocs[1:])
    assert [(n, round(compute[0].bytes / 2**20, 2)) for n, _ in ref.compute_lines[-1:]] == ref.compute_lines[-1:]
    assert f"{ref.warmup_size}x{ref.warmup_size}" in compute[0].detail
    assert ("flash attention on" in compute[0].detail) == ref.flash_attn


def test_a_projector_type_not_mirrored_counts_its_weights_and_says_so() -> None:
    path = str(build_mmproj("gemma3", projector_type="idefics3"))  # SigLIP too, but idefics3's pixel shuffle
    rows = mmproj_buffers(read_header(path), path, Backend.CPU)
    assert [(r.kind, r.bytes) for r in rows] == [("model", 274688)]  # the same tensors as the gemma3 file above
    assert "its compute buffer is not modelled (idefics3 graph)" in rows[0].detail


def test_an_audio_encoder_in_the_file_is_said() -> None:
    path = str(build_mmproj("gemma4v", audio=True))
    rows = mmproj_buffers(read_header(path), path, Backend.CPU)
    assert "with an audio encoder, whose compute buffer is not modelled" in rows[0].detail


# patch size 4: the largest image (64 x 64 merged tokens for Qwen, 33 x 33 pooled for Gemma 4) stays cheap to encode
LARGEST = [("qwen25vl", {"n_layer": 2, "patch_size": 4}), ("qwen3vl", {"patch_size": 4, "n_layer": 2, "deepstack": (1,)}),
           ("gemma4v", {"patch_size": 4, "pos_size": 128}), ("pixtral", {"patch_size": 4})]


@pytest.mark.parametrize("kind,over", LARGEST, ids=[k for k, _ in LARGEST])
def test_the_largest_image_grows_the_compute_buffer_as_said(kind: str, over: dict) -> None:
    path = str(build_mmproj(kind, **over))
    compute = mmproj_buffers(read_header(path), path, Backend.CPU)[1]
    side = int(compute.detail.split("an image up to ")[1].split("x")[0])
    ref = oracle.run(path, "auto", encode=side)  # clip_image_encode of one side x side image after the warmup
    assert compute.bytes == ref.allocs[1][1] and compute.grows_to == ref.grown[-1][1] > compute.bytes
