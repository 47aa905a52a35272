"""The published llama-bench truth set (benchmarks/results/speed-published.json) and the hardware profiles
(fitter/speed/hardware_specs.py) it names: every row maps to a profile and a synthetic shape, every number
is cited, and the shapes have the parameter counts llama-bench printed for the real files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fitter.speed.hardware_specs import SPECS
from tests.synth.shapes import SHAPES

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = json.loads((ROOT / "benchmarks/results/speed-published.json").read_text())
ROWS = PUBLISHED["rows"]
BY_NAME = {s["name"]: s for s in SPECS}
_META = {"name", "chip", "backend", "unified", "sources"}


def _cited(url: object) -> bool:
    """An https URL, or a file of this repository (a recorded device log)."""
    return isinstance(url, str) and (url.startswith("https://") or (ROOT / url).is_file())


def test_profile_names_are_unique_and_follow_the_issue():
    names = [s["name"] for s in SPECS]
    assert len(names) == len(set(names))
    for name in names:
        assert re.fullmatch(r"apple-m[1-5](-pro|-max|-ultra)?-\d+|nvidia-[a-z0-9-]+|cpu", str(name)), name
    assert BY_NAME["cpu"]["backend"] == "cpu" and BY_NAME["cpu"]["memory_bandwidth_gbs"] is None


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: str(s["name"]))
def test_every_figure_has_a_source(spec):
    sources = spec["sources"]
    assert isinstance(sources, dict)
    for key, value in spec.items():
        if key in _META or value is None:
            continue
        assert key in sources, f"{spec['name']}: {key} has no source"
        assert _cited(sources[key]), f"{spec['name']}: {key} cites {sources[key]!r}"
    assert spec["backend"] in ("metal", "cuda", "cpu")
    if str(spec["name"]).startswith("apple-"):
        assert spec["gpu_cores"] == int(str(spec["name"]).rsplit("-", 1)[1])
        assert "int8_tops" not in spec and "pcie_gbs" not in spec


def test_rows_name_known_hardware_and_shapes():
    assert len(ROWS) >= 55
    for r in ROWS:
        assert r["hardware"] in BY_NAME, r["hardware"]
        assert r["model"] in SHAPES, r["model"]
        assert isinstance(r["tps"], float) and r["tps"] > 0
        assert r["source"].startswith("https://") and r["where"]
        m = re.fullmatch(r"(pp|tg)(\d+)", r["test"])
        assert m, r["test"]
        kind, n = m.groups()
        assert (r["n_prompt"], r["n_gen"]) == ((int(n), 0) if kind == "pp" else (0, int(n)))
        assert r["depth"] >= 0 and r["n_ubatch"] > 0 and r["flash_attn"] in (0, 1)
        assert r["backend"] == {"metal": "Metal", "cuda": "CUDA"}[str(BY_NAME[r["hardware"]]["backend"])]
    families = {r["hardware"].split("-")[0] for r in ROWS}
    assert families == {"apple", "nvidia"}
    assert sum(r["hardware"].startswith("apple-") for r in ROWS) >= 40
    assert sum(r["hardware"].startswith("nvidia-") for r in ROWS) >= 15


def test_rows_are_unique():
    keys = [(r["hardware"], r["model"], r["ftype"], r["test"], r["depth"], r["build"], r["where"]) for r in ROWS]
    assert len(keys) == len(set(keys))


# llama-bench's params column for the published files; the shapes are built sparse (header only)
_PARAMS_B = {"llama2-7b": 6.74, "qwen2.5-coder-7b": 7.62, "qwen3-coder-30b-a3b": 30.53, "gemma3-4b": 3.88,
             "gpt-oss-20b": 20.91, "gpt-oss-120b": 116.83, "llama3-8b": 8.03, "llama3-70b": 70.55}


@pytest.mark.parametrize("model", sorted({r["model"] for r in ROWS}))
def test_shape_matches_the_published_parameter_count(model):
    from fitter.gguf.reader import read_header
    from tests.synth.shapes import build_shape

    header = read_header(build_shape(model))
    n_params = sum(t.n_elements for t in header.tensors)
    assert round(n_params / 1e9, 2) == _PARAMS_B[model]
