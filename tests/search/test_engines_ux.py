"""`ggfit compare-engines` as a user meets it (issue 49): the same model in both formats or a refusal, a line per
trial as it starts and ends, a table (not Python dicts), Ctrl-C in one line, no Optuna log lines.

Both servers are the fake OpenAI server (tests/search/fake_openai.py): llama-server through a stand-in executable
that serves on the `--port` ggfit gives it, mlx_lm.server through `mlx_probe` replaced by the same. The memory
figures are the memory models' (llama.cpp's own for the GGUF), which decide what is started."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import cli
import search.study.engines as engines
from search.runner_mlx import served_probe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    """One tiny qwen3 in both formats: the same layers, widths, heads and vocabulary."""
    pytest.importorskip("mlx_lm")
    from tests.mlxlm.synth import build as build_mlx
    from tests.synth import build as build_gguf

    gguf = build_gguf("qwen3", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=768, n_vocab=1024,
                      ftype="q8_0")
    return str(gguf), str(build_mlx("qwen3", 8))


def _fake_cmd(port: int) -> list[str]:
    return [sys.executable, "-m", "tests.search.fake_openai", str(port)]


@pytest.fixture
def fake_servers(tmp_path, monkeypatch) -> str:
    """A stand-in llama-server (the fake OpenAI server on the --port it is given); mlx_lm.server the same."""
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.path.insert(0, {str(REPO)!r})\n"
                   "port = sys.argv[sys.argv.index('--port') + 1]\nsys.argv = ['fake_openai', port]\n"
                   "runpy.run_module('tests.search.fake_openai', run_name='__main__')\n")
    exe.chmod(0o755)
    monkeypatch.setattr(engines, "mlx_probe", lambda mlx_dir, flags, probe, timeout: served_probe(
        _fake_cmd, probe, timeout, "mlx_lm.server"))
    return str(exe)


def test_progress_lines_and_a_table(pair, fake_servers, capfd):
    gguf, mlx_dir = pair
    with pytest.raises(SystemExit) as e:
        cli.main(["compare-engines", gguf, mlx_dir, "--budget", "4GiB", "--margin", "512MiB", "--trials", "3",
                  "--prompt-tokens", "16", "--gen-tokens", "4", "--llama-server", fake_servers])
    out, err = capfd.readouterr()
    assert e.value.code == 0, err
    assert "A new study created" not in err and "Traceback" not in err
    first, *lines = err.strip().splitlines()
    assert first.startswith("[ggfit] predicted before any probe (")  # the speed model's MLX / llama.cpp ratio
    assert lines[0].startswith("[ggfit] trial 1 of 3: llama.cpp -ub 512: starting llama-server (predicted ")
    assert lines[1].startswith("[ggfit] trial 1 of 3: llama.cpp -ub 512: ok: decode ")
    assert lines[2].startswith("[ggfit] trial 2 of 3: MLX --prefill-step-size 2048: starting mlx_lm.server")
    assert len(lines) == 6, err  # a start and an end line per trial
    assert "{" not in out and "}" not in out, out  # no Python dicts
    table = out.splitlines()
    assert table[0].split() == ["#", "engine", "flags", "status", "predicted", "MiB", "decode", "tok/s", "prefill",
                                "tok/s", "peak", "RSS", "MiB"]
    assert table[1].split()[:5] == ["0", "llama.cpp", "-ub", "512", "ok"]
    assert any(re.match(r"best MLX: trial \d+, --prefill-step-size \d+( --kv-bits \d)?: decode [\d.]+ tok/s, "
                        r"predicted [\d.]+ MiB, peak RSS [\d.]+ MiB$", ln) for ln in table), out
    assert any(ln.startswith("winner: ") for ln in table)


def test_ctrl_c_is_one_line(pair, fake_servers, monkeypatch, capfd):
    """Ctrl-C during a trial: `ggfit: interrupted`, exit 130, no Optuna warning with a 28-line traceback."""
    gguf, mlx_dir = pair

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(engines, "mlx_probe", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["compare-engines", gguf, mlx_dir, "--budget", "4GiB", "--margin", "512MiB", "--trials", "3",
                  "--prompt-tokens", "16", "--gen-tokens", "4", "--llama-server", fake_servers])
    _, err = capfd.readouterr()
    assert e.value.code == 130
    assert "Traceback" not in err and "failed with" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "ggfit: interrupted"


def test_not_the_same_model_is_refused(pair, gemma, fake_servers, capfd):
    """Gemma 3 270M's GGUF against the qwen3 MLX directory: one line naming what differs, exit 2, nothing started."""
    _, mlx_dir = pair
    with pytest.raises(SystemExit) as e:
        cli.main(["compare-engines", gemma, mlx_dir, "--budget", "4GiB", "--llama-server", fake_servers])
    out, err = capfd.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"ggfit: error: gemma-3-270m-q4_k_m.gguf and {mlx_dir} are not the same model (architecture gemma3 vs "
        "qwen3, n_layer 18 vs 4, n_embd 640 vs 256, n_head_kv 1 vs 2, n_vocab 262144 vs 1024): compare-engines "
        "needs one model in both formats"], err


def test_another_vocabulary_is_refused(pair, tmp_path, fake_servers, capfd):
    from tests.synth import build as build_gguf

    _, mlx_dir = pair
    other = build_gguf("qwen3", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=768, ftype="q8_0")
    with pytest.raises(SystemExit) as e:
        cli.main(["compare-engines", str(other), mlx_dir, "--budget", "4GiB", "--llama-server", fake_servers])
    _, err = capfd.readouterr()
    assert e.value.code == 2 and "(n_vocab 512 vs 1024)" in err, err
