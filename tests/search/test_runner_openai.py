"""The openai runner against servers started here on loopback: a fake OpenAI server that leaks on
purpose (or not, or dies, or hangs), the pinned llama-server and mlx_lm.server on a tiny MLX model."""

from __future__ import annotations

import sys
import time
import urllib.request

import pytest

from search.runner_openai import OpenAIProbe
from search.server import Proc, free_port


def _start(cmd: list[str], port: int, timeout: float = 300) -> Proc:
    p = Proc(cmd, merge_stderr=True)
    t_end = time.time() + timeout
    while time.time() < t_end:
        if not p.alive:
            raise AssertionError("server exited: " + "\n".join(p.lines[-20:]))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return p
        except OSError:
            pass
        time.sleep(0.1)
    p.stop()
    raise AssertionError("server did not become healthy")


def _fake(*flags: str) -> tuple[Proc, str]:
    port = free_port()
    return _start([sys.executable, "-m", "tests.search.fake_openai", str(port), *flags], port, 30), \
        f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("leak, verdict", [(48, "growing"), (0, "flat")])
def test_soak_catches_a_leaking_server(leak, verdict):
    p, url = _fake("--leak-mib", str(leak))
    try:
        r = OpenAIProbe(url, pid=p.pid, gen_tokens=4, soak=6, timeout=60).run()
    finally:
        p.stop()
    assert r.ok, r.message
    assert r.soak is not None and r.soak.verdict == verdict and len(r.soak.rss_after) == 6
    if leak:
        assert r.soak.growth_bytes >= 5 * 48 * 2**20 * 0.9
        assert r.memory.after is not None and r.memory.before is not None
        assert r.memory.after - r.memory.before >= 6 * 48 * 2**20 * 0.9
    else:
        assert abs(r.soak.growth_bytes) < 32 * 2**20


def test_rates_depths_and_concurrency():
    p, url = _fake()
    try:
        r = OpenAIProbe(url, pid=p.pid, gen_tokens=8, depths=(0, 2048), concurrency=(1, 3), timeout=60).run()
    finally:
        p.stop()
    assert r.ok, r.message
    assert [(lv.depth, lv.concurrency) for lv in r.levels] == [(0, 1), (0, 3), (2048, 1), (2048, 3)]
    for lv in r.levels:
        assert len(lv.requests) == lv.concurrency and lv.decode_tps and lv.prefill_tps and lv.total_decode_tps > 0
        assert all(s.completion_tokens == 8 for s in lv.requests)
    assert r.levels[2].requests[0].prompt_tokens > r.levels[0].requests[0].prompt_tokens + 1500  # the depth


@pytest.mark.parametrize("flag, status", [("--die-at", "crash"), ("--hang-at", "timeout")])
def test_dying_or_hanging_server(flag, status):
    p, url = _fake(flag, "2")
    try:
        r = OpenAIProbe(url, pid=p.pid, gen_tokens=4, repeats=3, timeout=5).run()
    finally:
        p.stop()
    assert r.status == status, r.message
    assert not p.alive


@pytest.mark.slow
def test_pinned_llama_server(llama_server, gemma):
    port = free_port()
    p = _start([llama_server, "-m", gemma, "--port", str(port), "--host", "127.0.0.1", "-c", "4096", "-np", "2",
                "--no-repack", "-t", "2"], port)
    try:
        r = OpenAIProbe(f"http://127.0.0.1:{port}", pid=p.pid, prompt_tokens=64, gen_tokens=8, depths=(0, 1024),
                        concurrency=(1, 2), timeout=300).run()
    finally:
        p.stop()
    assert r.ok, r.message
    assert all(lv.prefill_tps and lv.decode_tps for lv in r.levels)
    assert r.levels[-1].requests[0].prompt_tokens > 1000 and r.memory.peak and r.memory.peak > 100 * 2**20
    assert not p.alive


@pytest.mark.slow
def test_mlx_lm_server():
    pytest.importorskip("mlx_lm")
    from tests.mlxlm.synth import build

    port = free_port()
    p = _start([sys.executable, "-m", "mlx_lm", "server", "--model", str(build("qwen3", 4)), "--port", str(port),
                "--host", "127.0.0.1"], port)
    try:
        r = OpenAIProbe(f"http://127.0.0.1:{port}", pid=p.pid, prompt_tokens=16, gen_tokens=8, depths=(0, 128),
                        concurrency=(1, 2), timeout=300).run()
    finally:
        p.stop()
    assert r.ok, r.message
    assert all(lv.prefill_tps and lv.decode_tps for lv in r.levels)
    assert r.levels[-1].requests[0].prompt_tokens > r.levels[0].requests[0].prompt_tokens + 100
    assert not p.alive


def test_probe_cli_openai_soak():
    import json
    import subprocess
    from pathlib import Path

    p, url = _fake("--leak-mib", "48")
    try:
        r = subprocess.run([sys.executable, "cli.py", "probe", "--runner", "openai", "--url", url, "--pid", str(p.pid),
                            "--gen-tokens", "4", "--soak", "5", "--concurrency", "2", "--json"],
                           capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    finally:
        p.stop()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["status"] == "ok" and out["soak"]["verdict"] == "growing" and out["levels"][0]["concurrency"] == 2
    # progress on stderr as it happens (a line per step in a pipe), the JSON alone on stdout
    assert "warm-up request 1 of 1 (not measured)" in r.stderr and "depth 0 x2: request 6 of 6 done" in r.stderr  # --repeats 3 each
    assert "soak request 5 of 5 done: server RSS" in r.stderr


def test_rates_are_defined_alike_at_every_concurrency():
    """decode per request = (completion - 1) / first-to-last-token time; all clients together = every request's
    decoded tokens / the union of their decode spans (at concurrency 1, requests one after another: the sum of the
    spans); end to end = completion tokens / the level's wall time, prefill included. (The 3.4 tok/s per request,
    1.8 tok/s "total" at concurrency 1 of the issue was the end-to-end figure under the name of a decode rate.)"""
    p, url = _fake()
    try:
        r = OpenAIProbe(url, pid=p.pid, prompt_tokens=2000, gen_tokens=6, repeats=3, concurrency=(1, 3),
                        timeout=60).run()
    finally:
        p.stop()
    assert r.ok, r.message
    for lv in r.levels:
        spans = sorted((s.decode_from_s, s.decode_to_s) for s in lv.requests)
        decoded = sum(s.completion_tokens - 1 for s in lv.requests)
        union, end = 0.0, float("-inf")
        for a, b in spans:
            union += max(0.0, b - max(a, end))
            end = max(end, b)
        assert lv.total_decode_tps == pytest.approx(decoded / union)
        assert lv.end_to_end_tps == pytest.approx(sum(s.completion_tokens for s in lv.requests) / lv.wall_s)
        if lv.concurrency == 1:  # one after the other: no overlap, the union is the sum of the spans
            assert union == pytest.approx(sum(b - a for a, b in spans))
            assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
    assert "all clients together" in r.summary() and "end to end = completion tokens / wall time" in r.summary()


def test_pid_of_no_process_is_one_line():
    import subprocess
    from pathlib import Path

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    r = subprocess.run([sys.executable, "cli.py", "probe", "--runner", "openai", "--url", "http://127.0.0.1:9",
                        "--pid", str(gone.pid)], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"ggfit: error: --pid {gone.pid}: no such process (the server's pid, for its memory)"], r.stderr
