"""Real llama-server sessions recorded here (benchmarks/session_here.py -> benchmarks/results/session-cpu-here.json:
the pinned build, CPU, the bundled Gemma 3 270M and synthetic SWA gemma3 / hybrid qwen35 models), replayed against
fitter.session: the prompt cache's size as the server printed it after every request, each checkpoint and saved
state, and the growth of the server's resident memory within 5% or 64 MiB (issue 48's bar)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.session_here import compare, predicted

REC = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "session-cpu-here.json"
DOC = json.loads(REC.read_text()) if REC.exists() else {"cases": []}
MIB = 2**20


def test_the_recording_names_its_build():
    assert DOC["build"]["ggml_commit"].startswith("0c1e570")
    assert DOC["cases"], "no cases recorded"


@pytest.mark.parametrize("case", DOC["cases"], ids=[c["label"] for c in DOC["cases"]])
def test_logged_cache_checkpoints_and_states_are_predicted(case):
    rows = case["requests"]
    s = predicted(case, list(range(1, len(rows) + 1)))
    for p, m in zip(s.points, rows):
        assert round(p.cache_bytes / MIB, 3) == pytest.approx(m.get("cache_mib", 0.0), abs=0.0015), p.requests
        assert p.cache_entries == m.get("cache_prompts", 0), p.requests
    ckpts = [round(c / MIB, 3) for c in s.checkpoints]
    for m in rows:  # the slot keeps the last --ctx-checkpoints of those created
        created = [c[1] for c in m["checkpoints"]]
        assert created[len(created) - len(ckpts):] == pytest.approx(ckpts, abs=0.0015)
        assert len(created) >= len(ckpts) and (created or not ckpts)
        for _, size in m["saves"]:
            assert size == pytest.approx(s.state_bytes / MIB, abs=0.0015)


@pytest.mark.parametrize("case", DOC["cases"], ids=[c["label"] for c in DOC["cases"]])
def test_resident_memory_grows_as_predicted(case):
    for r in compare(case):
        tol = max(0.05 * r["growth_predicted"], 64 * MIB)
        assert abs(r["growth_measured"] - r["growth_predicted"]) <= tol, r
