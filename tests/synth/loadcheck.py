"""Load a GGUF with llama.cpp in a child process, decode a few tokens, report what llama.cpp says.

A GGML assert aborts the whole process, so the load always happens in a child Python
(``sys.executable``); a crash there becomes a ``LlamaCppError`` carrying the last log lines.
The model is loaded with ``use_extra_bufts=False`` and ``n_gpu_layers=0`` (see the project notes:
extra CPU buffer types SIGILL / abort on this machine).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from os import PathLike
from typing import Any

__all__ = ["LlamaCppError", "load_and_decode", "parse_print_info"]

RESULT_MARK = "@@LOADCHECK_RESULT@@ "


class LlamaCppError(RuntimeError):
    """llama.cpp refused the model or crashed; ``log`` holds everything it printed."""

    def __init__(self, message: str, log: str, returncode: int | None = None):
        self.log = log
        self.returncode = returncode
        tail = "\n".join(log.splitlines()[-40:])
        super().__init__(f"{message}\n--- last llama.cpp log lines ---\n{tail}")


# The child: plain llama.cpp C API through llama_cpp's ctypes bindings. Logs go straight to fd 2
# (unbuffered), so they survive an abort; the result is one marked JSON line on stdout.
_CHILD = r"""
import ctypes, json, math, os, sys
args = json.loads(sys.argv[1])
import llama_cpp as L

MIN_LEVEL = args.get("log_level", 2)  # ggml_log_level: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
_last = [2]

@L.llama_log_callback
def _log(level, text, user_data):
    if level != 5:
        _last[0] = level
    if text and _last[0] >= MIN_LEVEL:
        os.write(2, text)
L.llama_log_set(_log, ctypes.c_void_p(0))

def fail(stage, code):
    os.write(2, ("\n@@LOADCHECK_FAIL@@ " + stage + "\n").encode())
    sys.exit(code)

L.llama_backend_init()
mp = L.llama_model_default_params()
mp.n_gpu_layers = 0
mp.use_extra_bufts = False
for k, v in args.get("model_params", {}).items():
    setattr(mp, k, v)
model = L.llama_model_load_from_file(args["path"].encode(), mp)
if not model:
    fail("load", 3)

vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
buf = ctypes.create_string_buffer(512)
L.llama_model_desc(model, buf, 512)
res = {
    "n_vocab": n_vocab,
    "n_layer": L.llama_model_n_layer(model),
    "n_head": L.llama_model_n_head(model),
    "n_head_kv": L.llama_model_n_head_kv(model),
    "n_embd": L.llama_model_n_embd(model),
    "n_ctx_train": L.llama_model_n_ctx_train(model),
    "n_swa": L.llama_model_n_swa(model),
    "desc": buf.value.decode(errors="replace"),
    "model_size": L.llama_model_size(model),
    "n_params": L.llama_model_n_params(model),
}

cp = L.llama_context_default_params()
cp.n_threads = cp.n_threads_batch = args.get("n_threads", 2)
for k, v in args["ctx_params"].items():
    setattr(cp, k, v)
ctx = L.llama_init_from_model(model, cp)
if not ctx:
    fail("context", 4)
res["n_ctx"] = L.llama_n_ctx(ctx)

prompt = args["prompt"].encode()
toks = (L.llama_token * (len(prompt) + 8))()
n = L.llama_tokenize(vocab, prompt, len(prompt), toks, len(toks), True, False)
if n <= 0:
    fail("tokenize", 5)
res["prompt_tokens"] = list(toks[:n])

def decode(tok_list):
    arr = (L.llama_token * len(tok_list))(*tok_list)
    rc = L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tok_list)))
    if rc != 0:
        os.write(2, ("llama_decode returned %d\n" % rc).encode())
        fail("decode", 6)
    lp = L.llama_get_logits_ith(ctx, -1)
    row = [lp[i] for i in range(n_vocab)]
    ok = all(math.isfinite(x) for x in row)
    best = max(range(n_vocab), key=row.__getitem__)
    return ok, best, max(abs(x) for x in row)

finite, tok, amax = decode(res["prompt_tokens"])
gen = []
for _ in range(args["n_tokens"]):
    gen.append(tok)
    ok, tok, m = decode([tok])
    finite = finite and ok
    amax = max(amax, m)
res["generated"] = gen
res["finite_logits"] = finite
res["max_abs_logit"] = amax
L.llama_free(ctx)
L.llama_model_free(model)
sys.stdout.write("\n" + "@@LOADCHECK_RESULT@@ " + json.dumps(res) + "\n")
sys.stdout.flush()
"""

_PRINT_INFO = re.compile(r"^print_info:\s+(?P<key>[^=]+?)\s+=\s+(?P<val>.*?)\s*$")


def parse_print_info(log: str) -> dict[str, str]:
    """``print_info: key = value`` lines of a llama.cpp log (llama_model::print_info and
    llama_vocab::print_info), values as printed."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        m = _PRINT_INFO.match(line)
        if m:
            out.setdefault(m["key"], m["val"])
    return out


def _ggml_type_value(v: Any) -> Any:
    if isinstance(v, str):
        from gguf import GGMLQuantizationType

        return int(GGMLQuantizationType[v.upper()])
    return v


def load_and_decode(
    path: str | PathLike[str],
    n_tokens: int = 4,
    *,
    prompt: str = "hello world",
    timeout: float = 300.0,
    model_params: dict[str, Any] | None = None,
    log_level: str = "info",
    **ctx_params: Any,
) -> dict[str, Any]:
    """Load ``path`` in a child process, decode ``prompt`` then ``n_tokens`` greedy tokens.

    ``ctx_params`` are ``llama_context_params`` fields (default ``n_ctx=256``, ``n_batch`` and
    ``n_ubatch`` 64; everything else is llama.cpp's default, e.g. ``swa_full=True`` and
    ``flash_attn_type=-1`` (auto)); ``type_k``/``type_v`` may be given as ggml type names ('q8_0').
    ``log_level``: the least severe llama.cpp messages kept ('debug' adds per-layer KV-cache
    placement and graph inputs, 'info', 'warn', 'error').
    Returns llama.cpp's numbers (n_vocab, n_ctx, n_layer, n_head, n_head_kv, n_embd, n_ctx_train,
    n_swa, desc, model_size, n_params), ``finite_logits``, ``generated``, the whole ``log`` and its
    ``print_info`` lines as a dict. Raises ``LlamaCppError`` if the child fails or crashes.
    """
    cp = {"n_ctx": 256, "n_batch": 64, "n_ubatch": 64}
    cp.update(ctx_params)
    for k in ("type_k", "type_v"):
        if k in cp:
            cp[k] = _ggml_type_value(cp[k])
    args = {
        "path": str(path),
        "n_tokens": n_tokens,
        "prompt": prompt,
        "ctx_params": cp,
        "model_params": model_params or {},
        "log_level": {"debug": 1, "info": 2, "warn": 3, "error": 4}[log_level],
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(args)],
            capture_output=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        log = (e.stderr or b"").decode(errors="replace")
        raise LlamaCppError(f"llama.cpp child timed out after {timeout}s on {path}", log) from None
    log = proc.stderr.decode(errors="replace")
    out = proc.stdout.decode(errors="replace")
    result = None
    for line in out.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK) :])
    if proc.returncode != 0 or result is None:
        stage = re.findall(r"@@LOADCHECK_FAIL@@ (\w+)", log)
        what = f"failed at {stage[-1]}" if stage else f"exited with {proc.returncode}"
        if proc.returncode < 0:
            what = f"crashed with signal {-proc.returncode}"
        raise LlamaCppError(f"llama.cpp child {what} on {path}", log + out, proc.returncode)
    result["log"] = log
    result["print_info"] = parse_print_info(log)
    return result


def _main(argv: list[str]) -> None:
    """python -m tests.synth.loadcheck (MODEL.gguf | NAME [key=value ...]) [--ctx key=value ...]

    NAME builds the registered synthetic model with the overrides (JSON values, else strings);
    everything after --ctx goes to the context params. Prints the log and the result."""
    import os

    args, ctx = (argv[: argv.index("--ctx")], argv[argv.index("--ctx") + 1 :]) if "--ctx" in argv else (argv, [])

    def kv(items: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for a in items:
            k, _, v = a.partition("=")
            try:
                out[k] = json.loads(v)
            except ValueError:
                out[k] = v
        return out

    target = args[0]
    if not os.path.exists(target):
        from tests.synth import build

        target = str(build(target, **kv(args[1:])))
        print(target)
    r = load_and_decode(target, **kv(ctx))
    print(r.pop("log"))
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    _main(sys.argv[1:])
