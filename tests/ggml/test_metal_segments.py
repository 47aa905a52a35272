"""Metal's reorder over segments and its chunks (fitter.ggml.backends.metal.segments) against the whole graph.

Building every layer and reordering the graph whole (context._flatten, checked node for node against llama.cpp by
test_graph_nodes) is the reference; the chunks must give the same compute buffers, byte for byte, on every
architecture, for both reorder eras, and say when they cannot stand for the whole graph.
"""

from __future__ import annotations

import pytest

from fitter.cache import CACHES
from fitter.fit.memory import predict
from fitter.ggml.backends.metal import backend as metal
from fitter.ggml.backends.metal import segments as metal_segments
from fitter.llama.cparams import Backend, ConfigError, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from fitter.llama_builds import resolve_build
from tests.synth import build

ARCHS = ("llama", "qwen2", "qwen3", "phi3", "mistral3", "gemma2", "gemma3", "gemma4", "qwen3moe", "qwen35",
         "qwen35moe", "qwen3next", "gpt-oss", "deepseek2", "glm4moe")
# the synthetic gated delta nets have heads Metal's kernel does not take: that op runs on the CPU, so the layers are
# not one Metal split and the whole graph is built (the full-size shapes below take the chunks)
SPLIT = {"qwen35", "qwen35moe", "qwen3next"}
CONFIGS = (
    RunConfig(n_ctx=4096, n_ubatch=512),
    RunConfig(n_ctx=8192, n_ubatch=2048, type_k="q8_0", type_v="q8_0"),
    RunConfig(n_ctx=2048, n_ubatch=256, flash_attn="off", n_parallel=1),
    RunConfig(n_ctx=4096, n_ubatch=1, type_k="q4_0", type_v="q4_0"),
)


def _compute(path: str, cfg: RunConfig, release: str | None) -> list[tuple[str, int]] | str:
    CACHES.clear("compute", "traced")
    header, spec = load_model_spec(path)
    kw = {"build": resolve_build(release)} if release else {}
    try:
        p = predict(header, spec, cfg, Backend.METAL, Frontend.SERVER, calibrated=False, **kw)
    except ConfigError as e:  # a quantized cache on the small synthetic heads: refused alike
        return str(e)
    return [(b.device, b.bytes) for b in p.buffers if b.kind == "compute"]


def _both(path: str, cfgs: tuple[RunConfig, ...] | list[RunConfig], release: str | None,
          monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, list[bool]]:
    """The compute buffers with the chunks, then with the whole graph; and whether each build took the chunks."""
    taken: list[bool] = []
    inner = metal_segments.optimize_segments

    def spy(*args: object) -> object:
        out = inner(*args)  # type: ignore[arg-type]
        taken.append(out is not None)
        return out

    monkeypatch.setattr(metal, "optimize_segments", spy)
    chunked = [_compute(path, cfg, release) for cfg in cfgs]
    monkeypatch.setattr(metal, "optimize_segments", lambda *args: None)
    whole = [_compute(path, cfg, release) for cfg in cfgs]
    return chunked, whole, taken


@pytest.mark.parametrize("release", [None, "0.3.23"])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_allocate_as_the_whole_graph(arch: str, release: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    chunked, whole, taken = _both(str(build(arch)), CONFIGS, release, monkeypatch)
    assert chunked == whole
    assert any(taken) == (arch not in SPLIT), taken


@pytest.mark.parametrize("shape", ["qwen36-35b-a3b", "gpt-oss-20b", "gemma3-27b"])
def test_full_size_shapes(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Released models' shapes (sparse header-only files), quantized caches included."""
    from tests.synth.shapes import build_shape

    cfgs = [RunConfig(n_ctx=c, n_ubatch=u, type_k=k, type_v=k) for c, u, k in
            ((8192, 512, "f16"), (65536, 2048, "q8_0"), (32768, 4096, "q4_0"))]
    chunked, whole, taken = _both(str(build_shape(shape)), cfgs, None, monkeypatch)
    assert chunked == whole
    assert taken and all(taken)


def test_layers_split_over_the_cpu_are_built_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight on the CPU splits the layers: the chunks say so, and the whole graph is reordered."""
    cfgs = [RunConfig(n_ctx=4096, n_ubatch=512, n_cpu_moe=2)]
    chunked, whole, taken = _both(str(build("qwen3moe")), cfgs, None, monkeypatch)
    assert taken == [False]
    assert chunked == whole and isinstance(chunked[0], list) and chunked[0]
