"""The child of fitter.speed.cpu_rate: times llama.cpp's CPU matmuls on the small models the parent wrote.

    python -m fitter.speed._cpu_rate_child '{"threads": 2, "prefill_tokens": 256, "decode_tokens": 32,
                                             "prefill": [path, ...], "decode": [path, ...]}'

For each `prefill` model: one warm-up, then the fastest of `repeats` prompts of `prefill_tokens` tokens in one
ubatch (llama_decode of a batch, the KV cleared before each); for each `decode` model: `decode_tokens` single-token
llama_decode calls after a short prompt, their fastest quarter's mean (a shared machine's preemptions left out).
Extra CPU buffer types (repack, AMX) off: llama_model_params.use_extra_bufts = false. Prints one JSON object:
{"prefill_s": [...], "decode_s": [...], "system_info": ..., "ggml_commit": ...}.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _context(l: Any, model: Any, n_ctx: int, n_batch: int, threads: int) -> Any:
    cp = l.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
    cp.n_threads = cp.n_threads_batch = threads
    cp.no_perf = True
    return l.llama_init_from_model(model, cp)


def _load(l: Any, path: str) -> Any:
    mp = l.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = False  # this CPU may advertise AMX: the extra buffer types can SIGILL
    model = l.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise RuntimeError(f"llama_model_load_from_file failed: {path}")
    return model


def _run(l: Any, ctx: Any, batch: Any, n: int, pos0: int) -> float:
    for i in range(n):
        batch.token[i] = (pos0 + i) * 7 % 200 + 1
        batch.pos[i] = pos0 + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i == n - 1
    batch.n_tokens = n
    t = time.perf_counter()
    if l.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    l.llama_synchronize(ctx)
    return time.perf_counter() - t


def prefill_seconds(l: Any, path: str, n: int, threads: int, repeats: int) -> float:
    model = _load(l, path)
    ctx = _context(l, model, n + 16, n, threads)
    batch = l.llama_batch_init(n, 0, 1)
    best = float("inf")
    try:
        for rep in range(repeats + 1):
            l.llama_memory_clear(l.llama_get_memory(ctx), True)
            dt = _run(l, ctx, batch, n, 0)
            if rep:  # the first is the warm-up (pages mapped, buffers allocated)
                best = min(best, dt)
    finally:
        l.llama_batch_free(batch)
        l.llama_free(ctx)
        l.llama_model_free(model)
    return best


def decode_seconds(l: Any, path: str, n: int, threads: int) -> float:
    model = _load(l, path)
    ctx = _context(l, model, n + 64, 16, threads)
    batch = l.llama_batch_init(16, 0, 1)
    try:
        _run(l, ctx, batch, 16, 0)
        times = sorted(_run(l, ctx, batch, 1, 16 + i) for i in range(n))
    finally:
        l.llama_batch_free(batch)
        l.llama_free(ctx)
        l.llama_model_free(model)
    fast = times[: max(1, len(times) // 4)]
    return sum(fast) / len(fast)


def main() -> int:
    req = json.loads(sys.argv[1])
    import llama_cpp as l

    l.llama_backend_init()
    threads = int(req["threads"])
    out: dict[str, Any] = {
        "prefill_s": [prefill_seconds(l, p, int(req["prefill_tokens"]), threads, int(req.get("repeats", 2)))
                      for p in req["prefill"]],
        "decode_s": [decode_seconds(l, p, int(req["decode_tokens"]), threads) for p in req["decode"]],
        "system_info": l.llama_print_system_info().decode(errors="replace").strip(),
        "llama_cpp_python": getattr(l, "__version__", ""),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
