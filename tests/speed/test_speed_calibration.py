"""fitter.speed.calibration: llama-bench rows as the configs they ran, and the store of a machine's scales (keyed
by hardware and llama.cpp build, in a temporary cache directory)."""

from __future__ import annotations

import os

import pytest

from fitter.ggml.backends.base import Backend
from fitter.llama_builds import PINNED, resolve_build
from fitter.speed import calibration as sc
from fitter.speed.bench_file import read_bench

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "llama-bench")


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path / "cache"))


def test_rows_become_the_configs_llama_bench_ran():
    rows = read_bench(os.path.join(DATA, "h200.csv"))
    kinds = {sc.kind_of(r) for r in rows}
    assert kinds == {"prefill", "decode"}
    for r in rows:
        be = sc.backend_of_row(r, Backend.CPU)
        assert be == Backend.CUDA  # "CUDA"
        cfg, n_gpus = sc.config_of_row(r, be)
        assert n_gpus == 1 and cfg.n_parallel == 1
        assert cfg.n_ctx == (r.n_prompt or 0) + (r.n_gen or 0) + (r.n_depth or 0)
        assert cfg.n_gpu_layers == (-1 if r.n_gpu_layers == 99 else r.n_gpu_layers)  # 99: every layer
        assert cfg.n_cpu_moe == r.n_cpu_moe and cfg.n_ubatch == r.n_ubatch
        assert cfg.flash_attn == {1: "on", 0: "off"}.get(r.flash_attn, "auto")


def test_a_tensor_split_over_two_gpus_and_the_metal_and_cpu_backends():
    row = read_bench(os.path.join(DATA, "h200.csv"))[0].model_copy(
        update={"tensor_split": "3.00/1.00", "backends": "Metal,BLAS"})
    cfg, n_gpus = sc.config_of_row(row, Backend.CUDA)
    assert n_gpus == 2 and cfg.tensor_split == (3.0, 1.0)
    assert sc.backend_of_row(row, Backend.CPU) == Backend.METAL
    assert sc.backend_of_row(row.model_copy(update={"backends": "CPU"}), Backend.CUDA) == Backend.CPU
    assert sc.backend_of_row(row.model_copy(update={"backends": None}), Backend.CUDA) == Backend.CUDA


def test_the_scale_is_the_median_ratio():
    assert sc.scale_of([(110.0, 100.0), (90.0, 100.0), (200.0, 100.0)]) == pytest.approx(1.1)
    assert sc.scale_of([]) == 1.0 and sc.scale_of([(0.0, 10.0)]) == 1.0


def test_the_store_keys_by_hardware_and_build_and_a_short_commit_finds_the_pinned_build():
    key = sc.rows_build_key("0c1e570", 1, PINNED)  # llama-bench's build line of the pinned build
    assert key == sc.rows_build_key(None, None, PINNED)
    cal = sc.SpeedCalibration(hardware="nvidia-h200", llama_cpp=key, prefill=1.2, decode=0.9, prefill_rows=3,
                              decode_rows=3, date="2026-12-04", source="h200.csv")
    where = sc.save(cal)
    assert where.is_file() and str(where).startswith(os.environ["GGFIT_CACHE"])
    got = sc.load("nvidia-h200", PINNED)
    assert got is not None and got.scale == {"prefill": 1.2, "decode": 0.9}
    assert got.label == "calibrated from 6 llama-bench rows (2026-12-04)"
    assert sc.load("nvidia-rtx-4090", PINNED) is None
    assert sc.load("nvidia-h200", resolve_build("b9430")) is None  # another build
    short = cal.model_copy(update={"hardware": "cpu", "llama_cpp": "0c1e570"})
    sc.save(short)
    assert sc.load("cpu", PINNED) is not None and len(sc.stored()) == 2


def test_a_damaged_store_is_ignored_with_a_warning(capsys):
    path = sc.store_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert sc.load("cpu", PINNED) is None
    assert "speed calibrations ignored" in capsys.readouterr().err
