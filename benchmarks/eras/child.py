"""Dry-run child for any llama-cpp-python release (old APIs included): one model, many contexts.

Run as `python benchmarks/eras/child.py '<json>'` with PYTHONPATH pointing at the release's install
(`/work/eras/site/0.3.N`), so that release's llama_cpp is imported. Only the standard library and
llama_cpp are imported here. Unlike fitter/_llama_child.py it sets only the params this release has:

  request: {"model_path": str, "n_gpu_layers": int (default 0; -1 = all, on a GPU build),
            "contexts": [{"id": str, "fields": {...}}, ...]}
      fields are llama_context_params fields; "flash_attn" ("on"/"off") is mapped to flash_attn_type
      (enum, newer releases) or flash_attn (bool, older releases); a field the release's
      llama_context_params lacks is skipped and reported.
  stdout: one JSON line per event: build, model (with the log of the model load), context (one per
      request entry: its log, which fields were skipped, ok/error), done.

The model is loaded with no_alloc = true and load_mode = none where the release has them (a dry
run, as common_get_device_memory_data); an older release loads the tiny synthetic model for real.
use_extra_bufts = false where it exists (as ggfit's runs).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys


def _emit(obj):
    os.write(1, (json.dumps(obj) + "\n").encode())


def main() -> int:
    req = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    import llama_cpp  # noqa: PLC0415

    buf: list[str] = []

    def _cb(level, text, _ud):
        if text:
            buf.append(text.decode("utf-8", "replace"))

    cb = llama_cpp.llama_log_callback(_cb)
    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))

    def take() -> str:
        s = "".join(buf)
        buf.clear()
        return s

    llama_cpp.llama_backend_init()
    info = {"llama_cpp_python": getattr(llama_cpp, "__version__", None)}
    try:
        info["system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    except Exception:  # noqa: BLE001
        info["system_info"] = None
    _emit({"event": "build", **info, "log": take()})

    mp = llama_cpp.llama_model_default_params()
    mfields = {name for name, _ in mp._fields_}
    applied = {}
    if "no_alloc" in mfields:
        mp.no_alloc = True
        applied["no_alloc"] = True
    if "load_mode" in mfields:
        mp.load_mode = 0  # LLAMA_LOAD_MODE_NONE
        applied["load_mode"] = "none"
    elif "no_alloc" in mfields and "use_mmap" in mfields:
        # before load_mode: no_alloc asserts !use_mmap (llama_model::load_tensors), as common_get_device_memory_data sets
        mp.use_mmap = False
        applied["use_mmap"] = False
    if "use_extra_bufts" in mfields:
        mp.use_extra_bufts = False
        applied["use_extra_bufts"] = False
    mp.n_gpu_layers = int(req.get("n_gpu_layers", 0))
    model = llama_cpp.llama_model_load_from_file(req["model_path"].encode(), mp)
    log = take()
    if not model:
        _emit({"event": "model", "ok": False, "applied": applied, "log": log})
        _emit({"event": "done"})
        return 0
    _emit({"event": "model", "ok": True, "applied": applied, "log": log})

    for c in req["contexts"]:
        cp = llama_cpp.llama_context_default_params()
        cfields = {name for name, _ in cp._fields_}
        skipped = []
        for k, v in c["fields"].items():
            if k == "flash_attn":
                if "flash_attn_type" in cfields:
                    cp.flash_attn_type = {"off": 0, "on": 1, "auto": -1}[v]
                elif "flash_attn" in cfields:
                    cp.flash_attn = v == "on"
                else:
                    skipped.append(k)
                continue
            if k in cfields:
                setattr(cp, k, v)
            else:
                skipped.append(k)
        ctx = llama_cpp.llama_init_from_model(model, cp)
        ok = bool(ctx)
        if ctx:
            llama_cpp.llama_free(ctx)
        _emit({"event": "context", "id": c["id"], "ok": ok, "skipped": skipped, "log": take()})
    llama_cpp.llama_model_free(model)
    _emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
