"""What llama-server allocates after load, over a session of requests: its host prompt cache and context checkpoints.

Mirrors tools/server of the pinned build (0c1e57098bba):
- `--cache-ram N` (common_params::cache_ram_mib, default 8192 MiB; -1 no size limit; 0 off): server_prompt_cache
  (server-task.cpp). alloc() skips a state larger than the limit, evicts the oldest entries until the new one fits,
  then stores the slot's whole sequence state (llama_state_seq_get_size_ext, flags NONE) and a copy of its
  checkpoints; update() evicts the oldest while size() > limit and while the cached tokens exceed
  max(n_ctx, limit / bytes per token), so with -1 the cache holds at most n_ctx tokens (limit_tokens = n_ctx).
- `--cache-idle-slots` (default on, off when --cache-ram 0): server_context::process_single_task saves every
  idle slot into the cache when a task starts, and clears it when the KV cache is unified (`-np` auto: 4 slots,
  unified); get_available_slot saves the LRU slot it takes (update_cache) and loads the most similar entry.
- `--ctx-checkpoints N` (n_ctx_checkpoints, default 32, per slot) and `--checkpoint-min-step` (8192):
  server_context::create_checkpoint stores llama_state_seq_get_size_ext(.., PARTIAL_ONLY) (the SWA cache or the
  recurrent state) before the batch that starts 4 + n_ubatch and 4 tokens before the prompt's end
  (update_slots, checkpoint_offsets), for SWA (without --swa-full) and recurrent / hybrid models only.
All of it is std::vector in host memory (the state is copied out of the device buffers): on a discrete GPU it
counts against the host RAM, on a unified-memory Mac against the same RAM the Metal working set lives in.
The model: distinct prompts (no shared prefix), one at a time, each of `prompt` tokens and `gen` generated.
"""

from __future__ import annotations

from collections import deque
from dataclasses import field

from fitter.llama.cparams import ContextParams
from fitter.llama.hparams import ModelSpec
from fitter.record import Record
from fitter.session.state import checkpoints_apply, seq_state_bytes

MIB = 1 << 20
TOKEN_BYTES = 4  # llama_token in server_tokens (the cache keeps a copy of the entry's tokens)


class CacheFlags(Record):
    """llama-server's flags for what it keeps after load (common_params defaults of the pinned build)."""

    cache_ram_mib: int = 8192  # --cache-ram: -1 no size limit, 0 off
    ctx_checkpoints: int = 32  # --ctx-checkpoints (per slot)
    checkpoint_min_step: int = 8192  # --checkpoint-min-step
    cache_idle_slots: bool = True  # --cache-idle-slots / --no-cache-idle-slots

    def args(self) -> list[str]:
        """The llama-server flags that differ from the defaults."""
        d = CacheFlags()
        out: list[str] = []
        if self.cache_ram_mib != d.cache_ram_mib:
            out += ["--cache-ram", str(self.cache_ram_mib)]
        if self.ctx_checkpoints != d.ctx_checkpoints:
            out += ["--ctx-checkpoints", str(self.ctx_checkpoints)]
        if self.checkpoint_min_step != d.checkpoint_min_step:
            out += ["--checkpoint-min-step", str(self.checkpoint_min_step)]
        if not self.cache_idle_slots:
            out += ["--no-cache-idle-slots"]
        return out


class SessionPoint(Record):
    """Host memory llama-server holds beyond its load after `requests` requests (idle, the last one done)."""

    requests: int
    cache_bytes: int  # server_prompt_cache::size(): states + their checkpoints (what its log prints)
    cache_entries: int
    cache_tokens: int
    checkpoint_bytes: int  # checkpoints the slots hold themselves
    token_bytes: int  # the cached entries' token copies

    @property
    def bytes(self) -> int:
        return self.cache_bytes + self.checkpoint_bytes + self.token_bytes


class ServerSession(Record):
    prompt_tokens: int
    gen_tokens: int
    n_slots: int
    kv_unified: bool
    flags: CacheFlags
    state_bytes: int  # one finished request's whole sequence state (n_tokens = prompt + gen - 1)
    checkpoints: list[int]  # one request's context checkpoints, bytes each (as kept in its slot)
    points: list[SessionPoint]
    limit: SessionPoint  # the ceiling as the number of requests grows without end (requests = 0)

    @property
    def entry_bytes(self) -> int:
        return self.state_bytes + sum(self.checkpoints)

    @property
    def allocator_bytes(self) -> int:
        """Freed checkpoints the allocator keeps: glibc's dynamic mmap threshold (raised by the first free of a
        checkpoint, when a slot is cleared or reused) serves later checkpoints from the heap, which keeps about one
        request's worth (measured: benchmarks/results/session-cpu-here.json; with MALLOC_MMAP_THRESHOLD_ fixed, 0)."""
        return sum(self.checkpoints)

    @property
    def ceiling_bytes(self) -> int:
        """The most it holds after load however many requests come (the limit), the allocator's share included."""
        return self.limit.bytes + self.allocator_bytes


def host_on_budget(backend) -> bool:
    """Whether host memory (the prompt cache, checkpoints) counts against the device budget: the CPU's one RAM, or a
    unified memory (Metal); next to a discrete GPU it is the host budget's."""
    from fitter.ggml import backends

    impl = backends.get(backend)
    return not impl.is_gpu or impl.unified_memory


def checkpoint_positions(n_prompt: int, n_batch: int, n_ubatch: int, n_max: int) -> list[int]:
    """n_tokens at each checkpoint one prompt processed from scratch leaves in its slot (server_context::
    update_slots: batches of at most n_batch break 4 + n_ubatch and 4 tokens before the end; a checkpoint is made
    before a batch near the prompt's end (n_prompt < batch end + n_ubatch) when memory is not empty;
    create_checkpoint keeps at most n_max, dropping the oldest). Raw prompts: no message spans."""
    if n_max <= 0:
        return []
    out: list[int] = []
    n = 0
    # a batch ends after n_batch tokens, at the prompt's end, or where 4 + n_ubatch or 4 tokens (at most n_batch) are left
    cuts = (n_prompt - min(n_batch, 4 + n_ubatch), n_prompt - min(n_batch, 4))
    while n < n_prompt:
        start = n
        end = min(start + n_batch, n_prompt)
        n = min([c for c in cuts if start < c <= end], default=end)
        near_end = n_prompt < n + n_ubatch
        if start > 0 and (n == n_prompt or near_end):
            out = [p for p in out if p != start]  # supersede one at the same n_tokens
            while len(out) >= n_max:
                out.pop(0)
            out.append(start)
    return out


class _Slot(Record, frozen=False):
    prompt: int | None = None  # request id whose tokens it holds
    t_last: int = -1
    checkpoints: int = 0  # bytes


class _Cache(Record, frozen=False):
    limit_bytes: int  # 0 = no limit
    limit_tokens: int
    entries: deque[tuple[int, int, int]] = field(default_factory=deque)  # (request id, bytes, tokens), oldest first
    ids: set[int] = field(default_factory=set)  # the entries' request ids
    size: int = 0
    n_tokens: int = 0
    settled: bool = False  # update() found nothing to evict, and nothing changed since: it would find nothing again

    def _push(self, e: tuple[int, int, int]) -> None:
        self.settled = False
        self.entries.append(e)
        self.ids.add(e[0])
        self.size += e[1]
        self.n_tokens += e[2]

    def _pop(self) -> None:
        self.settled = False
        e = self.entries.popleft()
        self.ids.discard(e[0])
        self.size -= e[1]
        self.n_tokens -= e[2]

    def alloc(self, prompt: int, size: int, tokens: int) -> None:
        # server_prompt_cache::alloc
        if prompt in self.ids:
            return  # "prompt is already in the cache"
        if self.limit_bytes > 0 and size > self.limit_bytes:
            return  # "exceeds cache size limit, skipping"
        if self.limit_bytes > 0:
            while self.entries and self.size + size > self.limit_bytes:
                self._pop()
        self._push((prompt, size, tokens))

    def update(self) -> None:
        # server_prompt_cache::update
        if self.settled:
            return
        n = len(self.entries)
        if self.limit_bytes > 0:
            while self.entries and self.size > self.limit_bytes:
                self._pop()
        if self.limit_tokens > 0 and self.n_tokens > self.limit_tokens:  # else within `cur` below
            per_token = max(1.0, self.size / max(1, self.n_tokens))
            cur = (max(self.limit_tokens, int(self.limit_bytes / per_token)) if self.limit_bytes > 0
                   else self.limit_tokens)
            while self.entries and self.n_tokens > cur:
                self._pop()
        self.settled = len(self.entries) == n


def _save(cache: _Cache, slot: _Slot, entry: int, tokens: int) -> None:
    if slot.prompt is not None:  # server_slot::prompt_save: an empty slot saves nothing
        cache.alloc(slot.prompt, entry, tokens)


def _request(k: int, slots: list[_Slot], cache: _Cache | None, idle_saves: bool, unified: bool,
             entry: int, tokens: int, ckpt: int) -> None:
    """One request with a new prompt: server_context::get_available_slot (no similar slot: the LRU one, saved and
    refilled from the cache), launch, then process_single_task's idle-slot saves."""
    lru = None
    for s in slots:  # `!ret || slot.t_last_used <= t_last`: the last of the least recently used
        if lru is None or s.t_last <= lru.t_last:
            lru = s
    assert lru is not None
    if cache is not None:
        _save(cache, lru, entry, tokens)
        cache.update()
    if idle_saves and cache is not None:
        for s in slots:
            if s is lru:
                continue
            _save(cache, s, entry, tokens)
            cache.update()
            if unified:  # [TAG_IDLE_SLOT_CLEAR]
                s.prompt, s.checkpoints = None, 0
    lru.prompt, lru.t_last, lru.checkpoints = k, k, ckpt


def _totals(slots: list[_Slot], cache: _Cache | None) -> tuple[int, int, int, int]:
    """(cache bytes, entries, tokens, the slots' checkpoint bytes) now."""
    size, entries, tokens = (cache.size, len(cache.entries), cache.n_tokens) if cache is not None else (0, 0, 0)
    return size, entries, tokens, sum(s.checkpoints for s in slots)


def _point(n: int, totals: tuple[int, int, int, int]) -> SessionPoint:
    size, entries, tokens, ckpt = totals
    return SessionPoint(requests=n, cache_bytes=size, cache_entries=entries, cache_tokens=tokens,
                        checkpoint_bytes=ckpt, token_bytes=TOKEN_BYTES * tokens)


def _limit(n_slots: int, n_ctx: int, flags: CacheFlags, unified: bool, entry: int, tokens: int,
           ckpt: int) -> SessionPoint:
    """The session's ceiling as requests keep coming: the cache full (server_prompt_cache::update: floor(limit /
    entry) entries; with -1, the n_ctx tokens' worth), and the checkpoints the slots hold (with a unified KV and
    idle-slot saves only the busy slot keeps its own; otherwise every slot)."""
    if flags.cache_ram_mib == 0:
        k = 0
    elif flags.cache_ram_mib < 0:
        k = n_ctx // max(1, tokens) if n_ctx > 0 else 1 << 62
    else:
        k = MIB * flags.cache_ram_mib // max(1, entry)
    cleared = unified and flags.cache_idle_slots and flags.cache_ram_mib != 0
    return SessionPoint(requests=0, cache_bytes=k * entry, cache_entries=k, cache_tokens=k * tokens,
                        checkpoint_bytes=ckpt * (1 if cleared else n_slots), token_bytes=TOKEN_BYTES * k * tokens)


def _relative(k: int, slots: list[_Slot], cache: _Cache | None) -> tuple:
    """The state after request k with request ids counted back from k. The requests' rules only compare ids with each
    other (the LRU slot, a prompt already cached), so two requests that leave the same relative state go on alike."""
    cached = () if cache is None else tuple(k - e[0] for e in cache.entries)
    return cached, tuple((None if s.prompt is None else k - s.prompt, k - s.t_last, s.checkpoints) for s in slots)


def _run(n_requests: list[int], n_slots: int, n_ctx: int, flags: CacheFlags, unified: bool,
         entry: int, tokens: int, ckpt: int, *, repeat: bool = True) -> list[SessionPoint]:
    """The points after each of n_requests requests. Once the state after request k is the state after k - n_slots
    (the slots taken in turn), every later request repeats that cycle: the rest are read off it (repeat=False: every
    request simulated, tests/session compare)."""
    cache = None
    if flags.cache_ram_mib != 0:
        cache = _Cache(limit_bytes=MIB * max(0, flags.cache_ram_mib), limit_tokens=n_ctx)
    idle_saves = flags.cache_idle_slots and cache is not None
    slots = [_Slot() for _ in range(n_slots)]
    points: list[SessionPoint] = []
    wanted = set(n_requests)
    seen: dict[int, tuple[tuple, tuple[int, int, int, int]]] = {}  # the last n_slots requests' states and totals
    for k in range(1, max(n_requests, default=0) + 1):
        _request(k, slots, cache, idle_saves, unified, entry, tokens, ckpt)
        totals = _totals(slots, cache)
        if k in wanted:
            points.append(_point(k, totals))
        if not repeat:
            continue
        state = _relative(k, slots, cache)
        if k - n_slots in seen and seen[k - n_slots][0] == state:  # a cycle of n_slots requests from k - n_slots
            cycle = {j: seen[j][1] for j in seen}
            return points + [_point(n, cycle[k - n_slots + (n - k) % n_slots]) for n in sorted(wanted) if n > k]
        seen[k] = (state, totals)
        seen.pop(k - n_slots, None)
    return points


def server_session(spec: ModelSpec, cp: ContextParams, prompt: int, gen: int, n_requests: list[int],
                   flags: CacheFlags | None = None, *, mrope: bool = False,
                   draft: tuple[ModelSpec, ContextParams, bool] | None = None,
                   sizes: dict[tuple[int, bool], int] | None = None) -> ServerSession:
    """The host memory llama-server holds after each of `n_requests` requests of `prompt` tokens generating `gen`,
    and its ceiling; cp is the context llama-server runs (fitter.fit.memory.predict's `context`). `draft`: the
    speculative context (its model, context and whether it is an MTP head): server_slot::prompt_save stores its state
    beside the target's, and create_checkpoint its PARTIAL_ONLY state (update_dft) in each checkpoint."""
    flags = flags or CacheFlags()
    n_tokens = prompt + max(0, gen - 1)  # the last sampled token is never decoded ("stop processing: n_tokens")

    memo = {} if sizes is None else sizes  # `sizes`: kept by a caller that asks again with other flags

    def size(n: int, partial: bool) -> int:
        out = memo.get((n, partial))
        if out is None:
            out = seq_state_bytes(spec, cp, n, partial=partial, mrope=mrope)
            if draft is not None:
                out += seq_state_bytes(draft[0], draft[1], n, partial=partial, mtp=draft[2])
            memo[n, partial] = out
        return out

    state = size(n_tokens, False)
    ckpts: list[int] = []
    if checkpoints_apply(spec, cp):
        for n in checkpoint_positions(prompt, cp.n_batch, cp.n_ubatch, flags.ctx_checkpoints):
            ckpts.append(size(n, True))
    entry = state + sum(ckpts)
    args = (cp.n_seq_max, cp.n_ctx, flags, cp.kv_unified, entry, n_tokens, sum(ckpts))
    points, peak = _run(sorted(set(n_requests)), *args), _limit(*args)
    return ServerSession(prompt_tokens=prompt, gen_tokens=gen, n_slots=cp.n_seq_max, kv_unified=cp.kv_unified,
                         flags=flags, state_bytes=state, checkpoints=ckpts, points=points, limit=peak)
