"""compare-engines says the decode ratio the bandwidth model predicts (MLX over llama.cpp) before any probe, and
keeps it in the report and its JSON (issue 46). The servers are replaced by a stand-in trial: no probe runs here."""

from __future__ import annotations

import json

import pytest

from fitter.speed.hardware import get_profile

pytest.importorskip("optuna")
APPLE = get_profile("apple-m4-pro-20")


@pytest.fixture
def pair():
    pytest.importorskip("mlx_lm")
    from tests.mlxlm.synth import build as build_mlx
    from tests.synth import build as build_gguf

    gguf = str(build_gguf("qwen3", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=768, n_vocab=1024,
                          ftype="q8_0"))  # the MLX model's shapes and vocabulary (tests.mlxlm.synth.VOCAB)
    return gguf, str(build_mlx("qwen3", 8))


@pytest.fixture
def no_servers(monkeypatch):
    """Each trial answers at once (llama.cpp 100 tok/s, MLX 130 tok/s); `said` keeps the progress lines in order."""
    import search.study.engines as engines

    said: list[str] = []

    def trial(self, t):
        engine = t.suggest_categorical("engine", ["llama", "mlx"])
        rec = engines.EngineTrial(number=t.number, engine=engine, params=dict(t.params), status="ok",
                                  predicted_bytes=1, decode_tps=100.0 if engine == "llama" else 130.0)
        self.trials.append(rec)
        self.say(f"trial {t.number}: {engine} probed")
        return rec.decode_tps

    monkeypatch.setattr(engines, "find_llama_server", lambda path: "llama-server")
    monkeypatch.setattr(engines._Objective, "__call__", trial)
    monkeypatch.setattr(engines, "study_hardware", lambda: APPLE)
    return said


def test_the_predicted_ratio_is_said_before_any_probe(pair, no_servers):
    from search.study.engine_speed import MLX_DECODE_EFFICIENCY
    from search.study.engines import compare_engines

    r = compare_engines(*pair, available_bytes=2**30, n_trials=2, progress=no_servers.append, hardware=APPLE)
    assert no_servers[0].startswith("[ggfit] predicted before any probe (apple-m4-pro-20, bandwidth model): MLX decode")
    assert all("probed" in line for line in no_servers[1:]) and len(no_servers) == 3
    p = r.predicted
    assert p is not None and p.mlx_efficiency == MLX_DECODE_EFFICIENCY
    assert p.ratio == pytest.approx(p.mlx_decode_tps / p.llama_decode_tps, rel=1e-3)
    assert "not fitted" in p.note
    assert f"MLX/llama.cpp {p.ratio:.2f}x" in r.text() and "measured 1.30x" in r.text()


def test_half_the_bandwidth_predicts_a_slower_mlx_decode(pair):
    """The MLX side is bandwidth-bound: the same bytes per token over half the bandwidth decode slower."""
    from fitter.llama.model import load_model_spec
    from fitter.mlx.config import load_mlx_model
    from search.study import engine_speed

    header, spec = load_model_spec(pair[0])
    mlx = load_mlx_model(pair[1])
    base = engine_speed.predict_engines(header, spec, mlx, APPLE, n_ctx=512)
    n = engine_speed.mlx_bytes_per_token(mlx)
    heavy = engine_speed.predict_engines(header, spec, mlx, APPLE.model_copy(
        update={"memory_bandwidth_gbs": APPLE.memory_bandwidth_gbs / 2}), n_ctx=512)
    assert base is not None and heavy is not None and n > 0
    assert heavy.mlx_decode_tps < base.mlx_decode_tps


def test_compare_engines_json_has_the_predicted_ratio(pair, no_servers, capsys):
    import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["compare-engines", *pair, "--budget", "1GiB", "--margin", "0", "--trials", "2", "--json"])
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted"]["hardware"] == "apple-m4-pro-20"
    assert out["predicted"]["ratio"] > 0 and out["predicted"]["mlx_efficiency"] > 0
