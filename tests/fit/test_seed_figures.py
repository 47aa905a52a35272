"""Issue 13's seed figures: a 32 GB M4 Mac mini (Metal working set 25,559 MiB), llama-server with Qwen3.6-35B-A3B
Q4_K_M (a 20,182 MiB file: the synthetic qwen35moe twin without the NextN layer, quantized by ggfit's
llama-quantize rules to exactly that size and laid out as llama-quantize writes it, so that the token embedding lies
inside the Metal mapped range), every layer on Metal, `-b 2048 -fa on -np 1 --kv-unified`, mmap on.
`ggfit fit --llama-build <the build> --backend metal --budget 25559MiB` with the default margin must say fits /
does not fit as observed on that machine (the margin rests on these cases: fitter.ggml.backends.metal.evidence,
tests/fit/test_metal_margin.py)."""

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


@cache
def seed_file(name: str, ftype: str, **overrides) -> str:
    """`twin`, laid out as the released quantized files are (llama-quantize's order, tests.synth.shapes)."""
    from tests.synth.shapes import quantize_ordered

    return str(quantize_ordered(twin(name, ftype, **overrides)))


def fit(*args: str) -> dict:
    batch = [] if "-b" in args else ["-b", "2048"]
    r = subprocess.run([sys.executable, "cli.py", "fit", *args, *batch, *COMMON], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def target() -> str:
    path = seed_file("qwen36-35b-a3b", "Q4_K_M", n_nextn=0)
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


DRAFT_ARGS = ("-ctk", "q8_0", "-ctv", "q8_0", "--spec-draft-type-k", "q8_0", "--spec-draft-type-v", "q8_0")

# The August seed's build is not given beyond "between b9430 and b10502". Its draft figures grow by 1,170 MiB when the
# ubatch doubles from 1024 to 2048: 970 MiB of it are logits for every token of the ubatch (248,320 x 1,024 x 4 B).
# Every llama.cpp from #23861 / #23988 (2026-06-01) on caps the draft context's outputs at -np (the server's
# `[spec] estimated memory usage` context and the draft context itself, 0.3.25 .. 0.3.36 sources), so the figures
# place the build before #23861: b9430 up to that merge. `b10480` (August by number) keeps the cap.
PRE_23861 = "b9440"


@pytest.mark.parametrize("ctx, ub, fits", [("131072", "2048", False), ("98304", "2048", False), ("98304", "1024", True)])
def test_august_draft_outcomes_with_the_rules_its_figures_imply(target, ctx, ub, fits):
    draft = seed_file("qwen35-0.8b", "Q4_K_S")
    out = fit(target, "-c", ctx, "-ub", ub, *DRAFT_ARGS, "-md", draft, "--llama-build", PRE_23861)
    assert out["fits"] is fits, out["total_device_bytes"] / 2**20


def _draft_device_mib(out: dict) -> float:
    return sum(b["bytes"] for b in out["buffers"] if b["owner"] == "draft" and b["counts"]) / 2**20


def test_august_draft_steps(target):
    """The draft's reported footprints (3,777.71 / 3,445.71 / 2,275.68 MiB) step by 332.03 and 1,170.03 MiB: with
    whole-ubatch logits, the LM head's 970 / 1,940 MiB cannot reuse the KQ mask's freed block, because Metal's
    graph_optimize reordered the split so that a live tensor sits above it (fitter.ggml.backends.metal.common)."""
    draft = seed_file("qwen35-0.8b", "Q4_K_S")
    mib = {(c, ub): _draft_device_mib(fit(target, "-c", c, "-ub", ub, *DRAFT_ARGS, "-md", draft,
                                          "--llama-build", PRE_23861))
           for c, ub in (("131072", "2048"), ("98304", "2048"), ("98304", "1024"))}
    ctx_step = mib["131072", "2048"] - mib["98304", "2048"]
    ub_step = mib["98304", "2048"] - mib["98304", "1024"]
    assert abs(ctx_step - 332.03) <= 0.02 * 332.03 and abs(ub_step - 1170.03) <= 0.02 * 1170.03, (ctx_step, ub_step)
    # to the printed 0.01 MiB: 332.00 and 1,170.04; the absolute figures are 2.71 MiB under (the twin's weights)
    assert abs(ctx_step - 332.03) < 0.05 and abs(ub_step - 1170.03) < 0.05, (ctx_step, ub_step)
    assert [round(mib[k] - r, 2) for k, r in zip(mib, (3777.71, 3445.71, 2275.68))] == [-2.71, -2.71, -2.72]


def test_august_draft_table_fits_the_draft_only_with_a_smaller_ubatch(target):
    """No -c, no -ub: the draft fits only with a smaller ubatch, as the config that worked (-ub 1024); the flags of a
    solution without the draft carry no draft cache types."""
    draft = seed_file("qwen35-0.8b", "Q4_K_S")
    out = fit(target, *DRAFT_ARGS, "-md", draft, "--llama-build", PRE_23861)
    with_draft = {s["n_ubatch"]: s["n_ctx"] for s in out["solutions"] if s["draft"]}
    assert with_draft[1024] >= 98304 > with_draft[2048]
    assert not out["recommended"]["draft"]  # the recommendation is the target alone at its training context
    assert not any(f.startswith(("-md", "-ctkd", "-ctvd")) for f in out["flags"])


def test_august_figures_are_not_those_of_a_build_that_caps_the_draft_outputs(target):
    """The issue calls the draft seed's build "August" (between b9430 and b10502). A build of August by number, such
    as b10480, caps the draft context's outputs at -np (#23861, common_base_params_to_speculative): its draft grows by
    about 270 MiB from -ub 1024 to -ub 2048, not by the 1,170.03 MiB the seed reports, 970 of them logits for every
    token of the ubatch. So the seed's build predates #23861 (PRE_23861 stands for it), and with b10480's rules the
    two configs that ran out of memory would fit."""
    draft = seed_file("qwen35-0.8b", "Q4_K_S")
    mib = {ub: _draft_device_mib(fit(target, "-c", "98304", "-ub", ub, *DRAFT_ARGS, "-md", draft, "--llama-build",
                                     "b10480")) for ub in ("1024", "2048")}
    assert 200 < mib["2048"] - mib["1024"] < 400


def test_august_draft_fits_at_ubatch_1024(target):
    draft = seed_file("qwen35-0.8b", "Q4_K_S")
    out = fit(target, "-c", "98304", "-ub", "1024", "-ctk", "q8_0", "-ctv", "q8_0", "-md", draft,
              "--spec-draft-type-k", "q8_0", "--spec-draft-type-v", "q8_0", "--llama-build", "b10480")
    assert out["fits"]


def test_august_draft_failure_points_to_the_config_that_worked(target):
    """`-c 98304 -ub 2048` with the draft ran out of memory; what ggfit offers instead, one change at a time,
    includes the config that worked: `-ub 1024` at the same context, with the draft."""
    draft = seed_file("qwen35-0.8b", "Q4_K_S")
    r = subprocess.run([sys.executable, "cli.py", "fit", target, "-c", "98304", "-ub", "2048", "-b", "2048", *DRAFT_ARGS,
                        "-md", draft, "--llama-build", PRE_23861, *COMMON[:-1]], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 1, r.stderr
    assert "does NOT fit" in r.stdout and "  -ub 1024 (fits at -c 98304)\n" in r.stdout, r.stdout[-800:]
