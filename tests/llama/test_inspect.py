"""`ggfit inspect` against what llama.cpp prints for the same file (its load log, print_info)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.llama.hparams import LayerKind
from fitter.oracle.llama_run import LlamaParams, measure
from tests.synth import REGISTRY, build

GEMMA = "gemma3-270m"


def inspect_json(model: str) -> dict:
    out = subprocess.run(
        [sys.executable, "cli.py", "inspect", model, "--json"],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _per_layer(value, n: int) -> list[int]:
    return value if isinstance(value, list) else [value] * n


def models() -> list[str]:
    return [GEMMA] + sorted(REGISTRY)


@pytest.mark.slow
@pytest.mark.parametrize("name", models())
def test_inspect_agrees_with_llama_cpp(name: str) -> None:
    if name == GEMMA:
        from fitter.bundled import resolve_model

        path = resolve_model(GEMMA)
    else:
        path = str(build(name))
    ours = inspect_json(path)
    run = measure(path, LlamaParams(n_ctx=512), mode="dry", log_level="debug").raise_for_status()
    hp = run.report.hparams
    trunk = [lay for lay in ours["layers"] if not lay["nextn"]]

    assert ours["architecture"] == hp.arch
    assert ours["n_layer"] == hp.n_layer
    assert ours["n_embd"] == hp.n_embd
    assert ours["n_ctx_train"] == hp.n_ctx_train
    assert ours["n_vocab"] == hp.n_vocab
    assert ours["file_type_name"] == hp.file_type
    n_all = len(ours["layers"])
    assert [lay["n_head_kv"] for lay in ours["layers"]] == _per_layer(hp.n_head_kv, n_all)[:n_all]
    assert [lay["n_head"] for lay in ours["layers"]] == _per_layer(hp.n_head, n_all)[:n_all]
    # print_info prints the full-attention head sizes, and the sliding-window ones separately
    full = [lay for lay in trunk if lay["kind"] == LayerKind.FULL.value]
    swa = [lay for lay in trunk if lay["kind"] == LayerKind.SWA.value]
    if full:
        assert full[0]["n_embd_head_k"] == hp.n_embd_head_k
        assert full[0]["n_embd_head_v"] == hp.n_embd_head_v
    if swa and hp.n_embd_head_k_swa is not None:
        assert swa[0]["n_embd_head_k"] == hp.n_embd_head_k_swa
        assert swa[0]["n_embd_head_v"] == hp.n_embd_head_v_swa
    if hp.n_swa is not None:
        assert ours["n_swa"] == hp.n_swa
    if hp.is_swa is not None:  # per layer, from llama.cpp's DEBUG load_tensors lines
        assert [lay["kind"] == LayerKind.SWA.value for lay in ours["layers"]] == hp.is_swa[:n_all]
    if hp.n_expert is not None:
        assert ours["n_expert"] == hp.n_expert
        assert ours["n_expert_used"] == (hp.n_expert_used or 0)
    # llama.cpp's KV caches cover exactly the layers ggfit calls attention layers with their own KV
    attn = [lay for lay in trunk if lay["kind"] != LayerKind.RECURRENT.value and lay["has_kv"]]
    assert sum(c.layers for c in run.report.kv_caches) == len(attn)
    # (the recurrent-state size line prints the model's layer count, not the recurrent layers: its
    # bytes are checked in tests/llama/test_memory_exact.py)
    assert bool(run.report.recurrent) == any(lay["kind"] == LayerKind.RECURRENT.value for lay in trunk)
    assert ours["has_mtp"] == (hp.n_layer_all is not None and hp.n_layer_all > hp.n_layer)


def test_inspect_human_output_on_bundled_model() -> None:
    out = subprocess.run([sys.executable, "cli.py", "inspect", GEMMA], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "gemma3" in out.stdout
    assert "SSSSSFSSSSSFSSSSSF" in out.stdout  # llama.cpp's gemma3 pattern: every 6th layer full attention
    assert "Q4_K - Medium" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "/nonexistent/model.gguf"], "no such file"),
        (["inspect", "pyproject.toml"], "bad magic"),
        (["inspect", "ftp://example/model.gguf"], "unsupported URL scheme"),
        (["inspect", "--no-such-flag", "x"], "No such option"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr
