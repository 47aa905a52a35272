"""Memory over an mlx_lm.server session on mlx's CPU backend: ggfit starts mlx_lm.server on 127.0.0.1 (through
benchmarks/_mlx_session_server.py: mlx_lm.server.main plus a read-only memory route), sends N requests and reads,
after the load and after every request, mx.get_peak_memory / get_active_memory / get_cache_memory, the prompt
cache's entries and bytes, and the process's VmRSS / VmHWM. Every server's whole process group is stopped.

    python3 benchmarks/mlx_session.py [--models qwen3,qwen3_5] [--prompts 64,256] [--requests 50] [--out FILE] [--append]

Cases: distinct prompts (no common first token) and a shared prefix, each with the prompt cache at its
default (--prompt-cache-size 10, no byte limit), capped (--prompt-cache-bytes) and off (--prompt-cache-size 0).
tests/mlxlm/test_session.py replays the recording against fitter.mlx.session.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from search.server import Proc, free_port  # noqa: E402
from tests.mlxlm.synth import build  # noqa: E402

FIRST = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
MODES = {"default": [], "capped": ["--prompt-cache-bytes", "{cap}"], "off": ["--prompt-cache-size", "0"]}


def prompts(kind: str, n: int, length: int, shared: int) -> list[str]:
    """n prompts of `length` characters (one token each with tests/mlxlm/synth's tokenizer): `distinct`
    ones differ in their first token; `shared` ones share their first `shared` characters."""
    rng = random.Random(length)
    head = "".join(rng.choice("abcdefghij ") for _ in range(shared)) if kind == "shared" else ""
    out = []
    for i in range(n):
        r = random.Random(i * 7919 + length)
        tail = "".join(r.choice("klmnopqrst ") for _ in range(length - len(head) - 1))
        out.append(head + FIRST[i % len(FIRST)] + tail if kind == "shared" else FIRST[i % len(FIRST)] + tail)
    return out


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def session(model_dir: Path, flags: list[str], texts: list[str], max_tokens: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "_mlx_session_server.py"), "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--max-tokens", str(max_tokens), *flags]
    proc = Proc(cmd, merge_stderr=True)
    try:
        deadline = time.perf_counter() + 120
        while True:
            if not proc.alive or time.perf_counter() > deadline:
                raise RuntimeError("mlx_lm.server did not start: " + " | ".join(proc.lines[-3:]))
            try:
                if _get(url, "/health"):
                    break
            except OSError:
                proc.exited.wait(0.2)
        # the generation thread loads the model; a first request waits for it, so warm up on /v1/models only
        _post(url, {"prompt": "~", "max_tokens": 1, "temperature": 0.0})  # loads the model: not one of the N
        load = _get(url, "/ggfit/reset-peak")
        reqs = []
        for t in texts:
            r = _post(url, {"prompt": t, "max_tokens": max_tokens, "temperature": 0.0})
            u = r["usage"]
            reqs.append({"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                         "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                         **_get(url, "/ggfit/memory")})
        return {"after_load": load, "requests": reqs}
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3,qwen3_5")
    ap.add_argument("--bits", default="bf16", help="bf16 (fastest on the CPU backend; not MoE: the CPU's GatherMM "
                    "takes float32 only), 4 or 8")
    ap.add_argument("--prompts", default="64,256")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kinds", default="distinct,shared")
    ap.add_argument("--modes", default="default,capped,off")
    ap.add_argument("--cap-entries", type=float, default=3.5, help="--prompt-cache-bytes in entries of one request")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mlx-session-cpu-here.json"))
    ap.add_argument("--append", action="store_true", help="add these cases to --out's (same versions)")
    ap.add_argument("--prefill-step-size", type=int, help="mlx_lm.server's (default: its own, 2048)")
    a = ap.parse_args()
    from importlib.metadata import version

    rec: dict = {"mlx": version("mlx"), "mlx_lm": version("mlx-lm"), "backend": "cpu", "machine": platform.machine(),
                 "max_tokens": a.max_tokens, "cases": []}
    if a.append and Path(a.out).exists():
        old = json.loads(Path(a.out).read_text())
        if (old["mlx"], old["mlx_lm"], old["max_tokens"]) != (rec["mlx"], rec["mlx_lm"], a.max_tokens):
            sys.exit(f"{a.out}: recorded with other versions or settings; not appending")
        rec["cases"] = old["cases"]
    bits = None if a.bits == "bf16" else int(a.bits)
    for name in a.models.split(","):
        d = build(name, bits)
        for length in map(int, a.prompts.split(",")):
            for kind in a.kinds.split(","):
                texts = prompts(kind, a.requests, length, length // 2)
                for mode in a.modes.split(","):
                    per_entry = _entry_guess(d, length + a.max_tokens)
                    cap = int(a.cap_entries * per_entry)
                    flags = [f.format(cap=cap) for f in MODES[mode]]
                    if a.prefill_step_size:
                        flags += ["--prefill-step-size", str(a.prefill_step_size)]
                    t0 = time.perf_counter()
                    res = session(d, flags, texts, a.max_tokens)
                    last = res["requests"][-1]
                    print(f"{name:<8} P={length:<4} {kind:<8} {mode:<7} peak {last['peak'] / 2**20:7.2f} MiB, "
                          f"prompt cache {last['prompt_cache_entries']} entries {last['prompt_cache_nbytes'] / 2**20:.2f} MiB,"
                          f" VmHWM {last['vm_hwm'] / 2**20:.0f} MiB ({time.perf_counter() - t0:.0f} s)", flush=True)
                    rec["cases"].append({"model": name, "bits": bits, "model_dir": d.name, "prompt_chars": length, "kind": kind,
                                         "mode": mode, "flags": flags, **res})
                    _write(Path(a.out), rec)  # after every case: nothing lost
    _write(Path(a.out), rec)
    print("wrote", a.out)


def _write(path: Path, rec: dict) -> None:
    """One line a request: the recording stays small and diffable."""
    head = json.dumps({k: v for k, v in rec.items() if k != "cases"})[:-1]
    cases = []
    for c in rec["cases"]:
        rows = ",\n   ".join(json.dumps(r, separators=(",", ":")) for r in c["requests"])
        cases.append(json.dumps({k: v for k, v in c.items() if k != "requests"})[:-1] + ',\n  "requests": [\n   '
                     + rows + "]}")
    path.write_text(head + ', "cases": [\n ' + ",\n ".join(cases) + "]}\n")


def _entry_guess(model_dir: Path, tokens: int) -> int:
    """About one request's cache entry, only to size the capped case (the model computes the real one)."""
    from fitter.mlx.config import load_mlx_model
    from fitter.mlx.session import entry_bytes

    return entry_bytes(load_mlx_model(str(model_dir)).spec, tokens)


if __name__ == "__main__":
    main()
