"""The fixed prediction grid (benchmarks/prediction_grid.py: 828 configs over the 15 synthetic architectures,
the bundled Gemma 3 270M and two full-size shapes, on the CPU, CUDA and Metal backends, plus the solver's and
the quants tables) predicted again and compared with the committed baseline,
benchmarks/results/prediction-grid.json.gz: not one byte may move. After a change that is meant to move a
prediction, re-record the baseline with `python3 benchmarks/prediction_grid.py --write <baseline>` and say why
in the commit."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "prediction_grid.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("prediction_grid", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_prediction_grid_matches_baseline() -> None:
    pg = _load_script()
    with gzip.open(pg.BASELINE, "rt") as f:
        before = json.load(f)
    after = json.loads(json.dumps(pg.grid(log=lambda _: None), sort_keys=True))
    assert len(after["rows"]) >= 500
    assert {r["model"] for r in after["rows"]} >= set(pg.SYNTH)
    diffs = pg.compare(before, after)
    assert not diffs, f"{len(diffs)} predictions moved:\n" + "\n".join(diffs[:10])
