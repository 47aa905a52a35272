"""Jumps over part of a period (fitter.ggml.replay._jump, _BoundaryState) against running those layers or chunks.

replay_plan and replay_chunks jump over whole periods of layers (chunks) that repeat from a state met before; past the
whole periods, the part of one more that repeats lands on the state kept where that part ran before. The reference is
the same sweep with the part run instead (only whole periods jumped, as before); ggml-alloc.c against llama.cpp is
what the dry-run tests check.
"""

from __future__ import annotations

import pytest

from fitter.bundled import resolve_model
from fitter.ggml import replay
from tests.ggml.sweep import compute_sweep

SWEEP = ((4096, 512), (8192, 512), (4352, 1024), (33024, 512), (1024, 256), (8192, 2048), (131072, 512))


def _parts_equal_the_run(path: str, backend: str, monkeypatch: pytest.MonkeyPatch, **kw: int) -> int:
    """The sweep's compute buffers (peaks and terms included) with parts of periods jumped and with them run; returns
    how many parts were jumped."""
    landed = []
    restore = replay._BoundaryState.restore

    def counted(state: replay._BoundaryState, ga: replay.Gallocr, carried: list) -> None:
        landed.append(1)
        restore(state, ga, carried)

    monkeypatch.setattr(replay._BoundaryState, "restore", counted)
    got = compute_sweep(path, backend, SWEEP, **kw)
    jump = replay._jump
    monkeypatch.setattr(replay, "_jump", lambda sigs, prev, il, n, states: jump(sigs, prev, il, n, {}))
    n = len(landed)
    assert got == compute_sweep(path, backend, SWEEP, **kw)
    assert len(landed) == n  # none without the states
    return n


@pytest.mark.parametrize("backend", ["cpu", "cuda", "metal"])
def test_full_size_predictions_with_parts_of_periods_jumped_equal_the_run(backend: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.6-35B-A3B's shape: 40 layers, a period of 4 (three linear-attention layers, one full), layers (CPU, CUDA)
    or Metal's reordered chunks: two layers of a period past the whole ones."""
    from tests.synth.shapes import build_shape

    assert _parts_equal_the_run(str(build_shape("qwen36-35b-a3b")), backend, monkeypatch)


def test_gemma3_270m_metal_chunks_with_parts_of_periods_jumped_equal_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled Gemma 3 270M on Metal: 18 layers, five sliding-window layers to one global."""
    assert _parts_equal_the_run(resolve_model("gemma3-270m"), "metal", monkeypatch)


@pytest.mark.parametrize("mib", [16, 256])
def test_metal_buffers_in_chunks_with_parts_of_periods_jumped_equal_the_run(mib: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mac's maxBufferLength splits the compute buffer into chunks: the marks are then part of the state a jump
    lands on (the Qwen3.6 shape on Metal, buffers of at most 16 and 256 MiB)."""
    from tests.synth.shapes import build_shape

    assert _parts_equal_the_run(str(build_shape("qwen36-35b-a3b")), "metal", monkeypatch,
                                metal_max_buffer_length=mib << 20)
