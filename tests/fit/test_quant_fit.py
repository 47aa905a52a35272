"""`ggfit quants`: every quant of a model against a budget, from one header (local or over HTTP)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fitter.fit.quant_fit import best_fit, evaluate
from fitter.fit.quants import predict_quant
from fitter.gguf.reader import read_header
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.model import load_model_spec
from tests.http_server import CountingServer
from tests.synth.shapes import build_shape, q4_k_m_types

ROOT = Path(__file__).resolve().parents[2]
MAC = 25559 * 2**20
MiB = 2**20


@pytest.fixture(scope="module")
def qwen36() -> str:
    return str(build_shape("qwen36-35b-a3b"))


def test_every_quant_at_98k_context_on_a_32gb_mac(qwen36: str) -> None:
    header, spec = load_model_spec(qwen36)
    cfg = RunConfig(n_ctx=98304, type_k="q8_0", type_v="q8_0")
    cands = evaluate(header, spec, cfg, Backend.METAL, Frontend.SERVER, MAC, 1024 * MiB,
                     candidates=["UD-Q4_K_M=21109MiB", "UD-Q4_K_S=19925MiB"])
    names = [c.name for c in cands]
    assert {"Q4_K_M", "Q8_0", "UD-Q4_K_M", "UD-Q4_K_S"} <= set(names)
    assert [c.file_bytes for c in cands] == sorted(c.file_bytes for c in cands)
    q4km = next(c for c in cands if c.name == "Q4_K_M")
    assert q4km.file_bytes == predict_quant(header, "Q4_K_M").file_bytes
    best = best_fit(cands)
    assert best is not None and best.fits and not best.needs_imatrix
    assert all(c.file_bytes <= best.file_bytes for c in cands if c.fits and not c.needs_imatrix)
    assert not next(c for c in cands if c.name == "Q8_0").fits
    for c in cands:  # the largest context really is the boundary of what fits at these settings
        assert (c.largest_ctx >= 98304) == c.fits or c.largest_ctx < 98304


def test_candidate_read_over_http(qwen36: str, server: CountingServer) -> None:  # noqa: F811
    """A candidate file named by URL: only its header travels, and it gives the same device total as
    the same quant predicted from the F16 header."""
    q4 = build_shape("qwen36-35b-a3b", tensor_types=q4_k_m_types("qwen36-35b-a3b"))
    server.files["/q4km.gguf"] = Path(q4)
    header, spec = load_model_spec(qwen36)
    cfg = RunConfig(n_ctx=32768)
    cands = evaluate(header, spec, cfg, Backend.METAL, Frontend.SERVER, MAC, 1024 * MiB,
                     candidates=["file=" + server.url("/q4km.gguf")])
    server.wait_for_handlers()
    remote = next(c for c in cands if c.name == "file")
    local = evaluate(header, spec, cfg, Backend.METAL, Frontend.SERVER, MAC, 1024 * MiB, candidates=[f"file={q4}"])
    assert remote.file_bytes == Path(q4).stat().st_size
    assert remote.model_dump(exclude={"source"}) == next(c for c in local if c.name == "file").model_dump(exclude={"source"})
    # the same tensor types as the predicted Q4_K_M, in another file layout: llama-quantize writes
    # token_embd among the GPU tensors, so Metal's mapped range (get_mapping_range) covers it there
    predicted = next(c for c in cands if c.name == "Q4_K_M")
    assert remote.file_bytes == predicted.file_bytes
    h = read_header(q4)
    tok = next(t for t in h.tensors if t.name == "token_embd.weight").nbytes
    assert predicted.total_device_bytes - remote.total_device_bytes == tok
    assert server.sent["/q4km.gguf"] - h.header_size < 2 * MiB


def test_server_without_range_is_a_clear_error(server: CountingServer, qwen36: str) -> None:  # noqa: F811
    server.files["/x.gguf"] = Path(qwen36)
    server.mode = "no-range"
    out = subprocess.run([sys.executable, "cli.py", "quants", qwen36, "--budget", "25559MiB", "--backend", "metal",
                          "--candidate", "x=" + server.url("/x.gguf")], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 2 and "Range" in out.stderr and "Traceback" not in out.stderr
    server.wait_for_handlers()
    assert server.sent["/x.gguf"] < 1 * MiB  # not a 67 GB download


def test_bad_candidate_is_one_line() -> None:
    out = subprocess.run([sys.executable, "cli.py", "quants", "gemma3-270m", "--budget", "8GiB", "--candidate", "oops"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "--candidate" in out.stderr


@pytest.mark.parametrize("model", ["qwen36", "gemma3-270m", "deepseek2", "gpt-oss", "gemma3", "qwen35moe"])
def test_requantized_spec_is_the_spec_read_from_the_quantized_header(model: str, qwen36: str) -> None:
    """evaluate's spec of each predicted quant (requantized_spec: the model's spec, its tensor facts replaced) is the one
    model_spec_from_header reads from that quant's header, field for field."""
    from fitter.bundled import resolve_model
    from fitter.fit.quant_fit import quantized_header
    from fitter.fit.quants import predict_all
    from fitter.llama.model import model_spec_from_header, requantized_spec
    from tests.synth import build

    path = {"qwen36": qwen36, "gemma3-270m": resolve_model("gemma3-270m")}.get(model) or str(build(model))
    header, spec = load_model_spec(path)
    n = 0
    for q in predict_all(header):
        if q.refused:
            continue
        try:
            qh = quantized_header(header, q)
        except ValueError:  # a type the gguf package does not know
            continue
        derived, read = requantized_spec(spec, qh), model_spec_from_header(qh)
        assert derived == read and derived.model_dump() == read.model_dump(), q.ftype
        n += 1
    assert n > 20
