"""What the one-shot commands load: fit, quants and inspect answer without pydantic (its import and typer 0.28+'s
per-parameter TypeAdapters were about 45 ms of a 0.15 s `fit -c`, benchmarks/fit_speed.py) and without
importlib.metadata (16 ms of imports on a 2-core EPYC, for one version string), nor ctypes, which only `--budget auto`'s
device probes use (fitter.fit.device_memory: 7M instructions). Studies, --json and `probe`'s workload still import
pydantic where they use it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# cli.main's exit code, or 3 when ggfit imported pydantic, importlib.metadata or ctypes (a .pth hook may have before it)
_CODE = """import sys
before = set(sys.modules)
import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.exit(3 if {"pydantic", "importlib.metadata", "ctypes"} & (set(sys.modules) - before) else code)
"""


@pytest.fixture(scope="module")
def cpu_rate_measured(gemma):
    """The CPU's matmul rate measured once beforehand (fitter.speed.cpu_rate: a child process started through ctypes'
    prctl, ~10 s, then cached): the one-shot commands are checked as a user runs them every time after the first."""
    subprocess.run([sys.executable, "-m", "cli", "fit", gemma, "--budget", "2GiB", "-c", "4096"], cwd=ROOT,
                   capture_output=True, timeout=300, check=False)


@pytest.mark.parametrize("args", [("fit", "--budget", "2GiB", "-c", "4096"), ("fit", "--budget", "2GiB"),
                                  ("quants", "--budget", "2GiB"), ("inspect",)], ids=" ".join)
def test_one_shot_commands_do_not_import_pydantic_metadata_or_ctypes(gemma, cpu_rate_measured, args):
    r = subprocess.run([sys.executable, "-c", _CODE, args[0], gemma, *args[1:]], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
