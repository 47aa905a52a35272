"""A projector whose width is not the text model's: the pinned libmtmd refuses the pair (mtmd_context::mtmd_context,
"mismatch between text model (n_embd = 640) and mmproj (n_embd = 96)"), and so does ggfit, in its words."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fitter.bundled import resolve_model
from fitter.fit.memory import predict
from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import RunConfig
from fitter.llama.model import load_model_spec
from fitter.mtmd.hparams import MmprojError
from tests.synth.mmproj import build_mmproj

M = "gemma3-270m"  # n_embd 640

# mtmd_init_from_file with the text model loaded (llama-server's order), in a child: prints the verdict
_CHILD = """
import sys, llama_cpp
import llama_cpp.mtmd_cpp as m
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
p = m.mtmd_context_params_default()
p.use_gpu, p.warmup = False, False
print("mtmd-ok" if m.mtmd_init_from_file(sys.argv[2].encode(), model, p) else "mtmd-refused", flush=True)
"""


def _mtmd(model: str, mmproj: str) -> tuple[bool, str]:
    r = subprocess.run([sys.executable, "-c", _CHILD, model, mmproj], capture_output=True, text=True, timeout=300)
    assert "mtmd-ok" in r.stdout or "mtmd-refused" in r.stdout, r.stderr[-2000:]
    return "mtmd-ok" in r.stdout, r.stderr


@pytest.mark.parametrize("kind,over", [("gemma3", {}), ("gemma3", {"proj_dim": 640}), ("qwen25vl", {}),
                                       ("qwen25vl", {"proj_dim": 640})])
def test_ggfit_refuses_the_pairs_mtmd_refuses(kind: str, over: dict) -> None:
    model = resolve_model(M)
    mm = str(build_mmproj(kind, **over))
    ok, log = _mtmd(model, mm)
    assert ok == (over.get("proj_dim") == 640)  # the synthetic projectors are 96 wide unless told
    header, spec = load_model_spec(model)
    cfg = RunConfig(n_ctx=4096, mmproj=mm)
    if ok:
        assert any(b.owner == "mmproj" for b in predict(header, spec, cfg, Backend.CPU).buffers)
        return
    said = next(ln for ln in log.splitlines() if "mismatch between text model" in ln)
    with pytest.raises(MmprojError) as e:
        predict(header, spec, cfg, Backend.CPU)
    # llama.cpp's own words, its numbers included
    assert said.split("error: ", 1)[1].strip() in str(e.value)


def test_optimise_refuses_the_pair_before_its_first_trial(tmp_path, monkeypatch, capfd):
    import cli

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        cli.main(["optimise", M, "--budget", "2GiB", "--runner", "server", "--mmproj", str(build_mmproj("gemma3"))])
    err = capfd.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "mismatch between text model (n_embd = 640) and mmproj (n_embd = 96)" in err
    assert not (tmp_path / "ggfit").exists()  # no study was created
