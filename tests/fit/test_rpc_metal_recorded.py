"""--rpc with a Mac's Metal rpc-server (`rpc-server -d MTL0`), replayed where a recording exists (none yet: no Mac
here). On an Apple Silicon Mac (search.build_server builds the pinned llama-server and ggml-rpc-server there with
GGML_RPC=ON, and CMake turns Metal on by default on macOS; untested here):

    PYTHONPATH=. python3 benchmarks/rpc_here.py --server-args '-d MTL0' --rpc-devices-only --no-dry \\
        --out benchmarks/results/rpc-metal-server-mac.json

records every buffer each server allocated (GGML_RPC_DEBUG); these tests then hold every RPC buffer to the byte, as
tests/fit/test_rpc_cuda_server_recorded.py does for CUDA servers. Until then tests/fit/test_rpc_metal.py holds the
remote Mac to the local Metal backend's rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fit.test_rpc_cuda_server_recorded import _diffs

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FILES = [f for f in ("rpc-metal-server-mac.json",) if (RESULTS / f).exists()]
ROWS = [(f, r) for f in FILES for r in json.loads((RESULTS / f).read_text())["rows"] if r["measured"]]


@pytest.mark.parametrize("fr", ROWS, ids=lambda fr: f"{fr[1]['model']}-{fr[1]['servers']}x-"
                         + "-".join(f"{k}={v}" for k, v in fr[1]["config"].items()))
def test_every_buffer_of_every_metal_server_matches_llama_cpp(fr: tuple) -> None:
    assert _diffs(fr[1], "MTL") == ({}, {})
