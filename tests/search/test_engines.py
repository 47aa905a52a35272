"""An engine-comparison study end to end on tiny models in both formats (the same qwen3 shapes as a
GGUF and as an MLX directory): both engines measured, a winner and the ratio; over-budget trials skipped."""

from __future__ import annotations

import pytest

from search.study.engines import ENGINE_NAMES, compare_engines


@pytest.mark.slow
def test_engine_comparison(llama_server):
    pytest.importorskip("mlx_lm")
    from tests.mlxlm.synth import build as build_mlx
    from tests.synth import build as build_gguf

    gguf = str(build_gguf("qwen3", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=768, n_vocab=1024,
                          ftype="q8_0"))  # the MLX model's shapes and vocabulary (tests.mlxlm.synth.VOCAB)
    mlx_dir = str(build_mlx("qwen3", 8))
    r = compare_engines(gguf, mlx_dir, available_bytes=2**30, n_trials=4, prompt_tokens=32, gen_tokens=8,
                        llama_server=llama_server, threads=2, timeout=300)
    assert {t.engine for t in r.trials} == {"llama", "mlx"}
    assert set(r.best) == {"llama", "mlx"} and r.winner in ("llama", "mlx")
    assert r.ratio is not None and r.ratio >= 1.0
    assert all(t.predicted_bytes > 0 and t.peak_rss_bytes for t in r.best.values())
    text = r.text()
    assert f"winner: {ENGINE_NAMES[r.winner]}" in text and "x the other engine's best decode rate" in text


@pytest.mark.slow
def test_over_budget_configs_are_not_started(llama_server):
    pytest.importorskip("mlx_lm")
    from tests.mlxlm.synth import build as build_mlx
    from tests.synth import build as build_gguf

    gguf = str(build_gguf("qwen3", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=768, n_vocab=1024,
                          ftype="q8_0"))  # the MLX model's shapes and vocabulary (tests.mlxlm.synth.VOCAB)
    r = compare_engines(gguf, str(build_mlx("qwen3", 8)), available_bytes=2 * 2**20, n_trials=2,
                        llama_server=llama_server, threads=2)
    assert [t.status for t in r.trials] == ["skipped", "skipped"] and r.winner is None
    assert all(not t.command for t in r.trials)


def test_optimise_engine_llama_mlx_is_the_engine_study(monkeypatch, capsys):
    """`optimise --engine llama,mlx GGUF MLX_DIR` runs compare-engines' study (here a stand-in that records
    its arguments), with optimise's budget, trials and seed, and prints its report."""
    pytest.importorskip("mlx_lm")
    import cli
    import search.study.engines as engines

    seen: dict = {}

    def study(gguf, mlx_dir, **kw):
        seen.update(kw, gguf=gguf, mlx_dir=mlx_dir)
        t = engines.EngineTrial(number=0, engine="mlx", params={"engine": "mlx"}, status="ok", predicted_bytes=1,
                                decode_tps=2.0)
        return engines.EngineReport(trials=[t], best={"mlx": t}, winner="mlx", ratio=None)

    monkeypatch.setattr(engines, "compare_engines", study)
    with pytest.raises(SystemExit) as e:
        cli.main(["optimise", "gemma3-270m", "/models/gemma3-270m-mlx", "--engine", "llama,mlx", "--budget", "1GiB",
                  "--margin", "0", "--trials", "3", "--seed", "7"])
    assert e.value.code == 0
    assert seen["gguf"].endswith(".gguf") and seen["mlx_dir"] == "/models/gemma3-270m-mlx"
    assert (seen["available_bytes"], seen["n_trials"], seen["seed"]) == (2**30, 3, 7)
    assert "winner: MLX (the other engine had no config that fits and runs)" in capsys.readouterr().out
