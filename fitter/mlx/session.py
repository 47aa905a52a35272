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
- BatchGenerator._next / ResponseGenerator._generate: when the prompt but its last token is done, its cache
  is extracted and inserted as an entry ("end of segment"); `PromptProcessingBatch.split` deep-copies the
  batch's cache for the generation. A trimmable final entry then pops that prefix entry; an ArraysCache
  model (not trimmable) keeps both: two entries a request.
  The generation thread's locals keep the last finished response (`r.prompt_cache`) until the next request
  decodes: one more cache when the LRU holds none (`--prompt-cache-size 0`). Between requests one more
  generation buffer stays alive (measured, CPU backend); it is gone by the next request's prefill peak.
- mlx's allocator: `mx.get_peak_memory()` counts live arrays only. Freed buffers go to its buffer cache
  (mx.get_cache_memory) up to `mx.set_cache_limit`, 32 MiB by default on the CPU backend
  (no_gpu/allocator.cpp); the server calls `mx.clear_cache()` after every prefill chunk. On Metal
  (metal/allocator.cpp, read at a 2024 commit, not at the pin) the cache limit defaults to 1.5 x
  recommendedMaxWorkingSetSize: bounded only by memory pressure (gc_limit 0.95 x). Not modelled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fitter.errors import GGFitError
from fitter.mlx.activations import chunk_bytes
from fitter.mlx.cache import CacheSettings, _kv_grow, arrays_cache_bytes
from fitter.mlx.config import MlxSpec

CPU_CACHE_LIMIT = 32 << 20  # mlx no_gpu/allocator.cpp: CommonAllocator's cache_limit_ default
# Measured, not traced to a line (CPU backend, tiny qwen3_5, one request in-process): a batched prefill of an
# ArraysCache model peaks 297 KB (64 tokens) and 322 KB (256) above generate_step's, for 206 KB of states.
BATCHED_STATE_COPIES = 1


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


def _state_bytes(spec: MlxSpec) -> int:
    """The linear layers' float32 recurrent states (n_v_heads x Dv x Dk each)."""
    n_lin = len(spec.layers) - spec.n_attention
    return n_lin * spec.linear_num_v_heads * spec.linear_v_head_dim * spec.linear_k_head_dim * 4


@dataclass(frozen=True)
class RequestCost:
    peak: int  # above what the server held before the request
    held: int  # what its final entry keeps alive
    prefix_held: int  # what the entry at the end of its prompt keeps (ArraysCache models keep it)


def request_peak(spec: MlxSpec, s: CacheSettings, r: Request) -> RequestCost:
    """The worst prefill chunk (its working set and its cache, grown from the cached prefix's exact slots);
    then the prompt's entry (BatchGenerator extracts it at the end of the prompt's first segment, all but
    its last token), which keeps the prefill's buffer while the generation writes a copy; and the generation's
    buffer that the final entry keeps."""
    tok, fixed = kv_token_bytes(spec), _fixed_bytes(spec)
    start = r.cached if r.cached else 0
    calls = _prefill_calls(r.prompt_tokens - start - 1, s.prefill_step_size)
    worst, done = 0, start
    for i, n in enumerate(calls):
        cache = _capacity(start, calls[: i + 1]) * tok + fixed
        worst = max(worst, cache + chunk_bytes(spec, n, done + n) + BATCHED_STATE_COPIES * fixed)
        done += n
    prefix = _capacity(start, calls) * tok + fixed
    # the generation writes the last prompt token and every generated one (the last one ahead, async); measured:
    # each request keeps one more copy of the recurrent states (ArraysCache models, 3-4 KB off at P 64 and 256)
    held = _capacity(start, [*calls, 1, *([1] * r.generated)]) * tok + fixed + _state_bytes(spec)
    split = prefix + _capacity(start, calls) * tok + fixed if calls else 0  # the prompt's entry and the batch's copy
    return RequestCost(max(worst, split, held), held, prefix if calls else 0)


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
        cost = request_peak(spec, s, r)
        out.requests.append(RequestMemory(held, cost.peak, len(lru)))
        if not trimmable and cost.prefix_held:  # the prompt's entry stays (a trimmable one is popped as a prefix)
            lru.append(_Entry(r.prompt_tokens - 1, entry_bytes(spec, r.prompt_tokens - 1), cost.prefix_held))
            if len(lru) > prompt_cache_size:
                lru.popleft()
        tokens = r.prompt_tokens + r.generated
        last = _Entry(tokens, entry_bytes(spec, tokens), cost.held)
        if trimmable and hit is not None and hit.tokens <= r.cached:
            lru.remove(hit)  # insert_cache: pop_prefixes drops the entry the new one extends
        lru.append(last)
        if len(lru) > prompt_cache_size:
            lru.popleft()
    out.entries_after = len(lru)
    out.entry_nbytes_after = sum(e.nbytes for e in lru)
    return out
