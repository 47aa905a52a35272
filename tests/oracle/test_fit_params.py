"""`ggfit fit --check --llama-bin DIR`: the user's own llama-fit-params beside the prediction. Here DIR holds the
pinned build's llama-server and llama-fit-params (search/build_server.py builds both): exact to the MiB it prints,
on the real model and on synthetic ones of other families."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.oracle.fit_params import parse_fit_print, predicted_mib

ROOT = Path(__file__).resolve().parents[2]


def ggfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def llama_bin(llama_server) -> str:
    return str(Path(llama_server).parent)


def test_parse_fit_print():
    out = "MTL0 19902 2782 1761 \nHost 272 0 1056 \n"
    assert parse_fit_print(out) == {"MTL0": {"model": 19902, "context": 2782, "compute": 1761},
                                    "Host": {"model": 272, "context": 0, "compute": 1056}}


@pytest.mark.slow
@pytest.mark.parametrize("arch, args", [
    ("gemma3-270m", ["-c", "4096", "-ub", "512"]),
    ("gemma3-270m", ["-c", "32768", "-ub", "1024", "-ctk", "q8_0", "-ctv", "q8_0", "-np", "2"]),
    ("qwen35moe", ["-c", "8192", "-ub", "512"]),
    ("gpt-oss", ["-c", "8192", "-ub", "256", "-fa", "off"]),
    ("deepseek2", ["-c", "8192", "-ub", "512"]),
])
def test_check_with_the_users_llama_fit_params_is_exact(llama_bin, arch, args):
    from tests.synth import build

    model = arch if arch == "gemma3-270m" else str(build(arch))
    r = ggfit("fit", model, "--backend", "cpu", "--budget", "8GiB", *args, "--check", "--llama-bin", llama_bin, "--json")
    assert r.returncode == 0, r.stderr
    check = json.loads(r.stdout)["check"]
    assert check["tool"] == "llama-fit-params" and "--fit-print on" in check["command"]
    assert {row["kind"] for row in check["rows"]} == {"model", "context", "compute"}
    assert check["exact"], check["rows"]


def test_the_binary_s_build_applies(llama_bin, gemma):
    """No --llama-build: the rules of the build the binaries say they are (here the pinned one)."""
    r = ggfit("fit", gemma, "--backend", "cpu", "--budget", "2GiB", "-c", "4096", "--llama-bin", llama_bin, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["llama_build"]["pinned"]


def test_a_folder_without_llama_fit_params_is_one_line(tmp_path, gemma):
    r = ggfit("fit", gemma, "--budget", "2GiB", "--check", "--llama-bin", str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("ggfit: error: --llama-bin") and "Traceback" not in r.stderr


def test_predicted_mib_groups_buffers_as_llama_fit_params_does(gemma):
    from fitter.fit.memory import predict
    from fitter.ggml.backends.base import Backend
    from fitter.llama.cparams import Frontend, RunConfig
    from fitter.llama.model import load_model_spec

    h, s = load_model_spec(gemma)
    p = predict(h, s, RunConfig(n_ctx=4096), Backend.METAL, Frontend.LIBRARY)
    got = predicted_mib(p)
    assert set(got) == {"MTL0", "Host"}  # MTL0_Mapped is MTL0's model; CPU_Mapped / CPU are the host's
    assert got["Host"]["context"] == 0  # the output buffer is in no column
