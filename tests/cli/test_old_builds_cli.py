"""--llama-build with a build of mid 2025 (issue 49, item 4): a number, a commit and a `--version` line of b6000 ..
b7380 are taken and dated; an older build is one line and exit code 2, naming the range."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ggfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_a_mid_2025_build_number_and_commit_are_taken(gemma):
    r = ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu", "--llama-build", "b7217")
    assert r.returncode == 0, r.stderr
    assert "rules of llama.cpp b7217 ~2025-12-01" in r.stdout
    r = ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu", "--llama-build", "4762ad73")
    assert r.returncode == 0, r.stderr
    assert "rules of llama.cpp b6000 4762ad731 ~2025-07-26" in r.stdout


def test_a_mid_2025_version_line_is_taken(gemma, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'version: 6000 (4762ad73)'\necho 'built with cc (GCC) 13.3.0 for x86_64-linux-gnu'\n")
    os.chmod(fake, 0o755)
    r = ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu", "--llama-build", "auto",
              "--llama-server", str(fake))
    assert r.returncode == 0, r.stderr
    assert "llama-server --version: build b6000 (4762ad73)" in r.stdout


def test_a_build_before_b6000_is_one_line_with_the_range(gemma):
    r = ggfit("fit", gemma, "--budget", "2GiB", "-c", "4096", "--backend", "cpu", "--llama-build", "b5000")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr == ("ggfit: error: --llama-build b5000: outside the builds ggfit can date and model "
                        "(b6000 (~2025-07-26) .. b11312 (2026-10-01))\n")
