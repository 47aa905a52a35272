"""Child process of `fitter.oracle.llama_run`: load a model and create a context with llama.cpp, then exit.

Run as `python -m fitter.oracle._llama_child '<json>'` (or with the JSON request on stdin). Only the
standard library and llama_cpp are imported here, so a native abort kills nothing but this process.

Protocol
  stdin/argv: {"model_path": str, "mode": "dry"|"load", "model": {field: value}, "context": {field: value},
               "log_level": "debug"|"info", "breakdown": bool, "test_signal": null|"SIGABRT"|...,
               "device_memory": bool, "decode_tokens": int}
      device_memory: emit a "memory" event (free/total of every non-CPU device, ggml_backend_dev_memory, i.e.
      cudaMemGetInfo on CUDA) at each stage: start, model, context, decode.
      decode_tokens (mode "load" only): llama_decode that many prompt tokens, n_batch at a time, after the context.
      "model"/"context" hold raw llama_model_params / llama_context_params field values (ints/bools);
      type_k/type_v come as [name, id] and are checked against the loaded ggml's ggml_type_name(id);
      load_mode comes as its llama_load_mode_from_str name.
  stderr: llama.cpp's whole log, verbatim (the log callback writes each message to fd 2 as it comes, so a
      crash keeps everything up to the abort; ggml_abort's own message lands on fd 2 too, in order).
  stdout: one JSON object per line, each with an "event": start, build, model, context, breakdown, memory, decode,
      done.
      A missing "done" means the child died.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from typing import Any

# ggml_log_level (ggml.h): NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
GGML_LOG_DEBUG, GGML_LOG_INFO, GGML_LOG_WARN, GGML_LOG_ERROR, GGML_LOG_CONT = 1, 2, 3, 4, 5


# what asking a llama.cpp build for something it lacks raises: a missing symbol, a NULL string, bad bytes
_FFI_FAILURES = (AttributeError, OSError, UnicodeDecodeError, ctypes.ArgumentError)


def emit_event(obj: dict[str, Any]) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


class ChildLog:
    """The llama_log_set callback: every message to fd 2, and ERROR/WARN messages remembered by level."""

    def __init__(self, min_level: int):
        self.min_level = min_level
        self.last_level = GGML_LOG_INFO
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def __call__(self, level: int, text: bytes | None, _user_data: Any) -> None:
        if text is None:
            return
        eff = self.last_level if level == GGML_LOG_CONT else level
        if level != GGML_LOG_CONT:
            self.last_level = level
        if eff == GGML_LOG_DEBUG and self.min_level > GGML_LOG_DEBUG:
            return
        try:
            os.write(2, text)
        except OSError:
            pass
        if level == GGML_LOG_CONT:
            return
        msg = text.decode("utf-8", "replace").strip()
        if not msg:
            return
        if eff == GGML_LOG_ERROR:
            self.errors.append(msg)
        elif eff == GGML_LOG_WARN:
            self.warnings.append(msg)


def load_ggml_base(llama_cpp: Any, lib: str = "ggml-base") -> ctypes.CDLL | None:
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for name in (f"lib{lib}.so", f"lib{lib}.dylib", f"{lib}.dll"):
        p = os.path.join(libdir, name)
        if os.path.exists(p):
            try:
                return ctypes.CDLL(p)
            except OSError:
                return None
    return None


def build_info(llama_cpp: Any, ggml: ctypes.CDLL | None) -> dict[str, Any]:
    info: dict[str, Any] = {"llama_cpp_python": getattr(llama_cpp, "__version__", None)}
    try:
        info["llama_version"] = llama_cpp.llama_version().decode()
    except _FFI_FAILURES:
        info["llama_version"] = None
    try:
        info["system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    except _FFI_FAILURES:
        info["system_info"] = None
    for sym in ("ggml_commit", "ggml_version"):
        val = None
        if ggml is not None and hasattr(ggml, sym):
            f = getattr(ggml, sym)
            f.restype = ctypes.c_char_p
            f.argtypes = []
            try:
                val = f().decode()
            except _FFI_FAILURES:
                val = None
        info[sym] = val
    return info


def lib_type_name(ggml: ctypes.CDLL | None, type_id: int) -> str | None:
    """ggml_type_name() of the loaded ggml; only called for ids of the parent's table (no bounds check there)."""
    if ggml is None:
        return None
    f = ggml.ggml_type_name
    f.restype = ctypes.c_char_p
    f.argtypes = [ctypes.c_int]
    name = f(type_id)
    return name.decode("utf-8", "replace") if name else None


def _memory_breakdown(llama_cpp: Any, ggml: ctypes.CDLL | None, ctx: Any) -> list[dict[str, Any]] | None:
    """Exact bytes per buffer type from `llama_get_memory_breakdown` (src/llama-ext.h), as common_get_device_memory_data uses.

    The function returns a `std::map<ggml_backend_buffer_type_t, llama_memory_breakdown_data>` by value,
    so it is called through the Itanium C++ ABI (hidden return-slot pointer first) and the red-black tree
    of libstdc++ is walked by hand: map = {compare (8), header {color, parent=root, left, right} (32),
    count (8)}; node = {color, parent, left, right} then the pair {key, model, context, compute}.
    Only on Linux (libstdc++); anything that looks wrong returns None instead of guessing.
    """
    if not sys.platform.startswith("linux") or ggml is None:
        return None
    lib = llama_cpp.llama_cpp._lib
    sym = "_Z26llama_get_memory_breakdownPK13llama_context"
    if not hasattr(lib, sym):
        return None
    fn = getattr(lib, sym)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_void_p
    slot = (ctypes.c_uint64 * 16)()  # 48 bytes needed; the map is leaked on purpose (the process exits)
    ret = fn(ctypes.addressof(slot), ctx)
    if ret != ctypes.addressof(slot):
        return None
    header = ctypes.addressof(slot) + 8
    root, count = slot[2], slot[5]
    if count > 1024 or (count > 0 and root == 0):
        return None

    rows = _map_rows(ggml, root, header, count)
    return rows if len(rows) == count else None


def _map_rows(ggml: ctypes.CDLL, root: int, header: int, count: int) -> list[dict[str, Any]]:
    """The rows of the std::map _memory_breakdown got, in key order (an in-order walk of libstdc++'s tree)."""
    def rd(addr: int) -> int:
        return ctypes.c_uint64.from_address(addr).value

    name_fn = ggml.ggml_backend_buft_name
    name_fn.restype = ctypes.c_char_p
    name_fn.argtypes = [ctypes.c_void_p]
    host_fn = ggml.ggml_backend_buft_is_host
    host_fn.restype = ctypes.c_bool
    host_fn.argtypes = [ctypes.c_void_p]

    rows: list[dict[str, Any]] = []
    stack: list[int] = []
    node = root
    while (stack or node) and len(rows) <= count:  # in-order walk
        while node and node != header:
            stack.append(node)
            node = rd(node + 16)
        if not stack:
            break
        node = stack.pop()
        buft = rd(node + 32)
        rows.append(
            {
                "buffer_type": (name_fn(buft) or b"?").decode(),
                "is_host": bool(host_fn(buft)),
                "model": rd(node + 40),
                "context": rd(node + 48),
                "compute": rd(node + 56),
            }
        )
        node = rd(node + 24)
    return rows


def _declare_devices(ggml: ctypes.CDLL) -> None:
    """ggml_backend_dev_count / ggml_backend_dev_get, as ggml-backend.h declares them."""
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]


def _device_memory(ggml: ctypes.CDLL | None) -> list[dict[str, Any]]:
    """free/total of each non-CPU backend device (ggml_backend_dev_memory: cudaMemGetInfo on CUDA)."""
    if ggml is None:
        return []
    _declare_devices(ggml)
    ggml.ggml_backend_dev_type.restype = ctypes.c_int
    ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_name.restype = ctypes.c_char_p
    ggml.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    out = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        if ggml.ggml_backend_dev_type(dev) == 0:  # GGML_BACKEND_DEVICE_TYPE_CPU
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({"device": (ggml.ggml_backend_dev_name(dev) or b"?").decode(), "free": free.value, "total": total.value})
    return out


def _decode(llama_cpp: Any, ctx: Any, n_tokens: int, n_vocab: int) -> str | None:
    """llama_decode n_tokens prompt tokens, n_batch at a time; an error message, or None."""
    toks = (llama_cpp.llama_token * n_tokens)(*[(1 + 7919 * i) % n_vocab for i in range(n_tokens)])
    n_batch = llama_cpp.llama_n_batch(ctx)
    for off in range(0, n_tokens, n_batch):
        n = min(n_batch, n_tokens - off)
        ptr = ctypes.cast(ctypes.byref(toks, off * ctypes.sizeof(llama_cpp.llama_token)), ctypes.POINTER(llama_cpp.llama_token))
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ptr, n))
        if rc != 0:
            return f"llama_decode returned {rc} at token {off}"
    return None


def apply_fields(struct: Any, fields: dict[str, Any]) -> None:
    for k, v in fields.items():
        setattr(struct, k, v)


_LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}  # enum llama_load_mode


def _buft_by_name(llama_cpp: Any) -> dict[str, int]:
    """Each device's default buffer type by its name, as common/arg.cpp parse_tensor_buffer_overrides lists them."""
    ggml = load_ggml_base(llama_cpp, "ggml")
    base = load_ggml_base(llama_cpp)
    if ggml is None or base is None:
        return {}
    _declare_devices(ggml)
    base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    out = {}
    for i in range(ggml.ggml_backend_dev_count()):
        buft = base.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_get(i))
        if buft:
            out[(base.ggml_backend_buft_name(buft) or b"?").decode()] = buft
    return out


class _BuftOverride(ctypes.Structure):  # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def apply_placement(llama_cpp: Any, mp: Any, fields: dict[str, Any]) -> None:
    """Pops tensor_buft_overrides ([pattern, buffer type name] pairs) and tensor_split from `fields` and sets them on
    llama_model_params `mp`: tensor_buft_overrides (NULL-terminated) and tensor_split (llama_max_devices() floats) as pointers.
    The arrays they point to live as long as `mp` (its attribute `ggfit_arrays`)."""
    keep: list[Any] = []
    overrides = fields.pop("tensor_buft_overrides", None)
    if overrides:
        bufts = _buft_by_name(llama_cpp)
        unknown = [b for _, b in overrides if b not in bufts]
        if unknown:
            raise ValueError(f"unknown buffer type {unknown[0]!r} (this build has {', '.join(sorted(bufts))})")
        arr = (_BuftOverride * (len(overrides) + 1))()
        for i, (pat, b) in enumerate(overrides):
            arr[i].pattern = pat.encode()
            arr[i].buft = bufts[b]
        keep.append(arr)
        mp.tensor_buft_overrides = ctypes.addressof(arr)
    split = fields.pop("tensor_split", None)
    if split:
        ts = (ctypes.c_float * max(len(split), llama_cpp.llama_max_devices()))(*split)
        keep.append(ts)
        mp.tensor_split = ctypes.cast(ts, ctypes.POINTER(ctypes.c_float))
    if keep:
        mp.ggfit_arrays = keep


def load_loras(llama_cpp: Any, model: Any, loras: list[list[Any]]) -> tuple[list[Any], str | None]:
    """llama_adapter_lora_init for each [path, scale], after the model (common_init_result); the adapters, or why
    not (llama.cpp's own error line is in the log)."""
    out: list[Any] = []
    for path, _scale in loras:
        a = llama_cpp.llama_adapter_lora_init(model, str(path).encode())
        if not a:
            return out, f"failed to load lora adapter '{path}'"
        out.append(a)
    return out, None


def set_loras(llama_cpp: Any, ctx: Any, adapters: list[Any], loras: list[list[Any]]) -> None:
    """llama_set_adapters_lora with every adapter and its scale (common_set_adapter_lora): the next decode
    re-reserves the compute graph with them (llama_context::set_adapters_lora sets sched_need_reserve). The context
    copies the adapters and scales into its own map: the arrays need not outlive the call."""
    if not adapters:
        return
    arr = (llama_cpp.llama_adapter_lora_p_ctypes * len(adapters))(*adapters)
    scales = (ctypes.c_float * len(adapters))(*[float(s) for _, s in loras])
    llama_cpp.llama_set_adapters_lora(ctx, arr, len(adapters), scales)


def _model_params(llama_cpp: Any, req: dict[str, Any]) -> Any:
    mp = llama_cpp.llama_model_default_params()
    model_fields = dict(req.get("model", {}))
    apply_placement(llama_cpp, mp, model_fields)
    load_mode = model_fields.pop("load_mode", None)
    if load_mode is not None:
        mp.load_mode = _LOAD_MODES[load_mode]
    apply_fields(mp, model_fields)
    if req["mode"] == "dry":
        # as common_get_device_memory_data (common/fit.cpp): simulate allocations, read no tensor data
        mp.no_alloc = True
        mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    return mp


def _context_params(llama_cpp: Any, ggml: ctypes.CDLL | None, req: dict[str, Any]) -> tuple[Any, str | None]:
    """llama_context_params from the request, or why not (a K/V type id the loaded ggml names otherwise)."""
    cp = llama_cpp.llama_context_default_params()
    ctx_fields = dict(req.get("context", {}))
    for key in ("type_k", "type_v"):
        if key in ctx_fields:
            name, type_id = ctx_fields[key]  # [name, id] from the parent's enum ggml_type table
            have = lib_type_name(ggml, type_id)
            if have is not None and have.lower() != name.lower():
                return cp, f"ggml type id {type_id} is {have!r} in this build, not {name!r}: ggfit's type table is stale"
            ctx_fields[key] = type_id
    apply_fields(cp, ctx_fields)
    return cp, None


def _model_api(llama_cpp: Any, model: Any) -> dict[str, Any]:
    """What the C API says of the loaded model."""
    api: dict[str, Any] = {
        "model_size": llama_cpp.llama_model_size(model),
        "model_n_params": llama_cpp.llama_model_n_params(model),
        "n_layer": llama_cpp.llama_model_n_layer(model),
        "n_ctx_train": llama_cpp.llama_model_n_ctx_train(model),
        "n_embd": llama_cpp.llama_model_n_embd(model),
        "n_head": llama_cpp.llama_model_n_head(model),
        "n_head_kv": llama_cpp.llama_model_n_head_kv(model),
        "n_swa": llama_cpp.llama_model_n_swa(model),
        "n_vocab": llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)),
        "is_recurrent": bool(llama_cpp.llama_model_is_recurrent(model)),
        "is_hybrid": bool(llama_cpp.llama_model_is_hybrid(model)),
    }
    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, buf, 256)
    api["desc"] = buf.value.decode("utf-8", "replace")
    return api


class _Run:
    """The child's reporting: the log callback, device memory per stage, the closing "done" event."""

    def __init__(self, llama_cpp: Any, req: dict[str, Any]) -> None:
        self.log = ChildLog(GGML_LOG_DEBUG if req.get("log_level", "debug") == "debug" else GGML_LOG_INFO)
        self.cb = llama_cpp.llama_log_callback(self.log)  # keep a reference for the process lifetime
        llama_cpp.llama_log_set(self.cb, ctypes.c_void_p(0))
        self.ggml = load_ggml_base(llama_cpp)
        emit_event({"event": "build", **build_info(llama_cpp, self.ggml)})
        self.devices = load_ggml_base(llama_cpp, "ggml") if req.get("device_memory") else None

    def memory(self, stage: str) -> None:
        if self.devices is not None:
            emit_event({"event": "memory", "stage": stage, "devices": _device_memory(self.devices)})

    def done(self, status: str, message: str | None = None, **extra: Any) -> int:
        emit_event({"event": "done", "status": status, "message": message, "errors": self.log.errors,
               "warnings": self.log.warnings, **extra})
        return 0

    def first_error(self, default: str) -> str:
        return self.log.errors[0] if self.log.errors else default


def main() -> int:
    raw = sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read()
    req = json.loads(raw)
    emit_event({"event": "start", "pid": os.getpid()})
    t0 = time.perf_counter()

    import llama_cpp  # noqa: PLC0415 - imported here so a broken install is reported as an event

    timings: dict[str, float] = {"import_s": time.perf_counter() - t0}
    run = _Run(llama_cpp, req)
    llama_cpp.llama_backend_init()
    run.memory("start")
    try:
        mp = _model_params(llama_cpp, req)
    except ValueError as e:
        return run.done("error", str(e))
    cp, why = _context_params(llama_cpp, run.ggml, req)
    if why:
        return run.done("error", why)

    t1 = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(req["model_path"].encode(), mp)
    timings["model_s"] = time.perf_counter() - t1
    if not model:
        return run.done("error", run.first_error("llama_model_load_from_file returned NULL"), timings=timings)
    api = _model_api(llama_cpp, model)
    emit_event({"event": "model", "api": api, "no_alloc": bool(mp.no_alloc), "load_mode": int(mp.load_mode)})
    run.memory("model")
    loras = req.get("loras") or []
    adapters, why = load_loras(llama_cpp, model, loras)
    if why:
        llama_cpp.llama_model_free(model)
        return run.done("error", run.first_error(why), timings=timings)

    return _with_context(llama_cpp, run, req, model, cp, api, adapters, loras, timings, t0)


def _with_context(llama_cpp: Any, run: _Run, req: dict[str, Any], model: Any, cp: Any, api: dict[str, Any],
                  adapters: list[Any], loras: list[list[Any]], timings: dict[str, float], t0: float) -> int:
    """main's second half, the model loaded: the context, its breakdown, a decode, then both freed."""
    t2 = time.perf_counter()
    ctx = llama_cpp.llama_init_from_model(model, cp)
    timings["context_s"] = time.perf_counter() - t2
    if not ctx:
        msg = run.first_error("llama_init_from_model returned NULL")
        llama_cpp.llama_model_free(model)
        return run.done("error", msg, timings=timings)
    emit_event({"event": "context", "api": {
        "n_ctx": llama_cpp.llama_n_ctx(ctx), "n_ctx_seq": llama_cpp.llama_n_ctx_seq(ctx),
        "n_batch": llama_cpp.llama_n_batch(ctx), "n_ubatch": llama_cpp.llama_n_ubatch(ctx),
        "n_seq_max": llama_cpp.llama_n_seq_max(ctx),
    }})
    run.memory("context")
    set_loras(llama_cpp, ctx, adapters, loras)

    if req.get("breakdown", True):
        _emit_breakdown(llama_cpp, run, ctx)

    sig = req.get("test_signal")
    if sig:  # test-only hook: die like a native crash would, after everything above was reported
        os.kill(os.getpid(), getattr(signal, sig))
        time.sleep(5)

    n_decode = int(req.get("decode_tokens") or 0)
    if n_decode and req["mode"] == "load":
        t4 = time.perf_counter()
        err = _decode(llama_cpp, ctx, n_decode, api["n_vocab"])
        timings["decode_s"] = time.perf_counter() - t4
        emit_event({"event": "decode", "tokens": n_decode, "error": err})
        run.memory("decode")
        if adapters and req.get("breakdown", True) and not err:  # the graph re-reserved with the adapters
            _emit_breakdown(llama_cpp, run, ctx)
        if err:
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)
            return run.done("error", err, timings=timings)

    t3 = time.perf_counter()
    llama_cpp.llama_free(ctx)  # a real context logs its DEBUG "compute buffer size is %8.4f MiB" check here
    llama_cpp.llama_model_free(model)
    timings["free_s"] = time.perf_counter() - t3
    timings["total_s"] = time.perf_counter() - t0
    return run.done("ok", timings=timings)


def _emit_breakdown(llama_cpp: Any, run: _Run, ctx: Any) -> None:
    try:
        rows = _memory_breakdown(llama_cpp, run.ggml, ctx)
    except (*_FFI_FAILURES, ValueError):  # a build whose breakdown is not as expected: the breakdown is a bonus
        rows = None
    emit_event({"event": "breakdown", "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
