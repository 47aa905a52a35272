"""Issue 13's seed figures: a 32 GB M4 Mac mini (Metal working set 25,559 MiB), llama-server with Qwen3.6-35B-A3B
Q4_K_M (a 20,182 MiB file: the synthetic qwen35moe twin without the NextN layer, quantized by ggfit's
llama-quantize rules to exactly that size), every layer on Metal, `-b 2048 -fa on -np 1 --kv-unified`, mmap on.
`ggfit fit --llama-build <the build> --backend metal --budget 25559MiB` with the default margin must say fits /
does not fit as observed on that machine."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--backend", "metal", "--budget", "25559MiB", "-fa", "on", "-np", "1", "--kv-unified", "--json"]


@cache
def twin(name: str, ftype: str, **overrides) -> str:
    """The shape with the per-tensor types llama-quantize gives it for `ftype` (fitter.fit.quants)."""
    from fitter.fit.quants import predict_quant
    from fitter.gguf.reader import read_header
    from tests.synth.shapes import build_shape

    base = build_shape(name, **overrides)
    types = {t.name: t.type_name.lower() for t in predict_quant(read_header(base), ftype).tensors}
    return str(build_shape(name, tensor_types=types, **overrides))


def fit(*args: str) -> dict:
    batch = [] if "-b" in args else ["-b", "2048"]
    r = subprocess.run([sys.executable, "cli.py", "fit", *args, *batch, *COMMON], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def target() -> str:
    path = twin("qwen36-35b-a3b", "Q4_K_M", n_nextn=0)
    assert round(Path(path).stat().st_size / 2**20) == 20183  # the seed's 20,182 MiB file (header and padding)
    return path


@pytest.mark.parametrize("args, fits", [
    (["-c", "262144", "-ub", "2048", "-ctk", "q8_0", "-ctv", "q8_0"], True),  # loads and decodes, about 24 GB
    (["-c", "262144", "-ub", "4096", "-b", "4096", "-ctk", "q8_0", "-ctv", "q8_0"], False),  # Metal OOM
    (["-c", "262144", "-ub", "2048"], False),  # f16 K/V: Metal OOM
])
def test_june_build_b9430(target, args, fits):
    out = fit(target, *args, "--llama-build", "b9430")
    assert out["llama_build"]["label"].startswith("llama.cpp b9430")
    assert out["fits"] is fits, (out["total_device_bytes"] / 2**20, out["margin_bytes"] / 2**20)


@pytest.mark.xfail(reason="issue 13, open: the August draft context's reported footprint (3,777.71 / 3,445.71 MiB at "
                          "-ub 2048) is about 1,799 MiB more than any release's source gives it; the mechanism is not "
                          "found, so ggfit says -c 131072 / 98304 at -ub 2048 fit", strict=True)
@pytest.mark.parametrize("ctx", ["131072", "98304"])
def test_august_draft_ooms_at_ubatch_2048(target, ctx):
    draft = twin("qwen35-0.8b", "Q4_K_S")
    out = fit(target, "-c", ctx, "-ub", "2048", "-ctk", "q8_0", "-ctv", "q8_0", "-md", draft, "--spec-draft-type-k",
              "q8_0", "--spec-draft-type-v", "q8_0", "--llama-build", "b10480")
    assert not out["fits"]


def test_august_draft_fits_at_ubatch_1024(target):
    draft = twin("qwen35-0.8b", "Q4_K_S")
    out = fit(target, "-c", "98304", "-ub", "1024", "-ctk", "q8_0", "-ctv", "q8_0", "-md", draft,
              "--spec-draft-type-k", "q8_0", "--spec-draft-type-v", "q8_0", "--llama-build", "b10480")
    assert out["fits"]
