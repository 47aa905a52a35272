"""--llama-build on fit, quants and optimise: which build's rules applied, said in text and JSON; auto asks a
binary; a log names its build; what ggfit cannot place is one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ggfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_default_is_the_pinned_build_and_says_nothing_more(gemma):
    r = ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    assert "llama.cpp 0c1e57098bba" in r.stdout and "\nbuild " not in r.stdout


def test_fit_names_the_build_whose_rules_applied(gemma):
    r = ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu", "--llama-build", "0.3.23")
    assert r.returncode == 0, r.stderr
    assert "rules of llama.cpp b9102 7d442abf5 2026-05-10" in r.stdout
    assert "build    llama.cpp b9102 7d442abf5 2026-05-10: llama-cpp-python 0.3.23's llama.cpp" in r.stdout
    j = json.loads(ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu", "--llama-build",
                         "0.3.23", "--json").stdout)
    assert j["llama_build"]["label"] == "llama.cpp b9102 7d442abf5 2026-05-10" and not j["llama_build"]["pinned"]
    assert {"logits_whole_ubatch", "kq_mask_f16_fa"} <= {d["change"] for d in j["llama_build"]["differences"]}
    assert j["config"]["build"]["commit"].startswith("7d442abf5")


def test_quants_names_the_build(gemma):
    r = ggfit("quants", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu", "--llama-build", "b9625")
    assert r.returncode == 0, r.stderr
    assert "rules of llama.cpp b9625" in r.stdout


def test_auto_asks_the_binary(gemma, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'version: 9625 (f05cf4676)'\necho 'built with cc for x86_64'\n")
    os.chmod(fake, 0o755)
    r = ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu", "--llama-build", "auto",
              "--llama-server", str(fake))
    assert r.returncode == 0, r.stderr
    assert "llama-server --version: build b9625 (f05cf4676)" in r.stdout


def test_a_log_names_the_build(gemma):
    log = ROOT / "tests/data/llama_logs/01-cuda-b9525.log"
    r = ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu", "--llama-build", str(log))
    assert r.returncode == 0, r.stderr
    assert "01-cuda-b9525.log: build b9525 (ad1b88ca0)" in r.stdout


@pytest.mark.parametrize("args, words", [
    (["--llama-build", "b1"], "--llama-build b1: outside the builds ggfit can date"),
    (["--llama-build", "soon"], "--llama-build soon: expected a build number"),
    (["--llama-server", "/bin/true"], "add --llama-build auto"),
    (["--llama-build", "auto", "--llama-server", "/nonexistent/llama-server"], "not an executable"),
])
def test_what_ggfit_cannot_place_is_one_line(gemma, args, words):
    r = ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("ggfit: error: ") and words in r.stderr and r.stderr.count("\n") == 1


def test_a_log_without_a_build_line_gets_a_hint(gemma, tmp_path):
    log = tmp_path / "server.log"
    log.write_text("llama_context: n_ctx = 4096\n")
    r = ggfit("fit", gemma, "--budget", "2GiB", "--llama-build", str(log))
    assert r.returncode == 2 and "server.log: no llama.cpp build line" in r.stderr and "--llama-build bNNNN" in r.stderr
