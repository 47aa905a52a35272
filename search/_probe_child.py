"""Child process of `search.probe` (python runner): load, prefill a real prompt, decode N tokens, exit.

Run as `python -m search._probe_child` with the JSON request on stdin. Only the standard library,
llama_cpp and the child helpers of `fitter.oracle._llama_child` (standard library only) are imported, so a
native abort, a segfault or an allocation failure kills nothing but this process.

Protocol
  stdin: {"model_path", "model": {llama_model_params fields}, "context": {llama_context_params fields},
          "prompts": [text, ...] (warm-up runs first), "warmup": int, "prompt_tokens": int, "gen_tokens": int,
          "budget_bytes": int|null, "spec": null | {"type", "draft_model", "draft_model_params", "draft_context",
          "n_max", "n_min", "p_min"}, "log_level": "debug"|"info", "test": {"abort": stage, "signal": [stage, name],
          "hang": stage}}
      type_k/type_v come as [name, id] and are checked against the loaded ggml's ggml_type_name(id).
  stderr: llama.cpp's whole log, verbatim (log callback -> fd 2, so an abort keeps everything before it).
  stdout: one JSON object per line, each with an "event": start, build, limit, model, context, draft, phase (as
      each prompt's prefill and decode begin: {"index", "phase": "prefill"|"decode", "tokens"}), decoded (at most once
      a second during a decode: {"index", "generated", "tokens"}), run (one per
      prompt, when it is done), done. A missing "done" means the child died. The parent reads them as they come
      (live progress).

Budget (Linux only, CPU builds only): `RLIMIT_AS` = the process's address space right before the model is
loaded (interpreter, numpy, llama.cpp's libraries) + `budget_bytes`. So the budget is everything llama.cpp maps
or allocates from then on: the model file (mmap'd, or read into memory with --no-mmap), KV cache, recurrent
state, compute and output buffers, and its threads' stacks (the parent sets MALLOC_ARENA_MAX=1, so glibc
reserves no 64 MiB arena per thread). It is an address-space limit, so it is conservative by the stacks'
reservations (8 MiB per thread, mostly untouched). GPU builds are left unlimited: the CUDA driver reserves
huge address ranges and would fail under RLIMIT_AS.

Timings come from llama.cpp's own counters (`llama_perf_context`: t_p_eval_ms / n_p_eval for batches of more
than one token, t_eval_ms / n_eval for single-token decodes), read as differences around each phase, after
`llama_synchronize`. With speculation the target verifies drafts in multi-token batches (counted as p_eval by
llama.cpp), so the decode time is the sum of both contexts' counters over the decode phase.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time
from typing import Any

from fitter.oracle._llama_child import GGML_LOG_DEBUG as _DEBUG, GGML_LOG_INFO as _INFO, ChildLog as _Log, apply_fields as _apply, build_info as _build_info, emit_event as _emit, lib_type_name as _ggml_type_name, load_ggml_base as _ggml_base

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
            _emit({"event": "hang", "stage": stage})
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


def main() -> int:
    raw = sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read()
    req = json.loads(raw)
    _emit({"event": "start", "pid": os.getpid()})
    t_start = time.perf_counter()

    import llama_cpp as l  # noqa: PLC0415

    log = _Log(_DEBUG if req.get("log_level", "info") == "debug" else _INFO)
    cb = l.llama_log_callback(log)
    l.llama_log_set(cb, ctypes.c_void_p(0))
    ggml = _ggml_base(l)
    _emit({"event": "build", **_build_info(l, ggml), "gpu_offload": bool(l.llama_supports_gpu_offload())})
    hook = _stage_hooks(req, ggml)

    def done(status: str, message: str | None = None, **extra: Any) -> int:
        _emit({"event": "done", "status": status, "message": message, "errors": log.errors,
               "warnings": log.warnings, "proc": _proc_status(), **extra})
        return 0

    l.llama_backend_init()

    budget = req.get("budget_bytes")
    if budget is not None:
        st = _proc_status()
        if l.llama_supports_gpu_offload():
            _emit({"event": "limit", "enforced": False, "reason": "GPU build: RLIMIT_AS would break the GPU driver"})
        elif "VmSize" not in st:
            _emit({"event": "limit", "enforced": False, "reason": "no /proc/self/status (not Linux)"})
        else:
            limit = st["VmSize"] + int(budget)
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
            _emit({"event": "limit", "enforced": True, "baseline": st["VmSize"], "limit": limit, "budget": int(budget)})

    def model_params(fields: dict[str, Any]) -> Any:
        mp = l.llama_model_default_params()
        fields = dict(fields)
        lm = fields.pop("load_mode", None)
        if lm is not None:
            mp.load_mode = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}[lm]
        _apply(mp, fields)
        return mp

    def context_params(fields: dict[str, Any]) -> Any | str:
        cp = l.llama_context_default_params()
        fields = dict(fields)
        for key in ("type_k", "type_v"):
            if key in fields:
                name, type_id = fields[key]
                have = _ggml_type_name(ggml, type_id)
                if have is not None and have.lower() != name.lower():
                    return f"ggml type id {type_id} is {have!r} in this build, not {name!r}"
                fields[key] = type_id
        _apply(cp, fields)
        cp.no_perf = False  # llama_perf_context needs the counters
        return cp

    timings: dict[str, float] = {"import_s": time.perf_counter() - t_start}
    hook("load")
    t = time.perf_counter()
    model = l.llama_model_load_from_file(req["model_path"].encode(), model_params(req.get("model", {})))
    timings["load_model_s"] = time.perf_counter() - t
    if not model:
        return done("error", log.errors[0] if log.errors else "llama_model_load_from_file returned NULL", timings=timings)
    vocab = l.llama_model_get_vocab(model)
    n_vocab = l.llama_vocab_n_tokens(vocab)
    _emit({"event": "model", "size": l.llama_model_size(model), "n_params": l.llama_model_n_params(model),
           "n_vocab": n_vocab, "n_ctx_train": l.llama_model_n_ctx_train(model)})

    cp = context_params(req.get("context", {}))
    if isinstance(cp, str):
        return done("error", cp, timings=timings)
    hook("context")
    t = time.perf_counter()
    ctx = l.llama_init_from_model(model, cp)
    timings["context_s"] = time.perf_counter() - t
    if not ctx:
        return done("error", log.errors[0] if log.errors else "llama_init_from_model returned NULL", timings=timings)
    pool = _attach_threadpool(l, ctx, int(req.get("context", {}).get("n_threads") or os.cpu_count() or 1))
    if isinstance(pool, str):
        _emit({"event": "threadpool", "attached": False, "reason": pool})
        pool = None
    n_ctx = l.llama_n_ctx(ctx)
    n_batch = l.llama_n_batch(ctx)
    _emit({"event": "context", "n_ctx": n_ctx, "n_ctx_seq": l.llama_n_ctx_seq(ctx), "n_batch": n_batch,
           "n_ubatch": l.llama_n_ubatch(ctx), "n_seq_max": l.llama_n_seq_max(ctx)})

    # --- speculative decoding: an external draft model, draft-then-verify (greedy) -------------------------
    spec = req.get("spec")
    dmodel = dctx = None
    speculation = "none"
    spec_message = None
    if spec:
        if spec["type"] != "draft-simple":
            return done("error", f"--spec-type {spec['type']}: the python runner only drives draft-simple "
                                 "(llama-cpp-python 0.3.36 has no MTP drafting loop); use the server runner", timings=timings)
        t = time.perf_counter()
        dmodel = l.llama_model_load_from_file(spec["draft_model"].encode(), model_params(spec.get("draft_model_params", {})))
        if not dmodel:
            msg = log.errors[-1] if log.errors else "llama_model_load_from_file returned NULL"
            return done("error", f"failed to load draft model, '{spec['draft_model']}': {msg}", timings=timings)
        dcp = context_params(spec.get("draft_context", {}))
        if isinstance(dcp, str):
            return done("error", dcp, timings=timings)
        dcp.n_ctx = n_ctx  # the draft context holds as many tokens per sequence as the target context
        dcp.n_rs_seq = 0
        dctx = l.llama_init_from_model(dmodel, dcp)
        timings["draft_s"] = time.perf_counter() - t
        if not dctx:
            return done("error", log.errors[-1] if log.errors else "failed to create the draft context", timings=timings)
        reason = _vocab_compatible(l, model, dmodel)
        if reason is not None:
            # as llama-server: common_speculative_init throws, the draft context and model are freed
            speculation = "off"
            spec_message = f"{reason}; the target and draft vocabs are not compatible (speculation off)"
            _emit({"event": "draft", "speculation": "off", "message": spec_message})
            l.llama_free(dctx)
            l.llama_model_free(dmodel)
            dctx = dmodel = None
        else:
            # server_context::load_model: a target that cannot remove a sequence's tail at all does not speculate;
            # one with recurrent state ("full") verifies drafts from checkpoints, and so does a recurrent draft
            tgt_rm, dft_rm = _seq_rm_type(l, ctx), _seq_rm_type(l, dctx)
            if tgt_rm == "no":
                speculation = "off"
                spec_message = "speculative decoding not supported by this context"
                _emit({"event": "draft", "speculation": "off", "message": spec_message})
                l.llama_free(dctx)
                l.llama_model_free(dmodel)
                dctx = dmodel = None
            else:
                speculation = "on"
                _emit({"event": "draft", "speculation": "on", "seq_rm": {"target": tgt_rm, "draft": dft_rm},
                       "n_vocab": l.llama_vocab_n_tokens(l.llama_model_get_vocab(dmodel))})

    hook("prompt")
    n_prompt = int(req["prompt_tokens"])
    n_gen = int(req["gen_tokens"])
    if n_prompt + n_gen > l.llama_n_ctx_seq(ctx):
        return done("error", f"prompt ({n_prompt}) + generation ({n_gen}) tokens exceed the context of a sequence "
                             f"(n_ctx_seq = {l.llama_n_ctx_seq(ctx)})", timings=timings)

    mem = l.llama_get_memory(ctx)
    dmem = l.llama_get_memory(dctx) if dctx else None
    perf = _Perf(l, ctx)
    dperf = _Perf(l, dctx) if dctx else None
    n_max = int(spec["n_max"]) if spec else 0
    batch = _Batch(l, max(n_batch, n_max + 1))
    dbatch = _Batch(l, max(n_batch, n_max + 1)) if dctx else None
    smpl = l.llama_sampler_chain_init(l.llama_sampler_chain_default_params())
    l.llama_sampler_chain_add(smpl, l.llama_sampler_init_greedy())

    def decode(c: Any, b: Any, what: str) -> str | None:
        ret = l.llama_decode(c, b)
        if ret == 0:
            return None
        kind = "oom" if ret in (-2, -3) else "error"
        errs = [e for e in log.errors if "decode" in e or "alloc" in e or "compute" in e]
        return json.dumps({"kind": kind, "message": f"llama_decode ({what}) returned {ret}" + (f": {errs[-1]}" if errs else "")})

    def prefill(c: Any, b: _Batch, toks: list[int]) -> str | None:
        for off in range(0, len(toks), n_batch):
            chunk = toks[off:off + n_batch]
            err = decode(c, b.fill(chunk, off), "prompt")
            if err:
                return err
        return None

    runs = []
    for i, text in enumerate(req["prompts"]):
        warm = i < int(req.get("warmup", 0))
        l.llama_memory_clear(mem, True)
        if dmem is not None:
            l.llama_memory_clear(dmem, True)
        l.llama_sampler_reset(smpl)
        toks = _tokenize(l, vocab, text, n_prompt)
        if len(toks) < n_prompt:
            return done("error", f"prompt {i} gave only {len(toks)} tokens, {n_prompt} wanted", timings=timings)

        # prefill
        _emit({"event": "phase", "index": i, "phase": "prefill", "tokens": len(toks)})
        p0 = perf.snap()
        t0 = time.perf_counter()
        err = prefill(ctx, batch, toks)
        if err:
            e = json.loads(err)
            return done(e["kind"], e["message"], timings=timings, runs=runs)
        tok = l.llama_sampler_sample(smpl, ctx, -1)  # synchronizes: the prompt is done
        ttft = time.perf_counter() - t0
        p1 = perf.snap()
        pre = _diff(p0, p1)
        run: dict[str, Any] = {"warmup": warm, "prompt_tokens": len(toks), "ttft_ms": ttft * 1e3,
                               "prefill_ms": pre["t_p_eval_ms"] + pre["t_eval_ms"],
                               "prefill_n": pre["n_p_eval"] + pre["n_eval"]}
        if i == 0:
            hook("decode")
        _emit({"event": "phase", "index": i, "phase": "decode", "tokens": n_gen})
        generated = [tok]
        n_past = len(toks)
        t1 = time.perf_counter()
        next_tick = t1 + 1.0

        def tick() -> None:  # a slow decode reports how far it is, at most once a second (outside llama.cpp's timings)
            nonlocal next_tick
            now = time.perf_counter()
            if now >= next_tick:
                next_tick = now + 1.0
                _emit({"event": "decoded", "index": i, "generated": len(generated), "tokens": n_gen})

        if speculation != "on":
            while len(generated) < n_gen:
                tick()
                err = decode(ctx, batch.fill([tok], n_past), "generation")
                if err:
                    e = json.loads(err)
                    return done(e["kind"], e["message"], timings=timings, runs=runs)
                n_past += 1
                tok = l.llama_sampler_sample(smpl, ctx, -1)
                generated.append(tok)
            p2 = perf.snap()
            dec = _diff(p1, p2)
            run.update(decode_ms=dec["t_p_eval_ms"] + dec["t_eval_ms"], decode_n=dec["n_p_eval"] + dec["n_eval"])
        else:
            # draft-then-verify, greedy (common/speculative.cpp draft-simple + the server's verification)
            d0 = dperf.snap()
            err = prefill(dctx, dbatch, toks[:-1]) if len(toks) > 1 else None
            if err:
                e = json.loads(err)
                return done(e["kind"], e["message"], timings=timings, runs=runs)
            d_past = len(toks) - 1  # tokens the draft context holds
            seq = list(toks)  # prompt + accepted tokens; `tok` (the last sampled) is not in either KV yet
            n_drafted = n_accepted = 0
            p_min, n_min = float(spec["p_min"]), int(spec["n_min"])
            try:
                while len(generated) < n_gen:
                    tick()
                    want = min(n_max, n_gen - len(generated))
                    drafts: list[int] = []
                    d_ckpt = None
                    if want > 0:
                        pending = seq[d_past:] + [tok]
                        err = decode(dctx, dbatch.fill(pending, d_past), "draft")
                        if err:
                            e = json.loads(err)
                            return done(e["kind"], e["message"], timings=timings, runs=runs)
                        d_past += len(pending)
                        d_ckpt = (d_past, _Checkpoint(l, dctx)) if dft_rm == "full" else None
                        while True:
                            d, p = _top_p(l, dctx, -1, n_vocab)
                            if p < p_min:
                                break
                            drafts.append(d)
                            if len(drafts) >= want:
                                break
                            err = decode(dctx, dbatch.fill([d], d_past), "draft")
                            if err:
                                e = json.loads(err)
                                return done(e["kind"], e["message"], timings=timings, runs=runs)
                            d_past += 1
                        if len(drafts) < n_min:
                            drafts = []
                    # verify [tok, drafts...] on the target
                    t_ckpt = _Checkpoint(l, ctx) if drafts and tgt_rm == "full" else None
                    err = decode(ctx, batch.fill([tok] + drafts, n_past, outputs="all"), "verify")
                    if err:
                        e = json.loads(err)
                        return done(e["kind"], e["message"], timings=timings, runs=runs)
                    acc = 0
                    nxt = l.llama_sampler_sample(smpl, ctx, 0)
                    while acc < len(drafts) and nxt == drafts[acc]:
                        acc += 1
                        nxt = l.llama_sampler_sample(smpl, ctx, acc)
                    n_drafted += len(drafts)
                    n_accepted += acc
                    seq += [tok] + drafts[:acc]
                    if t_ckpt is not None and acc < len(drafts):
                        # partial acceptance on recurrent state: restore the checkpoint, then replay the accepted
                        # tokens (llama-server's spec_is_replay)
                        t_ckpt.restore(n_past)
                        err = decode(ctx, batch.fill([tok] + drafts[:acc], n_past), "replay")
                        if err:
                            e = json.loads(err)
                            return done(e["kind"], e["message"], timings=timings, runs=runs)
                    n_past += 1 + acc
                    # drop the rejected drafts from both caches
                    l.llama_memory_seq_rm(mem, 0, n_past, -1)
                    if d_past > n_past:
                        if d_ckpt is not None:  # back to the last accepted token; the next draft step re-decodes the rest
                            d_ckpt[1].restore(d_ckpt[0])
                            d_past = d_ckpt[0]
                        else:
                            l.llama_memory_seq_rm(dmem, 0, n_past, -1)
                            d_past = n_past
                    generated += drafts[:acc] + [nxt]
                    tok = nxt
            except RuntimeError as e:  # a checkpoint that llama.cpp would not save or restore
                return done("error", str(e), timings=timings, runs=runs)
            generated = generated[:n_gen]
            p2 = perf.snap()
            d2 = dperf.snap()
            dec, ddec = _diff(p1, p2), _diff(d0, d2)
            run.update(decode_ms=dec["t_p_eval_ms"] + dec["t_eval_ms"] + ddec["t_p_eval_ms"] + ddec["t_eval_ms"],
                       decode_n=len(generated) - 1, target_ms=dec["t_p_eval_ms"] + dec["t_eval_ms"],
                       draft_ms=ddec["t_p_eval_ms"] + ddec["t_eval_ms"], draft_n=n_drafted, draft_n_accepted=n_accepted)
        run["decode_wall_ms"] = (time.perf_counter() - t1) * 1e3
        run["generated_tokens"] = len(generated)
        _emit({"event": "run", "index": i, **run})
        runs.append(run)

    hook("free")
    batch.free()
    if dbatch:
        dbatch.free()
    l.llama_sampler_free(smpl)
    if dctx:
        l.llama_free(dctx)
    if dmodel:
        l.llama_model_free(dmodel)
    l.llama_free(ctx)
    if pool is not None:
        pool[0](pool[1])
    l.llama_model_free(model)
    timings["total_s"] = time.perf_counter() - t_start
    return done("ok", None, timings=timings, runs=runs, speculation=speculation, speculation_message=spec_message)


if __name__ == "__main__":
    sys.exit(main())
