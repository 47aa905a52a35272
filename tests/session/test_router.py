"""fitter.session.router and `ggfit router`: llama-server's --models-preset format, and which models fit together,
against a router run recorded here (benchmarks/router_here.py -> benchmarks/results/router-cpu-here.json: three
models, ggfit's --models-max 2, the third load evicting the least recently used one as the pinned build does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cli
from benchmarks.router_here import BUDGET_MIB, write_preset
from fitter.session.router import PresetError, Resident, largest_group, models_max, read_preset

REC = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "router-cpu-here.json"
MIB = 2**20


def test_preset_keys_are_read_as_llama_server_reads_them(tmp_path):
    p = tmp_path / "p.ini"
    p.write_text("version = 1\n[*]\nc = 8192\nno-repack = true\nLLAMA_ARG_CACHE_RAM = 0\n\n"
                 "[a]\nmodel = /m/a.gguf\nctx-size = 4096\nkv-unified = false\nload-on-startup = true\n"
                 "[b]\nm = /m/b.gguf\nno-cache-idle-slots = true\n")
    a, b = read_preset(p)
    assert a.model == "/m/a.gguf" and a.load_on_startup and not b.load_on_startup
    assert a.args == ["-c", "8192", "--no-repack", "--cache-ram", "0", "--ctx-size", "4096",
                      "--no-kv-unified"]
    assert "--no-cache-idle-slots" in b.args
    p.write_text("[x]\nc = 1\n")
    with pytest.raises(PresetError, match="no model path"):
        read_preset(p)


def test_a_session_flag_that_is_not_a_number_is_one_line(tmp_path, capsys):
    from fitter.bundled import resolve_model

    p = tmp_path / "p.ini"
    p.write_text(f"[m]\nmodel = {resolve_model('gemma3-270m')}\ncache-ram = lots\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["router", "--models-preset", str(p), "--budget", "2GiB"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--cache-ram lots: use a whole number" in err and "Traceback" not in err


def test_models_max_counts_the_largest_together():
    ms = [Resident(name=n, load_bytes=b, session_bytes=0, process_bytes=0) for n, b in (("a", 5), ("b", 4), ("c", 2))]
    assert models_max(ms, 9) == 2 and models_max(ms, 4) == 0 and models_max(ms, 11) == 3
    assert largest_group(ms, 7) == ["a", "c"] and largest_group(ms, 9) == ["a", "b"]


@pytest.mark.skipif(not REC.exists(), reason="no router recording")
def test_the_recorded_router_loads_the_predicted_pair_and_evicts_the_third(tmp_path, capfd):
    doc = json.loads(REC.read_text())
    assert doc["build"]["ggml_commit"].startswith("0c1e570")
    preset = tmp_path / "preset.ini"
    write_preset(preset)
    with pytest.raises(SystemExit):
        cli.main(["router", "--models-preset", str(preset), "--budget", f"{BUDGET_MIB}MiB", "--backend", "cpu",
                  "--json"])
    pred = json.loads(capfd.readouterr().out)
    assert pred["models_max_fits"] == 2 == int(doc["command"][doc["command"].index("--models-max") + 1])
    assert pred["largest_group"] == ["sgemma", "sqwen"]
    first, second, third = doc["steps"]
    assert set(second["children"]) == {"sgemma", "sqwen"}  # the predicted pair is resident together
    assert set(third["children"]) == {"sqwen", "sllama"}  # the third evicts the least recently used
    assert any("removing LRU name=sgemma" in ln for ln in doc["log"])
    by = {m["name"]: m for m in pred["models"]}
    for step in doc["steps"]:
        for name, mem in step["children"].items():
            assert mem["VmRSS"] <= by[name]["bytes"]  # within its predicted share of the budget
            assert abs(mem["VmRSS"] - by[name]["load_bytes"]) <= 64 * MIB  # the load itself
