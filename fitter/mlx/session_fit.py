"""`fit --engine mlx`'s session ceiling: the peak after N requests of one -c, the limit as N grows, what caps
it, and the --prompt-cache-bytes that makes it fit a budget (fitter.mlx.session replays the server).

mlx_lm.server (0.32.2) serves a request batched (BatchGenerator) unless --kv-bits, a draft model or a seed
makes it sequential (`_serve_single`); only the batched path trims the prompt cache to --prompt-cache-bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fitter.mlx.cache import layer_caches
from fitter.mlx.config import MlxModel
from fitter.mlx.memory import MlxPrediction, MlxRun, predict_mlx
from fitter.mlx.session import CPU_CACHE_LIMIT, Request, entry_bytes, request_peak, session_memory

SESSION_HORIZON = 4  # requests past --prompt-cache-size after which the replay has reached its limit


@dataclass(frozen=True)
class SessionCeiling:
    requests: int | None  # --session-requests (None: only the limit)
    prompt_tokens: int
    generated: int
    weights_bytes: int
    peak_bytes: int  # weights + the peak over `requests` requests
    limit_bytes: int  # weights + the peak however many requests come
    entries: int  # prompt-cache entries kept at the limit
    entry_bytes: int  # one entry as LRUPromptCache counts it (--prompt-cache-bytes compares this)
    entry_held_bytes: int  # what one entry keeps alive
    capped_by: str
    batched: bool
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated,
                "peak_bytes": self.peak_bytes, "limit_bytes": self.limit_bytes, "capped_by": self.capped_by,
                "prompt_cache_entries": self.entries, "entry_bytes": self.entry_bytes,
                "entry_held_bytes": self.entry_held_bytes, "batched": self.batched,
                "mlx_buffer_cache_bytes": CPU_CACHE_LIMIT, "notes": list(self.notes)}


@dataclass(frozen=True)
class CacheProposal:
    flag: str  # --prompt-cache-bytes (batched), or --prompt-cache-size (sequential, or no entry fits)
    value: int
    entries: int  # conversations it keeps
    limit_bytes: int


def _weights(pred: MlxPrediction) -> int:
    return sum(b.bytes for b in pred.buffers if b.counts and b.kind == "model")


def _batched(run: MlxRun, draft: MlxModel | None) -> bool:
    return draft is None and run.cache.kv_bits is None  # ResponseGenerator._is_batchable (no seed here)


def _sequential(model: MlxModel, run: MlxRun, pred: MlxPrediction, n: int, size: int) -> tuple[int, int, int]:
    """(peak above the weights after n requests, one entry's bytes, entries kept): generate_step's own cache
    objects are the entries (nbytes = their buffers), never trimmed by bytes."""
    one = sum(c.bytes for c in layer_caches(model.spec, run.cache, run.n_prompt, run.n_generated))
    one += sum(b.bytes for b in pred.buffers if b.owner == "draft" and b.kind in ("kv", "rs"))
    req = sum(b.bytes for b in pred.buffers if b.counts and b.kind in ("kv", "rs", "compute"))
    kept = min(max(n - 1, 0), size)
    return kept * one + (one if size == 0 and n > 1 else 0) + req, one, min(n, size)


def session_ceiling(model: MlxModel, run: MlxRun, draft: MlxModel | None = None, *, requests: int | None = None,
                    prompt_cache_size: int = 10) -> SessionCeiling:
    pred = predict_mlx(model, run, draft)
    w = _weights(pred)
    spec = model.spec
    horizon = prompt_cache_size + SESSION_HORIZON
    batched = _batched(run, draft)
    notes = []
    cap = run.prompt_cache_bytes
    if batched:
        reqs = [Request(run.n_prompt, run.n_generated)] * max(horizon, requests or 0)
        sm = session_memory(spec, run.cache, reqs, prompt_cache_size=prompt_cache_size, prompt_cache_bytes=cap)
        peak = sm.peak_after(requests) if requests else sm.peak
        limit, entries = sm.peak, sm.entries_after
        e = entry_bytes(spec, run.n_prompt + run.n_generated)
        held = request_peak(spec, run.cache, reqs[0]).held
    else:
        if cap is not None:
            notes.append("--prompt-cache-bytes has no effect here: mlx_lm.server serves --kv-bits and draft-model "
                         "requests one at a time (_serve_single), which never trims the prompt cache by bytes")
            cap = None
        peak, e, _ = _sequential(model, run, pred, requests or horizon, prompt_cache_size)
        limit, _, entries = _sequential(model, run, pred, horizon, prompt_cache_size)
        held = e
    if cap is not None:
        by = f"--prompt-cache-bytes {cap} ({entries} entries of {e} B)"
    else:
        by = f"--prompt-cache-size {prompt_cache_size} (entries of {e} B, no byte limit)"
    return SessionCeiling(requests, run.n_prompt, run.n_generated, w, w + peak, w + limit, entries, e, held, by,
                          batched, tuple(notes))


def propose_cap(model: MlxModel, run: MlxRun, available: int, draft: MlxModel | None = None, *,
                prompt_cache_size: int = 10) -> CacheProposal | None:
    """The largest --prompt-cache-bytes (whole entries of one request) whose session limit fits `available`
    (the sequential path ignores it: the largest --prompt-cache-size then); None when nothing fits."""
    if _batched(run, draft):
        e = entry_bytes(model.spec, run.n_prompt + run.n_generated)
        for k in range(prompt_cache_size, 0, -1):
            c = session_ceiling(model, replace(run, prompt_cache_bytes=k * e), draft,
                                prompt_cache_size=prompt_cache_size)
            if c.limit_bytes <= available:
                return CacheProposal("--prompt-cache-bytes", k * e, c.entries, c.limit_bytes)
    for n in range(prompt_cache_size - 1, -1, -1):
        c = session_ceiling(model, replace(run, prompt_cache_bytes=None), draft, prompt_cache_size=n)
        if c.limit_bytes <= available:
            return CacheProposal("--prompt-cache-size", n, c.entries, c.limit_bytes)
    return None
