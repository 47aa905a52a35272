"""Metal's default --margin against its evidence (fitter.ggml.backends.metal.evidence): every case's total recomputed with
today's model from its twin, its flags and the --llama-build it names; the derived margin keeps every config that ran
fitting and every one that ran out of memory not fitting; the output names the bound the margin rests on."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from fitter.fit.margin import default_margin, margin_note
from fitter.ggml.backends.metal.evidence import EVIDENCE, Case, metal_bounds
from tests.fit.test_seed_figures import seed_file

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def _q35_9b() -> str:
    """Log 03's Qwen3.5-9B Q4_K_S twin (tests/oracle/test_user_log.py), laid out as llama-quantize writes it."""
    from tests.oracle.test_user_log import _Q35_9B, _quantized
    from tests.synth.shapes import quantize_ordered

    return str(quantize_ordered(_quantized("qwen35", "Q4_K_S", **_Q35_9B)))


TWINS = {
    "qwen36-35b-a3b-q4_k_m": lambda: seed_file("qwen36-35b-a3b", "Q4_K_M", n_nextn=0),
    "qwen35-0.8b-q4_k_s": lambda: seed_file("qwen35-0.8b", "Q4_K_S"),
    "qwen35-9b-q4_k_s": _q35_9b,
}


@cache
def twin_path(key: str) -> str:
    return TWINS[key]()


def fit_json(case: Case, *extra: str) -> dict:
    draft = ["-md", twin_path(case.draft_twin)] if case.draft_twin else []
    r = subprocess.run([sys.executable, "cli.py", "fit", twin_path(case.twin), *case.flags, *draft, "--backend", "metal",
                        "--budget", f"{case.budget_bytes // MiB}MiB", "--llama-build", case.build, "--json", *extra],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def today() -> dict[str, dict]:
    return {c.name: fit_json(c) for c in EVIDENCE}


def test_every_case_is_named_once_and_has_a_source():
    assert len({c.name for c in EVIDENCE}) == len(EVIDENCE)
    assert all(c.source and c.twin in TWINS and (c.draft_twin is None or c.draft_twin in TWINS) for c in EVIDENCE)
    assert {c.outcome for c in EVIDENCE} == {"ran", "oom"}


@pytest.mark.parametrize("case", EVIDENCE, ids=lambda c: c.name)
def test_recorded_total_is_todays_prediction(case, today):
    """The bound printed is the one today's model gives: the recorded total is today's to the byte."""
    out = today[case.name]
    assert out["llama_build"]["label"].startswith(f"llama.cpp {case.build}")
    assert out["total_device_bytes"] == case.total_bytes, (case.name, out["total_device_bytes"])


def test_default_margin_lies_inside_the_bounds_of_todays_predictions(today):
    ran = [c.budget_bytes - today[c.name]["total_device_bytes"] for c in EVIDENCE if c.outcome == "ran"]
    oom = [c.budget_bytes - today[c.name]["total_device_bytes"] for c in EVIDENCE if c.outcome == "oom"]
    assert max(oom) < default_margin("metal") <= min(ran), (max(oom) / MiB, default_margin("metal") / MiB, min(ran) / MiB)
    b = metal_bounds()
    assert (b.lower, b.upper) == (max(oom), min(ran))


@pytest.mark.parametrize("case", EVIDENCE, ids=lambda c: c.name)
def test_default_margin_gives_every_case_its_outcome(case, today):
    out = today[case.name]
    assert out["margin_bytes"] == default_margin("metal")
    assert out["fits"] is (case.outcome == "ran"), (case.name, out["headroom_bytes"] / MiB)


def test_the_output_names_the_bound_the_margin_rests_on(today):
    b = metal_bounds()
    assert b.upper_case.name == "b9430 seed, -c 262144 -ub 2048 q8_0"  # the seed's config bounds it: 628.47 MiB
    assert default_margin("metal") == 628 * MiB and round(b.upper / MiB, 2) == 628.47
    note = margin_note("metal")
    assert f"at most 628.47 MiB outside the buffers, by {b.upper_case.name}" in note, note
    assert b.lower_case is not None and f"more than {b.lower / MiB:,.2f} MiB ({b.lower_case.name})" in note, note
    assert "safety share" not in note
    seed = today[b.upper_case.name]
    assert seed["margin_source"] == note and seed["fits"] and round(seed["headroom_bytes"] / MiB, 2) == 0.47
    r = subprocess.run([sys.executable, "cli.py", "fit", twin_path(b.upper_case.twin), *b.upper_case.flags, "--backend",
                        "metal", "--budget", "25559MiB", "--llama-build", "b9430"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"margin 628.00 MiB ({note})" in r.stdout and "fits, headroom 0.47 MiB" in r.stdout, r.stdout


def test_help_gives_the_default_margins():
    help_text = (ROOT / "cli_options.py").read_text()
    assert f"Metal {default_margin('metal') // MiB}MiB" in help_text
    assert f"CUDA {default_margin('cuda') // MiB}MiB" in help_text and f"CPU {default_margin('cpu') // MiB}MiB" in help_text
