"""`ggfit calibrate`: only a calibration with llama.cpp's numbers behind it is stored; `fit` says when one
applies; `--list` and `--clear` manage the store; a damaged store never breaks `fit`.

Every test uses its own XDG_DATA_HOME (never the user's store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.fit import calibration
from fitter.fit.calibration import Calibration, CalibrationError, Correction
from fitter.llama.cparams import Backend
from fitter.llama_builds import LLAMA_CPP_COMMIT
from fitter.oracle.calibrate import calibrate, local_devices

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("GGFIT_DATA", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    return tmp_path / "ggfit" / "calibration.json"


def ggfit(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    # the environment (XDG_DATA_HOME) is the fixture's, through os.environ
    return subprocess.run([sys.executable, "cli.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=env)


def _absent_backend() -> str:
    have = {d["reg"] for d in local_devices()}
    for name, reg in (("cuda", "CUDA"), ("metal", "MTL")):
        if reg not in have:
            return name
    pytest.skip("this llama.cpp has every backend ggfit models")


def test_backend_llama_cpp_lacks_is_refused_and_nothing_stored(store: Path, gemma: str) -> None:
    backend = _absent_backend()
    out = ggfit("calibrate", "gemma3-270m", "--backend", backend)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ggfit: error: --backend {backend}: the local llama.cpp has no ")
    assert "Traceback" not in out.stderr
    assert not store.exists() and not store.parent.exists()


def test_too_few_reported_points_store_nothing(store: Path, gemma: str) -> None:
    # ctx_max 4096 leaves two grid points: not enough for a line
    with pytest.raises(CalibrationError, match="2 of 2 dry runs, 3 needed"):
        calibrate(gemma, Backend.CPU, ctx_max=4096)
    assert not store.exists()


def test_a_fit_without_data_is_never_saved(store: Path) -> None:
    flat = Correction(a=0.0, b=0.0, points=6, max_abs_error_bytes=0)
    for device in (flat, None, Correction(a=0.0, b=1.0, points=2, max_abs_error_bytes=0)):
        with pytest.raises(CalibrationError):
            calibration.save(Calibration(architecture="gemma3", backend="cuda", llama_cpp=LLAMA_CPP_COMMIT, device=device))
    assert not store.exists()


def _fit_json(*extra: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    out = ggfit("fit", "gemma3-270m", "--budget", "25559MiB", "-c", "8192", "--json", *extra, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


@pytest.fixture(scope="module")
def clean_cuda(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The CUDA prediction with an empty store (the defect's command: fit --budget 25559MiB --backend cuda -c 8192)."""
    env = {k: v for k, v in os.environ.items() if k != "GGFIT_DATA"}
    env["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("empty"))
    data, err = _fit_json("--backend", "cuda", env=env)
    assert err == "" and data["calibration"] == []
    return data


def _compute(data: dict) -> dict[str, int]:
    return {b["device"]: b["bytes"] for b in data["buffers"] if b["kind"] == "compute"}


@pytest.mark.parametrize("content", [
    # the store the defect wrote (format 1): measured = +0.000 MiB + 0.00000 x predicted for CUDA
    json.dumps({f"gemma3|cuda|{LLAMA_CPP_COMMIT}": {
        "architecture": "gemma3", "backend": "cuda", "llama_cpp": LLAMA_CPP_COMMIT,
        "device": {"a": 0.0, "b": 0.0, "points": 6, "max_abs_error_bytes": 0}, "host": None}}),
    "{not json",
    "[]",  # crashed fit before (a list has no .get)
    json.dumps({"format": 2, "entries": {f"gemma3|cuda|{LLAMA_CPP_COMMIT}": {
        "architecture": "gemma3", "backend": "cuda", "llama_cpp": LLAMA_CPP_COMMIT,
        "device": {"a": 0.0, "b": 0.0, "points": 6, "max_abs_error_bytes": 0}}}}),
    json.dumps({"format": 2, "entries": {"x": {"architecture": 3}}}),
    json.dumps({"format": 2, "entries": {f"gemma3|cuda|{LLAMA_CPP_COMMIT}": {
        "architecture": "gemma3", "backend": "cuda", "llama_cpp": LLAMA_CPP_COMMIT,
        "device": {"a": float("nan"), "b": 1.0, "points": 6, "max_abs_error_bytes": 0}}}}),
])
def test_damaged_or_old_store_is_ignored_with_one_warning(store: Path, content: str, clean_cuda: dict) -> None:
    clean = clean_cuda
    store.parent.mkdir(parents=True)
    store.write_text(content)
    data, err = _fit_json("--backend", "cuda")
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ggfit: warning: ") and "ignored" in lines[0], err
    assert data["calibration"] == []
    assert _compute(data) == _compute(clean) and _compute(data)["CUDA0"] > 0
    assert data["buffers"] == clean["buffers"]


def test_cpu_calibration_is_listed_applied_and_cleared(store: Path, gemma: str) -> None:
    before, _ = _fit_json("--backend", "cpu")
    out = ggfit("calibrate", "gemma3-270m", "--backend", "cpu", "--json")
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    assert made["stored"] == str(store) and store.exists()
    cal = Calibration.model_validate(made["calibration"])
    assert cal.architecture == "gemma3" and cal.backend == "cpu" and cal.llama_cpp == LLAMA_CPP_COMMIT
    assert cal.device is not None and cal.device.points == 6 and cal.device.b > 0 and cal.host is None
    # the CPU compute model is exact on the pinned build: every grid point matches to the byte
    assert all(r["predicted_device"] == r["measured_device"] for r in made["grid"])
    assert cal.identity and made["identity"]

    listed = ggfit("calibrate", "--list")
    assert listed.returncode == 0, listed.stderr
    assert f"gemma3 on cpu, llama.cpp {LLAMA_CPP_COMMIT[:12]} (identity: changes nothing)" in listed.stdout
    assert f"stored in {store}" in listed.stdout

    after, err = _fit_json("--backend", "cpu")
    assert err == ""
    assert after["calibration"] == [{"architecture": "gemma3", "backend": "cpu", "llama_cpp": LLAMA_CPP_COMMIT,
                                     "stored": str(store), "identity": True, "changed": []}]
    assert after["buffers"] == before["buffers"]  # an identity changes no byte
    text = ggfit("fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", "-c", "8192")
    assert (f"calibration applied: gemma3 on cpu, llama.cpp {LLAMA_CPP_COMMIT[:12]}, from {store}: identity, "
            "no buffer changed") in text.stdout

    # a calibration that changes the device compute buffer: fit names the buffer and both sizes
    shifted = cal.model_copy(update={"device": cal.device.model_copy(update={"a": 1.0 * MiB})})
    calibration.save(shifted)
    moved, _ = _fit_json("--backend", "cpu")
    (applied,) = moved["calibration"]
    assert not applied["identity"]
    (change,) = applied["changed"]
    assert change["owner"] == "target" and change["device"] == "CPU"
    assert change["calibrated_bytes"] == change["predicted_bytes"] + MiB == _compute(before)["CPU"] + MiB
    assert _compute(moved)["CPU"] == _compute(before)["CPU"] + MiB
    text = ggfit("fit", "gemma3-270m", "--budget", "2GiB", "--backend", "cpu", "-c", "8192")
    old, new = _compute(before)["CPU"] / MiB, _compute(before)["CPU"] / MiB + 1
    assert f"from {store}: changed target CPU compute {old:,.2f} -> {new:,.2f} MiB" in text.stdout

    cleared = ggfit("calibrate", "--clear", "gemma3")
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout.startswith("removed 1 calibration for gemma3: gemma3 on cpu")
    assert "no calibration stored" in ggfit("calibrate", "--list").stdout
    gone, _ = _fit_json("--backend", "cpu")
    assert gone["calibration"] == [] and gone["buffers"] == before["buffers"]


def test_clear_all_removes_even_a_damaged_file(store: Path) -> None:
    store.parent.mkdir(parents=True)
    store.write_text("{not json")
    out = ggfit("calibrate", "--clear", "gemma3")
    assert out.returncode == 2 and out.stderr.startswith("ggfit: error: ") and len(out.stderr.splitlines()) == 1
    out = ggfit("calibrate", "--clear")
    assert out.returncode == 0, out.stderr
    assert not store.exists()


def test_calibrate_without_model_or_with_both_flags_is_one_line(store: Path) -> None:
    for args in (("calibrate",), ("calibrate", "--list", "--clear"), ("calibrate", "--list", "gemma3-270m")):
        out = ggfit(*args)
        assert out.returncode == 2 and out.stderr.startswith("ggfit: error: "), (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1
