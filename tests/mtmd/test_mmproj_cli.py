"""--mmproj / --no-mmproj-offload through RunConfig, the CLI and its errors."""

from __future__ import annotations

import json

import pytest

import cli
from fitter.bundled import resolve_model
from fitter.fit.memory import predict
from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import RunConfig
from fitter.llama.model import load_model_spec
from tests.synth.mmproj import build_mmproj

M = "gemma3-270m"


@pytest.fixture(scope="module")
def mmproj() -> str:
    return str(build_mmproj("gemma3", proj_dim=640))  # 640: gemma3-270m's n_embd (mtmd refuses another width)


def test_server_args_round_trip(mmproj: str) -> None:
    cfg = RunConfig(n_ctx=4096, mmproj=mmproj, no_mmproj_offload=True)
    args = [a for g in cfg.to_server_args() for a in g]
    assert args[args.index("--mmproj") + 1] == mmproj and "--no-mmproj-offload" in args
    back = RunConfig.from_server_args(args)
    assert back.config == cfg and back.unknown == []
    assert RunConfig.from_server_args(["-mm", mmproj, "--mmproj-offload"]).config == RunConfig(mmproj=mmproj)


def test_predict_adds_the_projector_rows_and_nothing_else(mmproj: str) -> None:
    header, spec = load_model_spec(resolve_model(M))
    base = predict(header, spec, RunConfig(n_ctx=4096), Backend.CPU)
    with_mm = predict(header, spec, RunConfig(n_ctx=4096, mmproj=mmproj), Backend.CPU)
    rows = [b for b in with_mm.buffers if b.owner == "mmproj"]
    assert [b for b in with_mm.buffers if b.owner != "mmproj"] == base.buffers
    # the pinned libmtmd's own buffers for this file (tests/mtmd/oracle.py: ggfit-alloc CPU 344320, CPU 903168)
    assert [(b.device, b.kind, b.bytes, b.counts) for b in rows] == [
        ("CPU", "model", 344320, True), ("CPU", "compute", 903168, True)]
    assert with_mm.total_device_bytes == base.total_device_bytes + 344320 + 903168


def test_cuda_offload_puts_the_projector_on_the_first_gpu(mmproj: str) -> None:
    header, spec = load_model_spec(resolve_model(M))
    rows = [b for b in predict(header, spec, RunConfig(n_ctx=4096, mmproj=mmproj), Backend.CUDA).buffers
            if b.owner == "mmproj"]
    # the bytes: tests/mtmd/test_mmproj_gpu_recorded.py (an H200)
    assert [(b.device, b.kind, b.counts) for b in rows] == [
        ("CUDA0", "model", True), ("CUDA0", "compute", True), ("CPU", "compute", False)]
    off = [b for b in predict(header, spec, RunConfig(n_ctx=4096, mmproj=mmproj, no_mmproj_offload=True),
                              Backend.CUDA).buffers if b.owner == "mmproj"]
    # --no-mmproj-offload: clip_ctx on the CPU backend, in host memory (not against the GPU's budget)
    assert [(b.device, b.kind, b.bytes, b.counts) for b in off] == [
        ("CPU", "model", 344320, False), ("CPU", "compute", 903168, False)]


def test_fit_json_lists_the_projector(mmproj: str, capfd) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["fit", M, "--budget", "2GiB", "--backend", "cpu", "-c", "4096", "--mmproj", mmproj, "--json"])
    out, _ = capfd.readouterr()
    assert e.value.code == 0
    rows = [b for b in json.loads(out)["buffers"] if b["owner"] == "mmproj"]
    assert [(b["kind"], b["bytes"]) for b in rows] == [("model", 344320), ("compute", 903168)]
    assert "--mmproj" in out and mmproj in out  # the llama-server flags to run it with


@pytest.fixture(scope="module")
def bad(tmp_path_factory, mmproj: str) -> dict[str, str]:
    d = tmp_path_factory.mktemp("badmm")
    data = open(mmproj, "rb").read()
    (d / "trunc.gguf").write_bytes(data[:3000])
    # a hostile header: the warmup image 2**31 - 1 pixels a side (its patches would not fit any address space)
    out = {"missing": str(d / "none.gguf"), "trunc": str(d / "trunc.gguf"), "text": resolve_model(M),
           "mismatch": str(build_mmproj("gemma3"))}  # 96 wide: mtmd_context refuses it beside a 640-wide model
    # hostile headers: one u32 key changed (the warmup image, the heads, the layers, the width)
    for name, key, value in (("huge", "clip.vision.image_size", 2**31 - 1), ("heads", "clip.vision.attention.head_count", 0),
                             ("layers", "clip.vision.block_count", 2**31 - 1),
                             ("width", "clip.vision.embedding_length", 2**31 - 1)):
        b = bytearray(data)
        at = b.index(key.encode()) + len(key) + 4  # past the key and its u32 type
        b[at:at + 4] = value.to_bytes(4, "little")
        (d / f"{name}.gguf").write_bytes(bytes(b))
        out[name] = str(d / f"{name}.gguf")
    return out


@pytest.mark.parametrize("which,phrase", [("missing", "no such file"), ("trunc", "invalid GGUF"),
                                          ("text", "not 'clip'"), ("huge", "clip.vision.image_size 2147483647"),
                                          ("heads", "head_count 0: must be positive"),
                                          ("layers", "no tensor of layer 2"),
                                          ("width", "not the patch embedding's width"),
                                          ("mismatch", "mismatch between text model (n_embd = 640) and mmproj "
                                                       "(n_embd = 96)")])
@pytest.mark.parametrize("command", ["fit", "quants"])
def test_bad_mmproj_is_one_line_exit_2(command: str, which: str, phrase: str, bad: dict[str, str], capfd) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([command, M, "--budget", "2GiB", "--backend", "cpu", "-c", "4096", "--mmproj", bad[which]])
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"ggfit: error: --mmproj {bad[which]}") and phrase in lines[0]


@pytest.mark.parametrize("argv,phrase", [
    (["probe", M, "--mmproj", "{mm}"], "--mmproj: the python runner loads no multimodal projector"),
    (["optimise", M, "--budget", "2GiB", "--mmproj", "{mm}"], "--mmproj: the python runner loads no multimodal"),
    (["optimise", M, "--budget", "2GiB", "--runner", "server", "--mmproj", "{missing}"], "no such file"),
])
def test_probe_and_optimise_refuse_what_they_cannot_measure(argv: list[str], phrase: str, mmproj: str,
                                                            bad: dict[str, str], tmp_path, monkeypatch, capfd) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        cli.main([a.format(mm=mmproj, missing=bad["missing"]) for a in argv])
    _, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and phrase in lines[0], err


@pytest.mark.parametrize("command", [["fit", "{mm}", "--budget", "2GiB"], ["inspect", "{mm}"]])
def test_an_mmproj_given_as_the_model_is_told_to_use_mmproj(command: list[str], mmproj: str, capfd) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([a.format(mm=mmproj) for a in command])
    _, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and "a multimodal projector (mmproj), not a text model" in lines[0]
