"""A sweep of contexts and ubatches over one model's compute buffers, on traced graphs (their programs and periods run
again and again): what the tests that force the allocator's slower path (test_program_memo, test_period_jumps) compare
with the fast one."""

from __future__ import annotations

from fitter.cache import CACHES
from fitter.llama import context as C
from fitter.llama.cparams import ConfigError, Frontend, RunConfig, resolve_context
from fitter.llama.graph_details import graph_details
from fitter.llama.model import load_model_spec


def compute_sweep(path: str, backend: str, points: tuple[tuple[int, int], ...], *,
                  metal_max_buffer_length: int | None = None) -> list:
    """The compute buffers (peaks and terms included) at each (n_ctx, n_ubatch), f16 and q8_0 caches, from empty
    caches: every graph built and traced anew. `metal_max_buffer_length`: as compute_buffers' (buffers in chunks)."""
    header, spec = load_model_spec(path)
    d = graph_details(header)
    CACHES.clear("compute", "traced")
    out = []
    for kw in (dict(), dict(type_k="q8_0", type_v="q8_0", flash_attn="on")):
        for n_ctx, n_ubatch in points:
            try:
                cp = resolve_context(spec, RunConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, **kw), Frontend.SERVER)
            except ConfigError:  # a quantized cache the synthetic heads refuse
                continue
            out.append(C.compute_buffers(spec, cp, backend, details=d, metal_max_buffer_length=metal_max_buffer_length))
    return out
