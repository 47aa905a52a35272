"""mlx_lm.server's memory over a session (mlx-lm 0.32.2, mlx 0.32.4): what it keeps between requests
and the peak after N of them, replayed on shapes alone.

The rules, each from the function it mirrors:
- server.run: `LRUPromptCache(--prompt-cache-size)` (default 10 entries) and no byte bound of its own
  (max_bytes 1 << 63). `--prompt-cache-bytes` (default none) acts only in ResponseGenerator._generate's
  batched branch: before each request joins the batch, `trim_to(n_bytes=limit - active)`, active being
  `BatchGenerator.prompt_cache_nbytes` (the caches of the requests in the batch). `_serve_single` (the
  sequential path: `--kv-bits`, a draft model, a seed, images) never trims by bytes.
- LRUPromptCache.insert_cache: one "assistant" entry per finished request, keyed by its prompt and
  generated tokens; over `max_size` entries the oldest goes (CacheOrder.pop). Trimmable caches (KVCache)
  drop the entries that are prefixes of the new one. Its byte count is `sum(c.nbytes)`: shapes, not buffers.
- BatchKVCache.extract: the entry is `mx.contiguous(keys[..., padding:_idx])`, left unevaluated: it keeps
  the generation's whole buffer alive (KVCache steps of 256 slots) while its nbytes counts only the tokens.
  A later hit evaluates it (fetch_nearest_cache's deepcopy) and frees the buffer: entries a later request
  started from hold their tokens only.
- fetch_nearest_cache: a prompt sharing a prefix with an entry starts from a deep copy of it, trimmed
  (KVCache.trim moves the offset only); BatchKVCache.merge copies that prefix into a new buffer of exactly
  the prefix's slots, which then grows by steps of 256.
- BatchGenerator._next: when the prompt is done, `PromptProcessingBatch.split` deep-copies the batch's cache
  (`_copy`) and clears the original: mlx donates its buffers to the copy (measured: no second copy).
  The generation thread's locals keep the last finished response (`r.prompt_cache`) until the next request
  decodes: one more cache when the LRU holds none (`--prompt-cache-size 0`). Between requests one more
  generation buffer stays alive (measured, CPU backend); it is gone by the next request's prefill peak.
- mlx's allocator: `mx.get_peak_memory()` counts live arrays only. Freed buffers go to its buffer cache
  (mx.get_cache_memory) up to `mx.set_cache_limit`, 32 MiB by default on the CPU backend
  (no_gpu/allocator.cpp); the server calls `mx.clear_cache()` after every prefill chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fitter.errors import GGFitError
from fitter.mlx.activations import chunk_bytes
from fitter.mlx.cache import CacheSettings, _kv_grow, arrays_cache_bytes
from fitter.mlx.config import MlxSpec

CPU_CACHE_LIMIT = 32 << 20  # mlx no_gpu/allocator.cpp: CommonAllocator's cache_limit_ default


def kv_token_bytes(spec: MlxSpec) -> int:
    """K and V of one token in every attention layer (KVCache in the activations' dtype)."""
    return spec.n_attention * spec.n_kv_heads * spec.head_dim * 2 * spec.act_bytes


def _fixed_bytes(spec: MlxSpec) -> int:
    return (len(spec.layers) - spec.n_attention) * arrays_cache_bytes(spec)


def entry_bytes(spec: MlxSpec, tokens: int) -> int:
    """One entry as LRUPromptCache counts it (nbytes): `tokens` slots and the linear layers' states."""
    return tokens * kv_token_bytes(spec) + _fixed_bytes(spec)


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    generated: int  # completion tokens
    cached: int = 0  # prompt tokens served from an entry (a shared prefix)


@dataclass(frozen=True)
class RequestMemory:
    held: int  # bytes the server keeps from earlier requests while this one runs
    peak: int  # this request's own peak on top of `held`
    entries: int  # prompt-cache entries while it runs


@dataclass
class SessionMemory:
    requests: list[RequestMemory] = field(default_factory=list)
    entries_after: int = 0
    entry_nbytes_after: int = 0  # the LRU's own count after the last request

    @property
    def peak(self) -> int:
        """The session's peak above the weights."""
        return max((r.held + r.peak for r in self.requests), default=0)

    def peak_after(self, n: int) -> int:
        return max((r.held + r.peak for r in self.requests[:n]), default=0)


def _capacity(start: int, calls: list[int]) -> int:
    """Slots of a (Batch)KVCache that starts from `start` merged slots after model calls of these sizes."""
    cap = offset = start
    for n in calls:
        cap = _kv_grow(cap, offset, n)
        offset += n
    return cap


def _prefill_calls(n: int, step: int) -> list[int]:
    """BatchGenerator._next: the prompt but its last token, in chunks of --prefill-step-size."""
    out = []
    while n > 0:
        out.append(min(step, n))
        n -= out[-1]
    return out


def request_peak(spec: MlxSpec, s: CacheSettings, r: Request) -> tuple[int, int]:
    """(peak above what the server held before, bytes this request's entry holds afterwards): the worst
    prefill chunk (its working set and its cache, grown from the cached prefix's exact slots) and the
    generation's buffer that the entry keeps."""
    tok, fixed = kv_token_bytes(spec), _fixed_bytes(spec)
    start = r.cached if r.cached else 0
    calls = _prefill_calls(r.prompt_tokens - start - 1, s.prefill_step_size)
    worst, done = 0, start
    for i, n in enumerate(calls):
        cache = _capacity(start, calls[: i + 1]) * tok + fixed
        worst = max(worst, cache + chunk_bytes(spec, n, done + n))
        done += n
    # PromptProcessingBatch._copy's deep copy is donated the original's buffers (measured: no second copy)
    # the generation writes the last prompt token and every generated one (the last one ahead, async)
    held = _capacity(start, [*calls, 1, *([1] * r.generated)]) * tok + fixed
    return max(worst, held), held


@dataclass
class _Entry:
    tokens: int
    nbytes: int  # what LRUPromptCache counts
    held: int  # what it keeps alive (the generation's buffer until a hit evaluates it)


def session_memory(spec: MlxSpec, s: CacheSettings, requests: list[Request], *, prompt_cache_size: int = 10,
                   prompt_cache_bytes: int | None = None) -> SessionMemory:
    """Replay a session of sequential requests through LRUPromptCache (the batched path, one at a time)."""
    if prompt_cache_size < 0:
        raise GGFitError(f"--prompt-cache-size {prompt_cache_size}: must be at least 0")
    lru: deque[_Entry] = deque()
    last: _Entry | None = None  # the previous response, alive in the generation thread's locals
    out = SessionMemory()
    trimmable = spec.n_attention == len(spec.layers)  # can_trim_prompt_cache: ArraysCache is not
    for r in requests:
        fetched = 0
        hit = lru[-1] if r.cached and lru else None  # the latest conversation with this prefix
        if hit is not None:
            hit.held = hit.nbytes  # deepcopy evaluates the entry: its generation buffer goes
            fetched = hit.nbytes  # the copy is in the batch: BatchGenerator.prompt_cache_nbytes
        if prompt_cache_bytes is not None:  # ResponseGenerator._generate: trim_to(limit - active)
            while lru and sum(e.nbytes for e in lru) > prompt_cache_bytes - fetched:
                lru.popleft()
        held = sum(e.held for e in lru) + (last.held if last is not None and all(e is not last for e in lru) else 0)
        peak, kept = request_peak(spec, s, r)
        out.requests.append(RequestMemory(held, peak, len(lru)))
        tokens = r.prompt_tokens + r.generated
        last = _Entry(tokens, entry_bytes(spec, tokens), kept)
        if trimmable and hit is not None and hit.tokens <= r.cached:
            lru.remove(hit)  # insert_cache: pop_prefixes drops the entry the new one extends
        lru.append(last)
        if len(lru) > prompt_cache_size:
            lru.popleft()
    out.entries_after = len(lru)
    out.entry_nbytes_after = sum(e.nbytes for e in lru)
    return out
