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
import sys
import time
from typing import Any

from fitter.oracle._llama_child import (
    GGML_LOG_DEBUG,
    GGML_LOG_INFO,
    ChildLog,
    apply_fields,
    apply_placement,
    build_info,
    emit_event,
    lib_type_name,
    load_ggml_base,
    load_loras,
    set_loras,
)
from search._probe_llama import (
    _attach_threadpool,
    _Batch,
    _Checkpoint,
    _diff,
    _Perf,
    _proc_status,
    _seq_rm_type,
    _stage_hooks,
    _Stop,
    _Ticker,
    _tokenize,
    _top_p,
    _vocab_compatible,
)


class _Child:
    """One probe: load the model (and the drafter), run every prompt (prefill, then decode, plain or speculative),
    free everything. A failure raises `_Stop`; `main` turns it into the "done" event."""

    def __init__(self, l: Any, req: dict[str, Any], log: Any, ggml: ctypes.CDLL | None, t_start: float):
        self.l, self.req, self.log, self.ggml, self.t_start = l, req, log, ggml, t_start
        self.hook = _stage_hooks(req, ggml)
        self.timings: dict[str, float] = {}
        self.runs: list[dict[str, Any]] = []
        # llama.cpp's objects (ctypes pointers), set by load / load_draft / run_prompts
        self.model: Any = None
        self.ctx: Any = None
        self.dmodel: Any = None
        self.dctx: Any = None
        self.pool: Any = None
        self.vocab: Any = None
        self.n_vocab = self.n_ctx = self.n_batch = 0
        self.speculation: str = "none"
        self.spec_message: str | None = None
        self.tgt_rm = self.dft_rm = "no"
        self.perf: Any = None
        self.dperf: Any = None  # the draft context's counters (speculation on)
        self.batch: Any = None
        self.dbatch: Any = None

    def done(self, status: str, message: str | None = None, **extra: Any) -> int:
        emit_event({"event": "done", "status": status, "message": message, "errors": self.log.errors,
                    "warnings": self.log.warnings, "proc": _proc_status(), "timings": self.timings, **extra})
        return 0

    def limit_memory(self) -> None:
        """RLIMIT_AS = what the process maps now + the budget (CPU builds on Linux only)."""
        budget = self.req.get("budget_bytes")
        if budget is None:
            return
        st = _proc_status()
        if self.l.llama_supports_gpu_offload():
            emit_event({"event": "limit", "enforced": False, "reason": "GPU build: RLIMIT_AS would break the GPU driver"})
        elif "VmSize" not in st:
            emit_event({"event": "limit", "enforced": False, "reason": "no /proc/self/status (not Linux)"})
        else:
            limit = st["VmSize"] + int(budget)
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
            emit_event({"event": "limit", "enforced": True, "baseline": st["VmSize"], "limit": limit,
                        "budget": int(budget)})

    def model_params(self, fields: dict[str, Any]) -> Any:
        mp = self.l.llama_model_default_params()
        fields = dict(fields)
        lm = fields.pop("load_mode", None)
        if lm is not None:
            mp.load_mode = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}[lm]
        try:
            apply_placement(self.l, mp, fields)  # -ot / --n-cpu-moe overrides, -ts
        except ValueError as e:
            raise _Stop("error", str(e)) from None
        apply_fields(mp, fields)
        return mp

    def context_params(self, fields: dict[str, Any]) -> Any:
        cp = self.l.llama_context_default_params()
        fields = dict(fields)
        for key in ("type_k", "type_v"):
            if key in fields:
                name, type_id = fields[key]
                have = lib_type_name(self.ggml, type_id)
                if have is not None and have.lower() != name.lower():
                    raise _Stop("error", f"ggml type id {type_id} is {have!r} in this build, not {name!r}")
                fields[key] = type_id
        apply_fields(cp, fields)
        cp.no_perf = False  # llama_perf_context needs the counters
        return cp

    def load(self) -> None:
        """The target model and its context (with llama-server's threadpool)."""
        l, req = self.l, self.req
        self.hook("load")
        t = time.perf_counter()
        self.model = l.llama_model_load_from_file(req["model_path"].encode(), self.model_params(req.get("model", {})))
        self.timings["load_model_s"] = time.perf_counter() - t
        if not self.model:
            raise _Stop("error", self.log.errors[0] if self.log.errors else "llama_model_load_from_file returned NULL")
        self.vocab = l.llama_model_get_vocab(self.model)
        self.n_vocab = l.llama_vocab_n_tokens(self.vocab)
        emit_event({"event": "model", "size": l.llama_model_size(self.model), "n_params": l.llama_model_n_params(self.model),
                    "n_vocab": self.n_vocab, "n_ctx_train": l.llama_model_n_ctx_train(self.model)})
        loras = req.get("loras") or []  # --lora: loaded after the model, applied to the context (common_init_result)
        adapters, why = load_loras(l, self.model, loras)
        if why:
            raise _Stop("error", self.log.errors[-1] if self.log.errors else why)
        cp = self.context_params(req.get("context", {}))
        self.hook("context")
        t = time.perf_counter()
        self.ctx = l.llama_init_from_model(self.model, cp)
        self.timings["context_s"] = time.perf_counter() - t
        if not self.ctx:
            raise _Stop("error", self.log.errors[0] if self.log.errors else "llama_init_from_model returned NULL")
        set_loras(l, self.ctx, adapters, loras)
        pool = _attach_threadpool(l, self.ctx, int(req.get("context", {}).get("n_threads") or os.cpu_count() or 1))
        if isinstance(pool, str):
            emit_event({"event": "threadpool", "attached": False, "reason": pool})
        else:
            self.pool = pool
        self.n_ctx, self.n_batch = l.llama_n_ctx(self.ctx), l.llama_n_batch(self.ctx)
        emit_event({"event": "context", "n_ctx": self.n_ctx, "n_ctx_seq": l.llama_n_ctx_seq(self.ctx),
                    "n_batch": self.n_batch, "n_ubatch": l.llama_n_ubatch(self.ctx), "n_seq_max": l.llama_n_seq_max(self.ctx)})

    def load_draft(self, spec: dict[str, Any]) -> None:
        """Speculative decoding with an external draft model (draft-then-verify, greedy): its model and context,
        then whether llama-server would speculate with it."""
        l = self.l
        if spec["type"] != "draft-simple":
            raise _Stop("error", f"--spec-type {spec['type']}: the python runner only drives draft-simple "
                                 "(llama-cpp-python 0.3.36 has no MTP drafting loop); use the server runner")
        t = time.perf_counter()
        self.dmodel = l.llama_model_load_from_file(spec["draft_model"].encode(),
                                                   self.model_params(spec.get("draft_model_params", {})))
        if not self.dmodel:
            msg = self.log.errors[-1] if self.log.errors else "llama_model_load_from_file returned NULL"
            raise _Stop("error", f"failed to load draft model, '{spec['draft_model']}': {msg}")
        dcp = self.context_params(spec.get("draft_context", {}))
        dcp.n_ctx = self.n_ctx  # the draft context holds as many tokens per sequence as the target context
        dcp.n_rs_seq = 0
        self.dctx = l.llama_init_from_model(self.dmodel, dcp)
        self.timings["draft_s"] = time.perf_counter() - t
        if not self.dctx:
            raise _Stop("error", self.log.errors[-1] if self.log.errors else "failed to create the draft context")
        reason = _vocab_compatible(l, self.model, self.dmodel)
        if reason is not None:  # as llama-server: common_speculative_init throws, the draft context and model are freed
            self._speculation_off(f"{reason}; the target and draft vocabs are not compatible (speculation off)")
            return
        # server_context::load_model: a target that cannot remove a sequence's tail at all does not speculate;
        # one with recurrent state ("full") verifies drafts from checkpoints, and so does a recurrent draft
        self.tgt_rm, self.dft_rm = _seq_rm_type(l, self.ctx), _seq_rm_type(l, self.dctx)
        if self.tgt_rm == "no":
            self._speculation_off("speculative decoding not supported by this context")
            return
        self.speculation = "on"
        emit_event({"event": "draft", "speculation": "on", "seq_rm": {"target": self.tgt_rm, "draft": self.dft_rm},
                    "n_vocab": l.llama_vocab_n_tokens(l.llama_model_get_vocab(self.dmodel))})

    def _speculation_off(self, message: str) -> None:
        self.speculation, self.spec_message = "off", message
        emit_event({"event": "draft", "speculation": "off", "message": message})
        self.l.llama_free(self.dctx)
        self.l.llama_model_free(self.dmodel)
        self.dctx = self.dmodel = None

    def decode(self, c: Any, b: Any, what: str) -> None:
        ret = self.l.llama_decode(c, b)
        if ret == 0:
            return
        kind = "oom" if ret in (-2, -3) else "error"
        errs = [e for e in self.log.errors if "decode" in e or "alloc" in e or "compute" in e]
        raise _Stop(kind, f"llama_decode ({what}) returned {ret}" + (f": {errs[-1]}" if errs else ""), with_runs=True)

    def prefill(self, c: Any, b: _Batch, toks: list[int]) -> None:
        for off in range(0, len(toks), self.n_batch):
            self.decode(c, b.fill(toks[off:off + self.n_batch], off), "prompt")

    def run_prompts(self) -> None:
        l, req = self.l, self.req
        self.hook("prompt")
        self.n_prompt, self.n_gen = int(req["prompt_tokens"]), int(req["gen_tokens"])
        if self.n_prompt + self.n_gen > l.llama_n_ctx_seq(self.ctx):
            raise _Stop("error", f"prompt ({self.n_prompt}) + generation ({self.n_gen}) tokens exceed the context of a "
                                 f"sequence (n_ctx_seq = {l.llama_n_ctx_seq(self.ctx)})")
        self.mem = l.llama_get_memory(self.ctx)
        self.dmem = l.llama_get_memory(self.dctx) if self.dctx else None
        self.perf = _Perf(l, self.ctx)
        self.dperf = _Perf(l, self.dctx) if self.dctx else None
        spec = req.get("spec")
        self.n_max = int(spec["n_max"]) if spec else 0
        self.batch = _Batch(l, max(self.n_batch, self.n_max + 1))
        self.dbatch = _Batch(l, max(self.n_batch, self.n_max + 1)) if self.dctx else None
        self.smpl = l.llama_sampler_chain_init(l.llama_sampler_chain_default_params())
        l.llama_sampler_chain_add(self.smpl, l.llama_sampler_init_greedy())
        for i, text in enumerate(req["prompts"]):
            run = self.run_prompt(i, text)
            emit_event({"event": "run", "index": i, **run})
            self.runs.append(run)

    def run_prompt(self, i: int, text: str) -> dict[str, Any]:
        """One prompt: prefill (time to first token), then decode the rest, plain or speculative."""
        l = self.l
        l.llama_memory_clear(self.mem, True)
        if self.dmem is not None:
            l.llama_memory_clear(self.dmem, True)
        l.llama_sampler_reset(self.smpl)
        toks = _tokenize(l, self.vocab, text, self.n_prompt)
        if len(toks) < self.n_prompt:
            raise _Stop("error", f"prompt {i} gave only {len(toks)} tokens, {self.n_prompt} wanted")
        emit_event({"event": "phase", "index": i, "phase": "prefill", "tokens": len(toks)})
        p0 = self.perf.snap()
        t0 = time.perf_counter()
        self.prefill(self.ctx, self.batch, toks)
        tok = l.llama_sampler_sample(self.smpl, self.ctx, -1)  # synchronizes: the prompt is done
        ttft = time.perf_counter() - t0
        p1 = self.perf.snap()
        pre = _diff(p0, p1)
        run: dict[str, Any] = {"warmup": i < int(self.req.get("warmup", 0)), "prompt_tokens": len(toks),
                               "ttft_ms": ttft * 1e3, "prefill_ms": pre["t_p_eval_ms"] + pre["t_eval_ms"],
                               "prefill_n": pre["n_p_eval"] + pre["n_eval"]}
        if i == 0:
            self.hook("decode")
        emit_event({"event": "phase", "index": i, "phase": "decode", "tokens": self.n_gen})
        t1 = time.perf_counter()
        tick = _Ticker(i, self.n_gen)
        if self.speculation != "on":
            generated = self._decode_plain(toks, tok, tick)
            dec = _diff(p1, self.perf.snap())
            run.update(decode_ms=dec["t_p_eval_ms"] + dec["t_eval_ms"], decode_n=dec["n_p_eval"] + dec["n_eval"])
        else:
            d0 = self.dperf.snap()
            generated, n_drafted, n_accepted = self._decode_speculative(toks, tok, tick)
            dec, ddec = _diff(p1, self.perf.snap()), _diff(d0, self.dperf.snap())
            run.update(decode_ms=dec["t_p_eval_ms"] + dec["t_eval_ms"] + ddec["t_p_eval_ms"] + ddec["t_eval_ms"],
                       decode_n=len(generated) - 1, target_ms=dec["t_p_eval_ms"] + dec["t_eval_ms"],
                       draft_ms=ddec["t_p_eval_ms"] + ddec["t_eval_ms"], draft_n=n_drafted, draft_n_accepted=n_accepted)
        run["decode_wall_ms"] = (time.perf_counter() - t1) * 1e3
        run["generated_tokens"] = len(generated)
        return run

    def _decode_plain(self, toks: list[int], tok: int, tick: _Ticker) -> list[int]:
        generated = [tok]
        n_past = len(toks)
        while len(generated) < self.n_gen:
            tick(len(generated))
            self.decode(self.ctx, self.batch.fill([tok], n_past), "generation")
            n_past += 1
            tok = self.l.llama_sampler_sample(self.smpl, self.ctx, -1)
            generated.append(tok)
        return generated

    def _draft(self, seq: list[int], tok: int, d_past: int, want: int, p_min: float) -> tuple[list[int], int, Any]:
        """Draft up to `want` tokens after `tok` (greedy, while the top probability is at least p_min).
        (drafts, the draft context's new length, its checkpoint before drafting when its state is recurrent)"""
        pending = seq[d_past:] + [tok]
        self.decode(self.dctx, self.dbatch.fill(pending, d_past), "draft")
        d_past += len(pending)
        d_ckpt = (d_past, _Checkpoint(self.l, self.dctx)) if self.dft_rm == "full" else None
        drafts: list[int] = []
        while True:
            d, p = _top_p(self.l, self.dctx, -1, self.n_vocab)
            if p < p_min:
                break
            drafts.append(d)
            if len(drafts) >= want:
                break
            self.decode(self.dctx, self.dbatch.fill([d], d_past), "draft")
            d_past += 1
        return drafts, d_past, d_ckpt

    def _verify(self, tok: int, drafts: list[int], n_past: int) -> tuple[int, int]:
        """Verify [tok, drafts...] on the target; on recurrent state, a partial acceptance restores the checkpoint and
        replays the accepted tokens (llama-server's spec_is_replay). (accepted, the next token)"""
        l = self.l
        t_ckpt = _Checkpoint(l, self.ctx) if drafts and self.tgt_rm == "full" else None
        self.decode(self.ctx, self.batch.fill([tok] + drafts, n_past, outputs="all"), "verify")
        acc = 0
        nxt = l.llama_sampler_sample(self.smpl, self.ctx, 0)
        while acc < len(drafts) and nxt == drafts[acc]:
            acc += 1
            nxt = l.llama_sampler_sample(self.smpl, self.ctx, acc)
        if t_ckpt is not None and acc < len(drafts):
            t_ckpt.restore(n_past)
            self.decode(self.ctx, self.batch.fill([tok] + drafts[:acc], n_past), "replay")
        return acc, nxt

    def _decode_speculative(self, toks: list[int], tok: int, tick: _Ticker) -> tuple[list[int], int, int]:
        """Draft-then-verify, greedy (common/speculative.cpp draft-simple + the server's verification).
        (generated tokens, drafted, accepted)"""
        spec = self.req["spec"]
        if len(toks) > 1:
            self.prefill(self.dctx, self.dbatch, toks[:-1])
        d_past = len(toks) - 1  # tokens the draft context holds
        n_past = len(toks)
        seq = list(toks)  # prompt + accepted tokens; `tok` (the last sampled) is not in either KV yet
        generated = [tok]
        n_drafted = n_accepted = 0
        p_min, n_min = float(spec["p_min"]), int(spec["n_min"])
        try:
            while len(generated) < self.n_gen:
                tick(len(generated))
                want = min(self.n_max, self.n_gen - len(generated))
                drafts: list[int] = []
                d_ckpt = None
                if want > 0:
                    drafts, d_past, d_ckpt = self._draft(seq, tok, d_past, want, p_min)
                    if len(drafts) < n_min:
                        drafts = []
                acc, nxt = self._verify(tok, drafts, n_past)
                n_drafted += len(drafts)
                n_accepted += acc
                seq += [tok] + drafts[:acc]
                n_past += 1 + acc
                # drop the rejected drafts from both caches
                self.l.llama_memory_seq_rm(self.mem, 0, n_past, -1)
                if d_past > n_past:
                    if d_ckpt is not None:  # back to the last accepted token; the next draft step re-decodes the rest
                        d_ckpt[1].restore(d_ckpt[0])
                        d_past = d_ckpt[0]
                    else:
                        self.l.llama_memory_seq_rm(self.dmem, 0, n_past, -1)
                        d_past = n_past
                generated += drafts[:acc] + [nxt]
                tok = nxt
        except RuntimeError as e:  # a checkpoint that llama.cpp would not save or restore
            raise _Stop("error", str(e), with_runs=True) from None
        return generated[:self.n_gen], n_drafted, n_accepted

    def free(self) -> None:
        l = self.l
        self.hook("free")
        self.batch.free()
        if self.dbatch:
            self.dbatch.free()
        l.llama_sampler_free(self.smpl)
        if self.dctx:
            l.llama_free(self.dctx)
        if self.dmodel:
            l.llama_model_free(self.dmodel)
        l.llama_free(self.ctx)
        if self.pool is not None:
            self.pool[0](self.pool[1])
        l.llama_model_free(self.model)


def main() -> int:
    raw = sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read()
    req = json.loads(raw)
    emit_event({"event": "start", "pid": os.getpid()})
    t_start = time.perf_counter()

    import llama_cpp as l  # noqa: PLC0415  (heavy, and what this child exists to isolate: imported after "start")

    log = ChildLog(GGML_LOG_DEBUG if req.get("log_level", "info") == "debug" else GGML_LOG_INFO)
    cb = l.llama_log_callback(log)
    l.llama_log_set(cb, ctypes.c_void_p(0))
    ggml = load_ggml_base(l)
    emit_event({"event": "build", **build_info(l, ggml), "gpu_offload": bool(l.llama_supports_gpu_offload())})
    child = _Child(l, req, log, ggml, t_start)
    l.llama_backend_init()
    child.limit_memory()
    child.timings["import_s"] = time.perf_counter() - t_start
    try:
        child.load()
        if req.get("spec"):
            child.load_draft(req["spec"])
        child.run_prompts()
    except _Stop as e:
        return child.done(e.status, e.message, **({"runs": child.runs} if e.with_runs else {}))
    child.free()
    child.timings["total_s"] = time.perf_counter() - t_start
    return child.done("ok", None, runs=child.runs, speculation=child.speculation,
                      speculation_message=child.spec_message)


if __name__ == "__main__":
    sys.exit(main())
