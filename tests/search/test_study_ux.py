"""`ggfit optimise` as a user meets it (issue 49): a budget the weights alone exceed, a space without the configs
llama.cpp refuses, several workers agreeing on the study's best.

No probe runs llama.cpp here: the probe is replaced (run_study's `probe` hook) by one that answers from the config,
so these tests check what the study decides and says, not any timing. The memory model's figures are llama.cpp's
(Gemma 3 270M Q4_K_M's weights on the CPU: its mapped file range, 235.16 MiB, llama.cpp's "file size"; exact to the
byte in `tests/llama/test_memory_exact.py`).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
from optuna.trial import TrialState  # noqa: E402

from fitter.llama.cparams import Backend, ConfigError, Frontend  # noqa: E402
from search.probe import ProbeResult  # noqa: E402
from search.space import SearchSpace, SpaceDef, StudyError  # noqa: E402
from search.study import NothingFits, Predictor, load_study, run_study  # noqa: E402
from search.study.storage import _worker  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20

SMALL = """
name = "ux-test"
objectives = ["prefill_tps"]
trials = 4

[workload]
prompt_tokens = 32
gen_tokens = 4
repeats = 1
warmup = 0

[space]
n_ctx = [2048]
n_ubatch = [64, 128, 256, 512]
threads = [1]
type_k = ["f16", "q8_0"]
flash_attn = ["on", "off"]

[sampler]
n_startup_trials = 2
"""


def _fake_probe(rate=lambda config: 100.0 + (config.n_ubatch or 512) / 8):
    """A probe that answers at once: prefill tok/s from the config (larger ubatches faster)."""
    calls: list = []

    def probe(model_path, config, workload, **kw):
        calls.append(config)
        v = rate(config)
        return ProbeResult(status="ok", runner="python", model_path=str(model_path), config=config, workload=workload,
                           prefill_tps=v, decode_tps=10.0, ttft_s=0.1)

    probe.calls = calls  # type: ignore[attr-defined]
    return probe


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# --- 1. a budget the weights alone exceed ----------------------------------------------------------------------


def test_weights_over_the_budget_stop_at_once(tmp_path, gemma):
    """Gemma 3 270M Q4_K_M's weights are 235.16 MiB: with 200 - 100 MiB nothing can fit. `optimise` says so in one
    line and exits 1, and writes no study (it wrote 300 skipped trials)."""
    db = tmp_path / "s.db"
    r = subprocess.run([sys.executable, "cli.py", "optimise", gemma, "--budget", "200MiB", "--margin", "100MiB",
                        "--storage", f"sqlite:///{db}"], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "ggfit: nothing to search: the weights of gemma-3-270m-q4_k_m.gguf alone are 235 MiB, the budget minus "
        "margin 100 MiB (200 - 100 MiB); no trial was run"], r.stderr
    assert not db.exists() or not optuna.get_all_study_names(f"sqlite:///{db}")


def test_the_check_is_on_the_weights_alone(gemma):
    """235 MiB available: under the weights, refused. 236 MiB: the weights fit, so the study runs (and its trials are
    skipped one by one, as the KV cache and compute buffers do not fit: the check guesses nothing beyond weights)."""
    d = load_study("prefill").model_copy(update={"trials": 1, "max_trials": 3})
    with pytest.raises(NothingFits, match="alone are 235 MiB, the budget minus margin 235 MiB"):
        run_study(gemma, d, budget=335 * MiB, margin=100 * MiB, storage=optuna.storages.InMemoryStorage(),
                  probe=_fake_probe(), progress=None, compare_defaults=False)
    res = run_study(gemma, d, budget=336 * MiB, margin=100 * MiB, storage=optuna.storages.InMemoryStorage(),
                    probe=_fake_probe(), progress=None, compare_defaults=False)
    assert res.n_probed == 0 and res.counts.skipped == 3, res.counts.text()


# --- 2. the space never offers what llama.cpp refuses -------------------------------------------------------------


def test_prefill_space_never_proposes_quantized_v_without_flash_attention(gemma):
    """llama_init_from_model refuses a quantized V cache with -fa off. The built-in prefill study (K = V in f16, q8_0,
    q4_0; -fa on, off) proposed it in 206 of 300 trials; the space now never does, and still searches -fa off with
    f16 and every K/V type with -fa on."""
    d = load_study("prefill")
    sp = SearchSpace(d.space, models=[gemma], n_ctx_train=32768, ctx_need=2056)
    assert any("-fa off is not proposed with a quantized V cache (q8_0, q4_0)" in n for n in sp.notes), sp.notes
    assert sp.conditional
    pred = Predictor(Backend.CPU, Frontend.SERVER)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen: collections.Counter = collections.Counter()
    for i in range(80):
        t = study.ask()
        cand = sp.candidate(sp.suggest(t))
        pred.predict(cand)  # no ConfigError: llama.cpp would take every proposal
        seen[(cand.config.type_v, cand.config.flash_attn)] += 1
        study.tell(t, float(i))
    assert not [k for k in seen if k[0] != "f16" and k[1] == "off"]
    assert {("f16", "off"), ("f16", "on"), ("q8_0", "on"), ("q4_0", "on")} <= set(seen), seen
    grid = [sp.candidate(p).config for p in sp.grid()]
    assert not [c for c in grid if c.type_v != "f16" and c.flash_attn == "off"]
    assert len({(c.type_v, c.flash_attn) for c in grid}) == 4


def test_quantized_v_keeps_the_other_flash_attention_values(gemma):
    """With -fa on, off and auto, a quantized V chooses between on and auto (a conditional parameter); a study whose
    only -fa is off leaves its quantized V types out, and one with nothing else is refused in one line."""
    sp = SearchSpace(SpaceDef(type_k=["f16", "q4_0"], type_v=["f16", "q8_0"], flash_attn=["on", "off", "auto"]),
                     models=[gemma], n_ctx_train=32768, ctx_need=100)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(60):
        t = study.ask()
        c = sp.candidate(sp.suggest(t)).config
        seen.add((c.type_v, c.flash_attn))
        study.tell(t, 1.0)
    assert seen == {("f16", "on"), ("f16", "off"), ("f16", "auto"), ("q8_0", "on"), ("q8_0", "auto")}
    assert "flash_attn_qv (with a quantized V, instead of flash_attn): on, auto" in sp.describe()
    off = SearchSpace(SpaceDef(type_k=["f16", "q8_0"], flash_attn=["off"]), models=[gemma], n_ctx_train=32768,
                      ctx_need=100)
    assert off.dims.get("kv_type") is None and off.consts["kv_type"] == "f16"
    assert any("V cache types q8_0 left out" in n for n in off.notes)
    with pytest.raises(StudyError, match="every V cache type .q8_0. is quantized and flash_attn is only off"):
        SearchSpace(SpaceDef(type_k=["q8_0"], flash_attn=["off"]), models=[gemma], n_ctx_train=32768, ctx_need=100)
    with pytest.raises(ConfigError, match="with -fa off"):  # what the space leaves out is what llama.cpp refuses
        Predictor(Backend.CPU, Frontend.SERVER).predict(
            sp.candidate({"type_k": "f16", "type_v": "q8_0", "flash_attn": "off"}))


def test_prefill_study_trials_are_never_invalid(gemma):
    """A whole study with the named prefill space: no trial is `invalid` (llama.cpp refuses nothing it proposes)."""
    d = load_study("prefill").model_copy(update={"trials": 30})
    res = run_study(gemma, d, budget=4096 * MiB, margin=256 * MiB, storage=optuna.storages.InMemoryStorage(),
                    probe=_fake_probe(), progress=None, compare_defaults=False, seed=5)
    assert res.n_invalid == 0 and res.n_probed == 30, res.counts.text()


# --- 3. several workers on one storage agree on the study's best --------------------------------------------------


def _other_worker_running(url: str, name: str) -> None:
    """A trial another live worker (this process, as far as the liveness check goes) is running right now."""
    t = optuna.load_study(study_name=name, storage=url).ask()
    for k, v in {"worker": _worker(), "key": "another config", "probing": True, "status": "running",
                 "flags": "-ub 64"}.items():
        t.set_user_attr(k, v)


def test_a_worker_ending_while_another_runs_says_so_and_agrees_with_report(tmp_path, gemma):
    from search.report import report

    d = load_study(_write(tmp_path, SMALL))
    url = f"sqlite:///{tmp_path / 'w.db'}"
    name = "two-workers"
    optuna.create_study(study_name=name, storage=url, direction="maximize")
    _other_worker_running(url, name)
    res = run_study(gemma, d, budget="2GiB", storage=url, name=name, n_trials=2, compare_defaults=False,
                    probe=_fake_probe(), progress=None, seed=1)
    assert res.running_elsewhere and res.running_elsewhere[0].startswith("#0 (worker ")
    text = res.text()
    assert f"best so far: trial {res.best.number}: " in text
    line = next(ln for ln in text.splitlines() if ln.startswith("another worker is still running"))
    assert line == (f"another worker is still running trial {res.running_elsewhere[0]}: the study's best may still "
                    f"change (ggfit report {name} shows it as it stands)")
    rep = report(name, storage=url, echo=None)
    best_line = next(ln for ln in rep.summary if ln.startswith("best"))
    assert best_line.startswith(f"best so far: trial {res.best.number}: "), rep.summary
    assert line in rep.summary


def test_the_ending_shows_the_best_found_while_this_worker_compared(gemma):
    """Worker A compares its best with llama.cpp's defaults (probes that take a while); worker B finishes a better
    trial meanwhile. A's ending names B's trial as the study's best, as `report` does, and says which trial its
    comparison was of."""
    from optuna.trial import create_trial

    from search.report import report

    storage = optuna.storages.InMemoryStorage()
    d = load_study("prefill").model_copy(update={"trials": 2})
    fake = _fake_probe()
    added: list[int] = []

    def probe(model_path, config, workload, **kw):
        if len(fake.calls) >= 2 and not added:  # the search is over: this is the comparison; B ends a better trial
            study = optuna.load_study(study_name="ab", storage=storage)
            t0 = study.trials[0]
            study.add_trial(create_trial(state=TrialState.COMPLETE, value=10_000.0, params={**t0.params, "n_ubatch": 4096},
                                         distributions=t0.distributions, constraints={"invalid": 0.0},
                                         user_attrs={"status": "ok", "probed": True, "prefill_tps": 10_000.0,
                                                     "flags": "-ub 4096", "worker": {"host": "b", "pid": 1}}))
            added.append(len(study.trials) - 1)
        return fake(model_path, config, workload, **kw)

    res = run_study(gemma, d, budget=4096 * MiB, margin=256 * MiB, storage=storage, probe=probe, progress=None,
                    seed=2, name="ab", enqueue_defaults=False)
    assert added and res.best.number == added[0]
    assert res.verdict.startswith("trial #") and "(the best when this worker ended its search)" in res.verdict
    assert f"trial #{added[0]} became the study's best while trial #" in "\n".join(res.notes)
    rep = report(optuna.load_study(study_name="ab", storage=storage), echo=None)
    assert any(ln.startswith(f"best: trial {added[0]}: ") for ln in rep.summary), rep.summary


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "study.toml"
    p.write_text(text)
    return p
