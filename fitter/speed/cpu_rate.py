"""This CPU's matrix rates as llama.cpp's own CPU kernels reach them, measured once per machine, threads and build, and
cached (`cpu-rate.json` under fitter.cache.cache_root(), beside host-bandwidth.json).

Per type class (fitter.speed.work.TYPE_CLASSES: Q4_K with a Q6_K ffn_down for `k`, Q8_0, Q4_0, F16) two small llama
models are written (random valid blocks, no vocabulary: tokenizer.ggml.model "none"), of 2 and 4 layers, and a child
process (fitter.speed._cpu_rate_child, the pinned llama-cpp-python, extra CPU buffer types off) times them at -t:

- prefill: one ubatch of PREFILL_TOKENS tokens (ggml_compute_forward_mul_mat: the rows of each matrix split among
  the threads, llamafile's sgemm for Q8_0 / Q4_0 / F16, vec_dot tiles for the K-quants);
- decode: single tokens through models small enough to stay in the caches, so that the time is the kernels' compute,
  not the memory's (the speed model takes the larger of this and the bytes over the bandwidth).

The rate is the difference of the two models' matmul FLOPs over the difference of their times (the embedding, the
output and the fixed costs per call cancel), in GFLOP/s per thread. About 5 s in all, the first time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fitter.cache import cache_root
from fitter.record import Record

RATE_CACHE = "cpu-rate.json"
CLASSES = ("k", "q8", "q4", "float")
PREFILL_TOKENS = 256
DECODE_TOKENS = 64
# the fastest of several: on a shared machine another process stalls llama.cpp's threads at each ggml_barrier, and
# the fastest run is the CPU's rate (each prefill run of these models takes 0.02-0.2 s)
PREFILL_REPEATS = 7
_LAYERS = (2, 4)  # both end in llama.cpp's cheap last layer (only the output rows past attention)
# (n_embd, n_ff, n_head, n_head_kv): prefill at a small real model's width; decode small enough for the L2/L3 caches
_PREFILL_DIMS = (1024, 4096, 16, 4)
_DECODE_DIMS = (512, 1536, 8, 2)
_TYPES = {"k": ("Q4_K", "Q6_K"), "q8": ("Q8_0", "Q8_0"), "q4": ("Q4_0", "Q4_0"), "float": ("F16", "F16")}
_TIMEOUT_S = 180.0


class CpuRate(Record):
    """GFLOP/s per thread by type class, at `threads`, from one measurement."""

    prefill_gflops: dict[str, float]
    decode_gflops: dict[str, float]
    threads: int
    source: str  # measured here (date), cached in ...; or the recording it was read from
    build: str = ""  # llama-cpp-python's version and ggml's system info


class CpuRateError(RuntimeError):
    """The measurement did not run (the child failed or timed out)."""


def _f16_scale_offsets(type_name: str) -> tuple[int, ...]:
    # block_q4_0 / block_q8_0: d first; block_q4_K: d, dmin first; block_q6_K: d last (ql, qh, scales before it)
    return {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[type_name]


def _tensor(rng: Any, type_name: str, ne0: int, ne1: int) -> tuple[Any, Any]:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if type_name in ("F16", "F32"):
        return (rng.standard_normal((ne1, ne0), dtype=np.float32) * 0.02).astype(type_name.lower().replace("f", "float")), None
    qt = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qt]
    data = rng.integers(0, 256, size=(ne1, ne0 // block, size), dtype=np.uint8)
    scale = np.array([0.001], dtype=np.float16).view(np.uint8)
    for off in _f16_scale_offsets(type_name):
        data[:, :, off:off + 2] = scale
    return data.reshape(ne1, -1), qt


def write_model(path: Path, cls: str, n_layer: int, dims: tuple[int, int, int, int]) -> Path:
    """A llama model of `n_layer` layers whose matrices are of type class `cls`, without a vocabulary (llama.cpp's
    LLAMA_VOCAB_TYPE_NONE with vocab_size dummy tokens)."""
    import numpy as np
    from gguf import GGUFWriter

    n_embd, n_ff, n_head, n_head_kv = dims
    n_vocab, n_kv = 256, n_embd // n_head * n_head_kv
    main, down = _TYPES[cls]
    rng = np.random.default_rng(0)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = GGUFWriter(str(tmp), "llama")
    for key, v in (("context_length", 4096), ("embedding_length", n_embd), ("block_count", n_layer),
                   ("feed_forward_length", n_ff), ("attention.head_count", n_head),
                   ("attention.head_count_kv", n_head_kv), ("vocab_size", n_vocab)):
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "none")
    mats = [("token_embd.weight", "F16", n_embd, n_vocab)]
    for i in range(n_layer):
        mats += [(f"blk.{i}.attn_q.weight", main, n_embd, n_embd), (f"blk.{i}.attn_k.weight", main, n_embd, n_kv),
                 (f"blk.{i}.attn_v.weight", main, n_embd, n_kv), (f"blk.{i}.attn_output.weight", main, n_embd, n_embd),
                 (f"blk.{i}.ffn_gate.weight", main, n_embd, n_ff), (f"blk.{i}.ffn_up.weight", main, n_embd, n_ff),
                 (f"blk.{i}.ffn_down.weight", down, n_ff, n_embd)]
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(n_layer) for n in ("attn", "ffn")]
    for name in norms:
        w.add_tensor(name, np.ones(n_embd, dtype=np.float32))
    for name, t, ne0, ne1 in mats:
        data, qt = _tensor(rng, t, ne0, ne1)
        w.add_tensor(name, data, raw_dtype=qt) if qt is not None else w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def layer_flops(dims: tuple[int, int, int, int]) -> float:
    """2 FLOPs per weight of one layer's matrices and token."""
    n_embd, n_ff, n_head, n_head_kv = dims
    n_kv = n_embd // n_head * n_head_kv
    return 2.0 * (2 * n_embd * n_embd + 2 * n_embd * n_kv + 3 * n_embd * n_ff)


def _models(root: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for kind, dims in (("prefill", _PREFILL_DIMS), ("decode", _DECODE_DIMS)):
        for cls in CLASSES:
            for n in _LAYERS:
                p = root / f"{kind}-{cls}-{n}-{'x'.join(map(str, dims))}.gguf"
                if not p.exists():
                    write_model(p, cls, n, dims)
                out[kind].append(str(p))
    return out


def rates_of(result: dict[str, Any], threads: int) -> tuple[dict[str, float], dict[str, float]]:
    """GFLOP/s per thread by class from the child's seconds (pairs of _LAYERS, in CLASSES' order)."""
    out: list[dict[str, float]] = []
    for kind, dims, n in (("prefill", _PREFILL_DIMS, PREFILL_TOKENS), ("decode", _DECODE_DIMS, 1)):
        s = result[f"{kind}_s"]
        rates = {}
        for i, cls in enumerate(CLASSES):
            dt = s[2 * i + 1] - s[2 * i]
            if dt > 0:
                rates[cls] = round(n * layer_flops(dims) * (_LAYERS[1] - _LAYERS[0]) / dt / threads / 1e9, 2)
        out.append(rates)
    return out[0], out[1]


def _child(models: dict[str, list[str]], threads: int) -> dict[str, Any]:
    req = {"threads": threads, "prefill_tokens": PREFILL_TOKENS, "decode_tokens": DECODE_TOKENS,
           "repeats": PREFILL_REPEATS, **models}
    from fitter.oracle.child_process import child_preexec

    print(f"ggfit: measuring this CPU's matmul rate at -t {threads} once (about 10 s; cached)", file=sys.stderr)
    try:  # the child dies with ggfit (PR_SET_PDEATHSIG), as every child ggfit starts
        r = subprocess.run([sys.executable, "-m", "fitter.speed._cpu_rate_child", json.dumps(req)], capture_output=True,
                           text=True, timeout=_TIMEOUT_S, check=False, preexec_fn=child_preexec(),
                           cwd=str(Path(__file__).resolve().parent.parent.parent))
    except subprocess.TimeoutExpired:
        raise CpuRateError(f"CPU rate measurement took over {_TIMEOUT_S:.0f} s") from None
    if r.returncode != 0 or not r.stdout.strip():
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise CpuRateError(f"CPU rate measurement failed (exit {r.returncode}): {tail}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _build() -> str:
    from fitter.llama_builds import installed_llama_cpp_python  # reads the dist-info: no importlib.metadata

    return f"llama-cpp-python {installed_llama_cpp_python() or '?'}"


def measure_cpu_rate(threads: int, *, refresh: bool = False) -> CpuRate:
    """This CPU's rates at `threads`, measured once per machine, thread count and llama-cpp-python build and cached
    in ggfit's cache directory (cpu-rate.json, with the date); `refresh` measures again. CpuRateError where the
    child fails."""
    from fitter.speed.hardware import _machine_key, write_cache

    path = os.path.join(cache_root(), RATE_CACHE)
    build = _build()
    key = {"machine": _machine_key(), "threads": threads, "build": build}
    if not refresh:
        try:
            with open(path, encoding="utf-8") as f:
                c = json.load(f)
            if all(c.get(k) == v for k, v in key.items()) and c["prefill_gflops"]:
                return CpuRate(prefill_gflops=c["prefill_gflops"], decode_gflops=c["decode_gflops"], threads=threads,
                               source=f"measured here {c['date']}, llama.cpp's kernels; cached in {path}",
                               build=c.get("build", ""))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    root = Path(cache_root()) / "cpu-rate"
    root.mkdir(parents=True, exist_ok=True)
    result = _child(_models(root), threads)
    pre, dec = rates_of(result, threads)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    record = {**key, "date": date, "prefill_gflops": pre, "decode_gflops": dec, "seconds": result,
              "method": "fitter.speed.cpu_rate: 2- and 4-layer llama models per type class, llama-cpp-python, "
                        "extra CPU buffer types off; GFLOP/s per thread"}
    return CpuRate(prefill_gflops=pre, decode_gflops=dec, threads=threads,
                   source=f"measured here {date}, llama.cpp's kernels; {write_cache(path, record)}", build=build)
