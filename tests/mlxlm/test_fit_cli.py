"""`ggfit fit --engine mlx`: the table, JSON and solver; hostile safetensors headers give one line."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.errors import GGFitError
from fitter.mlx.config import load_mlx_model
from fitter.mlx.memory import MlxRun, largest_context_mlx, predict_mlx
from fitter.mlx.safetensors import read_safetensors_header

ROOT = Path(__file__).resolve().parents[2]


def _ggfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_fit_json_and_largest_context(mlx_model):
    d = str(mlx_model("qwen3_5", 4))
    r = _ggfit("fit", "--engine", "mlx", d, "--budget", "80MiB", "--margin", "0MiB", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    n = out["largest_n_ctx"]
    assert n and n % 256 == 0 and out["fits"]
    kinds = {b["kind"] for b in out["buffers"]}
    assert kinds == {"model", "kv", "rs", "compute"}
    assert out["total_device_bytes"] == sum(b["bytes"] for b in out["buffers"] if b["counts"])
    assert any("prompt cache is unbounded" in w for w in out["warnings"])
    m = load_mlx_model(d)
    assert predict_mlx(m, MlxRun(n_ctx=n + 256)).total_device_bytes > 80 * 2**20  # the next step does not fit
    assert largest_context_mlx(m, MlxRun(n_ctx=256), 80 * 2**20, 32768)[0] == n


def test_fit_text_and_over_budget(mlx_model):
    d = str(mlx_model("qwen3", 8))
    r = _ggfit("fit", "--engine", "mlx", d, "--budget", "1GiB", "--margin", "0MiB", "-c", "8192", "--kv-bits", "4",
               "--prompt-cache-bytes", "64MiB")
    assert r.returncode == 0, r.stderr
    assert "QuantizedKVCache: 4 layers" in r.stdout and "mlx_lm.server" in r.stdout and "--kv-bits 4" in r.stdout
    assert "prompt cache ceiling" in r.stdout and "unbounded" not in r.stdout
    r = _ggfit("fit", "--engine", "mlx", d, "--budget", "4MiB", "--margin", "0MiB", "-c", "8192")
    assert r.returncode == 1 and "does NOT fit" in r.stdout


def _write(path: Path, header: bytes, n_len: int | None = None, data: bytes = b"") -> str:
    path.write_bytes(struct.pack("<Q", len(header) if n_len is None else n_len) + header + data)
    return str(path)


@pytest.mark.parametrize("header, n_len, match", [
    (b"{}", 2**40, "header length"),
    (b"not json", None, "not JSON"),
    (b"[1]", None, "not a JSON object"),
    (json.dumps({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}).encode(), None, "unknown dtype"),
    (json.dumps({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}).encode(), None, "invalid shape"),
    (json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(), None, "outside the data"),
    (json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode(), None, "bytes of data"),
])
def test_hostile_safetensors(tmp_path, header, n_len, match):
    p = _write(tmp_path / "model.safetensors", header, n_len, data=b"\0" * 4)
    with pytest.raises(GGFitError, match=match):
        read_safetensors_header(p)


def test_hostile_model_dir_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    _write(tmp_path / "model.safetensors", b"{", None)
    r = _ggfit("fit", "--engine", "mlx", str(tmp_path), "--budget", "2GiB", "-c", "512")
    assert r.returncode == 2 and r.stderr.startswith("ggfit: error:") and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_model_dir_over_http(mlx_model, server):
    d = mlx_model("qwen3", 4)
    for f in ("config.json", "model.safetensors"):
        server.files[f"/m/{f}"] = d / f
    m = load_mlx_model(server.url("/m"))
    local = load_mlx_model(str(d))
    assert m.tensors == local.tensors and m.spec == local.spec
    assert m.file_bytes == local.file_bytes == (d / "model.safetensors").stat().st_size  # on disk, told by the server
    server.wait_for_handlers()
    # only the header travelled (the first ranged read is 64 KiB), not the 2 MB of weights
    assert server.sent["/m/model.safetensors"] <= 64 * 1024 < (d / "model.safetensors").stat().st_size


def test_unsupported_model_type(tmp_path, mlx_model):
    d = tmp_path / "m"
    shutil.copytree(mlx_model("qwen3", 4), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_oss"}))
    r = _ggfit("fit", "--engine", "mlx", str(d), "--budget", "2GiB", "-c", "512")
    assert r.returncode == 2 and "model_type 'gpt_oss'" in r.stderr


def test_draft_rows(mlx_model):
    from fitter.mlx.cache import CacheSettings

    m, d = load_mlx_model(str(mlx_model("qwen3", 8))), load_mlx_model(str(mlx_model("qwen3", 4)))
    run = MlxRun(n_ctx=1024, max_tokens=256, cache=CacheSettings(), num_draft_tokens=3)
    with_draft, alone = predict_mlx(m, run, d), predict_mlx(m, run)
    rows = [b for b in with_draft.buffers if b.owner == "draft"]
    assert {b.kind for b in rows} == {"model", "kv"}
    assert with_draft.total_device_bytes - alone.total_device_bytes == sum(b.bytes for b in rows)


def test_settings_mlx_lm_would_ignore_are_said(mlx_model):
    from fitter.mlx.cache import CacheSettings

    m = load_mlx_model(str(mlx_model("qwen3_5", 4)))
    w = predict_mlx(m, MlxRun(n_ctx=1024, cache=CacheSettings(max_kv_size=512, kv_bits=8))).warnings
    assert any("--max-kv-size 512 has no effect" in x for x in w)
    assert any("stays unquantized" in x for x in w)


@pytest.mark.parametrize("change, match", [
    ({"num_hidden_layers": 10**12}, "num_hidden_layers"),
    ({"num_attention_heads": "x"}, "num_attention_heads"),
    ({"head_dim": [1]}, "head_dim"),
    ({"quantization": {"bits": "4"}}, "quantization"),
    ({"model_type": "qwen3_5", "text_config": 7}, "text_config"),
])
def test_hostile_config_is_one_error(change, match):
    from fitter.mlx.config import spec_from_config

    base = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 32}
    with pytest.raises(GGFitError, match=match):
        spec_from_config({**base, **change})
