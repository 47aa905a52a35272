"""The mlx runner: mlx_lm.server started with a trial's flags, proven, stopped with nothing left behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from search.runner_mlx import MlxFlags, mlx_probe, served_probe
from search.runner_openai import OpenAIProbe


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_mlx_server_with_flags():
    pytest.importorskip("mlx_lm")
    from tests.mlxlm.synth import build

    flags = MlxFlags(prefill_step_size=64, kv_bits=8, quantized_kv_start=0, max_tokens=16)
    res, cmd = mlx_probe(str(build("qwen3_5", 4)), flags,
                         lambda url, pid: OpenAIProbe(url, pid=pid, prompt_tokens=32, gen_tokens=6), timeout=300)
    assert res.ok, res.message
    assert "--kv-bits" in cmd and "--prefill-step-size" in cmd
    assert res.levels[0].decode_tps and res.memory.peak
    assert res.pid is not None and _gone(res.pid)


def test_server_that_dies_while_loading_is_a_crash():
    res, _ = served_probe(lambda port: [sys.executable, "-c", "import sys; print('boom'); sys.exit(4)"],
                          lambda url, pid: OpenAIProbe(url, pid=pid), 30, "fake")
    assert res.status == "crash" and "status 4" in (res.message or "") and "boom" in (res.message or "")


def test_server_that_never_answers_is_a_timeout():
    res, _ = served_probe(lambda port: [sys.executable, "-c", "import time; time.sleep(60)"],
                          lambda url, pid: OpenAIProbe(url, pid=pid), 2, "fake")
    assert res.status == "timeout" and res.pid is not None and _gone(res.pid)


def test_missing_mlx_is_one_line(tmp_path: Path):
    import subprocess

    # a Python whose mlx_lm cannot be imported nor found by importlib.metadata
    code = ("import importlib.metadata as m, sys\n"
            "orig = m.version\n"
            "def version(name):\n"
            "    if name == 'mlx-lm': raise m.PackageNotFoundError(name)\n"
            "    return orig(name)\n"
            "m.version = version\n"
            "sys.argv = ['ggfit', 'probe', '--runner', 'mlx', str(sys.argv[1])]\n"
            "import cli; cli.main()\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "pip install 'ggfit[mlx]'" in r.stderr
