"""mlx_lm.server's memory over a session: the replayed LRUPromptCache against the recording of real servers
(benchmarks/mlx_session.py -> benchmarks/results/mlx-session-cpu-here.json, mlx's CPU backend), and the
session line of `fit --engine mlx`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.mlx.cache import CacheSettings
from fitter.mlx.config import load_mlx_model
from fitter.mlx.memory import MlxRun
from fitter.mlx.session import Request, entry_bytes, session_memory
from fitter.mlx.session_fit import propose_cap, session_ceiling
from fitter.mlx.weights import weight_bytes

ROOT = Path(__file__).resolve().parents[2]
RECORDING = ROOT / "benchmarks" / "results" / "mlx-session-cpu-here.json"
CASES = json.loads(RECORDING.read_text())["cases"] if RECORDING.exists() else []
WARMUP = Request(1, 1)  # the benchmark's first request (loads the model), before the peak is reset


def _flags(case: dict) -> tuple[int, int | None, CacheSettings]:
    f = dict(zip(case["flags"][::2], case["flags"][1::2]))
    cap = f.get("--prompt-cache-bytes")
    return (int(f.get("--prompt-cache-size", 10)), int(cap) if cap else None,
            CacheSettings(prefill_step_size=int(f.get("--prefill-step-size", 2048))))


@pytest.mark.parametrize("case", CASES,
                         ids=[f"{c['model']}-{c['bits'] or 'bf16'}-{c['prompt_chars']}-{c['kind']}-{c['mode']}"
                              + "".join(c["flags"][2:] if c["mode"] != "default" else c["flags"]) for c in CASES])
def test_recorded_session_peak(mlx_model, case):
    """The session's peak (mx.get_peak_memory after the load) within 5% after 1, 10 and 50 requests; the prompt
    cache's entries and bytes (LRUPromptCache.nbytes) exact."""
    m = load_mlx_model(str(mlx_model(case["model"], case["bits"])))
    w = weight_bytes(m.spec, m.tensors).resident
    size, cap, settings = _flags(case)
    got = case["requests"]
    reqs = [WARMUP] + [Request(r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"] or 0) for r in got]
    sm = session_memory(m.spec, settings, reqs, prompt_cache_size=size, prompt_cache_bytes=cap)
    for n in (1, 10, 50):
        if n > len(got):
            continue
        pred = w + max(r.held + r.peak for r in sm.requests[1:n + 1])
        real = got[n - 1]["peak"]
        assert abs(pred - real) <= 0.05 * real, (n, pred, real)
    assert sm.entries_after == got[-1]["prompt_cache_entries"]
    assert sm.entry_nbytes_after == got[-1]["prompt_cache_nbytes"]


def test_recording_covers_the_issue():
    """issue 48: 1, 10 and 50 requests, the prompt cache at its default, capped and off, a hybrid model."""
    if not CASES:
        pytest.skip("no recording")
    assert {c["mode"] for c in CASES} == {"default", "capped", "off"}
    assert all(len(c["requests"]) >= 50 for c in CASES)
    assert {"qwen3", "qwen3_5"} <= {c["model"] for c in CASES}


def test_lru_rules(mlx_model):
    spec = load_mlx_model(str(mlx_model("qwen3", None))).spec
    reqs = [Request(100, 20)] * 30
    e = entry_bytes(spec, 120)
    assert session_memory(spec, CacheSettings(), reqs).entries_after == 10  # --prompt-cache-size 10
    assert session_memory(spec, CacheSettings(), reqs, prompt_cache_size=0).entries_after == 0
    # trim_to(limit) before each request, the new entry after: 3 kept plus the last one
    capped = session_memory(spec, CacheSettings(), reqs, prompt_cache_bytes=3 * e)
    assert capped.entries_after == 4 and capped.entry_nbytes_after == 4 * e
    free = session_memory(spec, CacheSettings(), reqs)
    assert capped.peak < free.peak and free.peak_after(1) == capped.peak_after(1)


def test_sequential_path_ignores_the_byte_limit(mlx_model):
    m = load_mlx_model(str(mlx_model("qwen3", None)))
    run = MlxRun(n_ctx=1024, max_tokens=64, cache=CacheSettings(kv_bits=8), prompt_cache_bytes=1)
    c = session_ceiling(m, run)
    assert not c.batched and c.entries == 10 and "no effect" in c.notes[0]
    p = propose_cap(m, run, c.limit_bytes - 1)  # only --prompt-cache-size caps it there
    assert p is not None and p.flag == "--prompt-cache-size" and p.value == 9


def _ggfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_fit_session_json_and_proposal(mlx_model):
    d = str(mlx_model("qwen3", None))
    base = ("fit", "--engine", "mlx", d, "--margin", "0MiB", "-c", "1024", "--max-tokens", "64", "--json")
    out = json.loads(_ggfit(*base, "--budget", "1GiB", "--session-requests", "50").stdout)["session"]
    assert out["requests"] == 50 and out["prompt_tokens"] == 960 and out["fits"] and out["proposal"] is None
    assert out["peak_bytes"] == out["limit_bytes"] and "--prompt-cache-size 10" in out["capped_by"]
    budget = (out["limit_bytes"] + 40 * 2**20) // 2  # between the load and the limit (about 31 and 51 MiB)
    r = _ggfit(*base, "--budget", f"{budget}B", "--session-requests", "50")
    assert r.returncode == 1  # loads, but not for 50 requests
    p = json.loads(r.stdout)["session"]["proposal"]
    assert p["flag"] == "--prompt-cache-bytes" and p["limit_bytes"] <= budget and 0 < p["entries"] < 10
    assert "re-processes" in p["cost"]
    capped = json.loads(_ggfit(*base, "--budget", f"{budget}B", "--prompt-cache-bytes", str(p["value"])).stdout)["session"]
    assert capped["limit_bytes"] == p["limit_bytes"] and capped["fits"]


def test_fit_session_bad_flags(mlx_model):
    d = str(mlx_model("qwen3", None))
    r = _ggfit("fit", "--engine", "mlx", d, "--budget", "1GiB", "--margin", "0MiB", "--session-requests", "0")
    assert r.returncode == 2 and "--session-requests" in r.stderr and "0" in r.stderr and "Traceback" not in r.stderr
    r = _ggfit("fit", "--engine", "mlx", d, "--budget", "1GiB", "--margin", "0MiB", "--prompt-cache-size", "-1")
    assert r.returncode == 2 and "--prompt-cache-size -1" in r.stderr and "Traceback" not in r.stderr
