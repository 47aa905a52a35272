"""The probe child's pieces over llama.cpp's C API (search._probe_child): perf counters and stage hooks, tokenizing,
the draft's vocabulary check, the CPU threadpool, batches, sequence checkpoints, sampling, the decode ticker. The
standard library, llama_cpp and fitter.oracle._llama_child only, as the child itself."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

from fitter.oracle._llama_child import emit_event

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128  # common/speculative.cpp
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5


def _proc_status() -> dict[str, int]:
    """VmSize/VmPeak/VmRSS/VmHWM/VmData of this process, in bytes (empty off Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmPeak", "VmSize", "VmHWM", "VmRSS", "VmData"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


class _Perf:
    """Snapshots of llama_perf_context (ms and token counts, exactly as llama.cpp counts them)."""

    def __init__(self, llama_cpp: Any, ctx: Any):
        self.l, self.ctx = llama_cpp, ctx

    def snap(self) -> tuple[float, int, float, int]:
        self.l.llama_synchronize(self.ctx)
        d = self.l.llama_perf_context(self.ctx)
        # llama_perf_context clamps the counts to >= 1; a zero time means zero evaluations
        n_p = d.n_p_eval if d.t_p_eval_ms > 0 else 0
        n_e = d.n_eval if d.t_eval_ms > 0 else 0
        return d.t_p_eval_ms, n_p, d.t_eval_ms, n_e


def _diff(a: tuple[float, int, float, int], b: tuple[float, int, float, int]) -> dict[str, float]:
    return {"t_p_eval_ms": b[0] - a[0], "n_p_eval": b[1] - a[1], "t_eval_ms": b[2] - a[2], "n_eval": b[3] - a[3]}


def _stage_hooks(req: dict[str, Any], ggml: ctypes.CDLL | None):
    test = req.get("test") or {}

    def hook(stage: str) -> None:
        if test.get("hang") == stage:
            emit_event({"event": "hang", "stage": stage})
            while True:
                time.sleep(3600)
        if test.get("abort") == stage and ggml is not None:
            # a real native abort through ggml's own path: prints "file:line: message", then abort()
            f = ggml.ggml_abort
            f.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
            f.restype = None
            f(b"ggfit-forced-abort.c", 1, b"GGML_ASSERT(forced by the probe test hook) failed")
        sig = test.get("signal")
        if sig and sig[0] == stage:
            os.kill(os.getpid(), getattr(signal, sig[1]))
            time.sleep(5)

    return hook


def _tokenize(l: Any, vocab: Any, text: str, n: int) -> list[int]:
    raw = text.encode("utf-8")
    cap = len(raw) + 16
    buf = (l.llama_token * cap)()
    got = l.llama_tokenize(vocab, raw, len(raw), buf, cap, True, False)
    if got < 0:  # buffer too small: -got is the size needed
        cap = -got
        buf = (l.llama_token * cap)()
        got = l.llama_tokenize(vocab, raw, len(raw), buf, cap, True, False)
    toks = list(buf[: max(got, 0)])
    return toks[:n]


def _vocab_compatible(l: Any, tgt: Any, dft: Any) -> str | None:
    """common_speculative_are_compatible (common/speculative.cpp); None when compatible, else llama.cpp's reason."""
    vt, vd = l.llama_model_get_vocab(tgt), l.llama_model_get_vocab(dft)
    if l.llama_vocab_type(vt) != l.llama_vocab_type(vd):
        return (f"draft model vocab type must match target model to use speculation but vocab_type_dft = "
                f"{l.llama_vocab_type(vd)} while vocab_type_tgt = {l.llama_vocab_type(vt)}")
    ab_t, ab_d = l.llama_vocab_get_add_bos(vt), l.llama_vocab_get_add_bos(vd)
    if ab_t != ab_d or (ab_t and l.llama_vocab_bos(vt) != l.llama_vocab_bos(vd)):
        return (f"draft model bos tokens must match target model to use speculation. add: {int(ab_t)} - {int(ab_d)}, "
                f"id: {l.llama_vocab_bos(vt)} - {l.llama_vocab_bos(vd)})")
    ae_t, ae_d = l.llama_vocab_get_add_eos(vt), l.llama_vocab_get_add_eos(vd)
    if ae_t != ae_d or (ae_t and l.llama_vocab_eos(vt) != l.llama_vocab_eos(vd)):
        return (f"draft model eos tokens must match target model to use speculation. add: {int(ae_t)} - {int(ae_d)}, "
                f"id: {l.llama_vocab_eos(vt)} - {l.llama_vocab_eos(vd)})")
    n_t, n_d = l.llama_vocab_n_tokens(vt), l.llama_vocab_n_tokens(vd)
    if abs(n_t - n_d) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        return (f"draft model vocab must closely match target model to use speculation but target vocab size {n_t} "
                f"does not match draft vocab size {n_d} - difference {abs(n_t - n_d)}, max allowed "
                f"{SPEC_VOCAB_MAX_SIZE_DIFFERENCE}")
    for i in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(n_t, n_d)):
        a, b = l.llama_vocab_get_text(vt, i), l.llama_vocab_get_text(vd, i)
        if a != b:
            return (f"draft model vocab must match target model to use speculation but token {i} content differs - "
                    f"target {a!r}, draft {b!r}")
    return None


class _TPParams(ctypes.Structure):
    """struct ggml_threadpool_params (ggml/include/ggml.h, GGML_MAX_N_THREADS = 512)."""

    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


def _attach_threadpool(l: Any, ctx: Any, n_threads: int) -> tuple[Any, Any] | str:
    """As llama-server does (common_threadpools::init): one persistent CPU threadpool with the defaults of
    ggml_threadpool_params_default (poll 50, normal priority, no affinity), attached to the context. The library
    alone would build a throwaway pool for every graph. Returns (free function, pool) or why it could not."""
    libdir = os.path.join(os.path.dirname(l.__file__), "lib")
    try:
        base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
        cpu = ctypes.CDLL(os.path.join(libdir, "libggml-cpu.so"))
    except OSError as e:
        return f"no ggml libraries to build a threadpool: {e}"
    base.ggml_threadpool_params_default.restype = _TPParams
    base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p
    cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_TPParams)]
    cpu.ggml_threadpool_free.restype = None
    cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
    params = base.ggml_threadpool_params_default(n_threads)
    pool = cpu.ggml_threadpool_new(ctypes.byref(params))
    if not pool:
        return f"ggml_threadpool_new failed (n_threads {n_threads})"
    attach = l.llama_cpp._lib.llama_attach_threadpool
    attach.restype = None
    attach.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    attach(ctx, pool, None)
    return cpu.ggml_threadpool_free, pool


class _Batch:
    """A llama_batch for explicit positions / output flags on sequence 0."""

    def __init__(self, l: Any, n: int):
        self.l = l
        self.n_max = n
        self.b = l.llama_batch_init(n, 0, 1)

    def fill(self, tokens: list[int], pos0: int, outputs: str = "last") -> Any:
        b = self.b
        n = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = outputs == "all" or i == n - 1
        b.n_tokens = n
        return b

    def free(self) -> None:
        self.l.llama_batch_free(self.b)


def _seq_rm_type(l: Any, ctx: Any) -> str:
    """common_context_can_seq_rm (common/common.cpp): "rs" (bounded rollback, n_rs_seq > 0), "part" (any
    tail of a sequence can be removed), "full" (recurrent state: only whole checkpoints), "no" (cannot decode)."""
    if l.llama_n_rs_seq(ctx) > 0:
        return "rs"
    mem = l.llama_get_memory(ctx)
    l.llama_memory_clear(mem, True)
    b = _Batch(l, 2)
    try:
        if l.llama_decode(ctx, b.fill([0, 0], 0)) != 0:
            return "no"
        return "part" if l.llama_memory_seq_rm(mem, 0, 1, -1) else "full"
    finally:
        b.free()
        l.llama_memory_clear(mem, True)
        l.llama_synchronize(ctx)


class _Checkpoint:
    """The part of sequence 0's state that cannot be cut back (recurrent / SWA), as llama-server's
    speculative checkpoints keep it (common_prompt_checkpoint::update_tgt / load_tgt, PARTIAL_ONLY)."""

    def __init__(self, l: Any, ctx: Any):
        self.l, self.ctx = l, ctx
        flags = l.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        n = l.llama_state_seq_get_size_ext(ctx, 0, flags)
        self.data = (ctypes.c_uint8 * n)()
        if l.llama_state_seq_get_data_ext(ctx, self.data, n, 0, flags) != n:
            raise RuntimeError("checkpoint size mismatch")

    def restore(self, pos: int) -> None:
        """Back to the saved state, then drop positions >= pos (the attention part) as llama-server does."""
        l, n = self.l, len(self.data)
        if l.llama_state_seq_set_data_ext(self.ctx, self.data, n, 0, l.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) != n:
            raise RuntimeError("checkpoint size mismatch on restore")
        if not l.llama_memory_seq_rm(l.llama_get_memory(self.ctx), 0, pos, -1):
            raise RuntimeError(f"failed to remove sequence 0 from p0={pos} after restoring a checkpoint")


def _top_p(l: Any, ctx: Any, idx: int, n_vocab: int, k: int = 10) -> tuple[int, float]:
    """Draft sampling as common/speculative.cpp's draft-simple does it: top-k 10, p of the best after softmax."""
    import numpy as np  # noqa: PLC0415 - llama_cpp has loaded it already

    row = np.ctypeslib.as_array(l.llama_get_logits_ith(ctx, idx), shape=(n_vocab,))
    k = min(k, n_vocab)
    top = np.argpartition(row, -k)[-k:]
    vals = row[top].astype(np.float64)
    best = int(top[int(np.argmax(vals))])
    return best, float(1.0 / np.exp(vals - vals.max()).sum())


class _Stop(Exception):
    """Ends the child with a "done" event: llama.cpp refused, failed or ran out of memory (`status`, `message`)."""

    def __init__(self, status: str, message: str, *, with_runs: bool = False):
        super().__init__(message)
        self.status, self.message, self.with_runs = status, message, with_runs


class _Ticker:
    """A slow decode reports how far it is, at most once a second (outside llama.cpp's timings)."""

    def __init__(self, index: int, n_gen: int):
        self.index, self.n_gen = index, n_gen
        self.next = time.perf_counter() + 1.0

    def __call__(self, generated: int) -> None:
        now = time.perf_counter()
        if now >= self.next:
            self.next = now + 1.0
            emit_event({"event": "decoded", "index": self.index, "generated": generated, "tokens": self.n_gen})
