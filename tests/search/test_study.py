"""`ggfit optimise`: Optuna studies over predicted-feasible configs, proven by real probes (search.study/space/report).

Real llama.cpp everywhere (no mocks): Gemma 3 270M Q4_K_M for the prefill study and the resume test, synthetic
random-weight GGUFs (qwen3moe in two quantisations, a qwen3 draft with the same vocabulary) for the quant and
speculative parameters and for the two-worker PostgreSQL test. Probes use one thread and tiny workloads; the
20-trial Gemma study takes ~1.5-2 min on 2 busy cores, the whole file ~4 min. The PostgreSQL test starts its own
server (initdb + pg_ctl, as the ``postgres`` user when run as root) and skips with the reason when it cannot.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fitter.errors import GGFitError
from fitter.llama.cparams import Backend, ConfigError, Frontend
from fitter.progress import Progress
from search.space import SearchSpace, SpaceDef, StudyError
from search.study import (
    LengthDistribution,
    Predictor,
    PromptLengths,
    load_study,
    named_studies,
    run_study,
    study_name,
)

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20

# The test version of the named prefill study: a space where the budget below rules out large contexts with an f16
# KV cache and large ubatches without flash attention (the space never proposes a quantized V without flash attention).
TINY_PREFILL = """
name = "prefill-test"
description = "prefill at a 64-token prompt, 1 thread"
objectives = ["prefill_tps"]
trials = 20

[workload]
prompt_tokens = 64
gen_tokens = 8
repeats = 2
warmup = 1

[space]
n_ctx = [2048, 8192, 32768]
n_ubatch = [32, 64, 128, 256, 512]
n_batch_factor = [1, 4]
threads = [1]
type_k = ["f16", "q8_0", "q4_0"]
type_v = "same"
flash_attn = ["on", "off"]
"""
# Budget for Gemma 270M: 512 MiB enforced on the probe, 160 MiB margin -> 352 MiB for the prediction. The margin
# covers what a probe's address space holds beyond llama.cpp's buffers (~80-130 MiB measured: thread stacks, allocator).
GEMMA_BUDGET, GEMMA_MARGIN = 512 * MiB, 160 * MiB

TINY_RESUME = """
name = "resume-test"
objectives = ["prefill_tps"]
trials = 7

[workload]
prompt_tokens = 32
gen_tokens = 4
repeats = 1
warmup = 0

[space]
n_ctx = [2048]
n_ubatch = [16, 32, 64, 128, 256, 512]
n_batch_factor = [1, 2]
threads = [1]
type_k = ["f16", "q8_0"]
flash_attn = ["on"]

[sampler]
n_startup_trials = 4
"""


@pytest.fixture(scope="session")
def moe_quants() -> list[str]:
    from tests.synth import build

    return [str(build("qwen3moe")), str(build("qwen3moe", ftype="q8_0"))]


@pytest.fixture(scope="session")
def qwen3_draft() -> str:
    from tests.synth import build

    return str(build("qwen3"))  # the same synthetic vocabulary as qwen3moe: a valid draft model


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _write(tmp_path: Path, text: str, name: str = "study.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _probed(study) -> list:
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("probed")]


def _load(name: str, url: str):
    import optuna

    return optuna.load_study(study_name=name, storage=url)


# --- study files (no llama.cpp) ----------------------------------------------------------------------------------


def test_named_studies_parse():
    assert {"prefill", "decode", "balanced", "long-context", "speculative"} <= set(named_studies())
    for n in named_studies():
        d = load_study(n)
        assert d.name == n and d.trials >= 1 and d.objectives
    assert load_study("balanced").directions == ["maximize", "maximize"]
    lc = load_study("long-context")
    assert lc.pick.require == {"served_share": 0.99} and lc.prompt_lengths.quantiles["p99"] == 103000
    assert load_study("speculative").space.draft is not None


@pytest.mark.parametrize("text, expect", [
    (TINY_PREFILL + "\nbogus = 1\n", "bogus: unknown key"),
    (TINY_PREFILL.replace("[space]", "[space]\nn_gpu = [1]"), "space.n_gpu: unknown key"),
    (TINY_PREFILL.replace('objectives = ["prefill_tps"]', 'objectives = ["speed"]'), "objectives.0"),
    (TINY_PREFILL.replace("n_batch_factor = [1, 4]", "n_batch_factor = [0]"), "n_batch_factor"),
    (TINY_PREFILL.replace('type_k = ["f16", "q8_0", "q4_0"]', 'type_k = ["q3_k"]'), "space.type_k.0"),
    (TINY_PREFILL + "\n[fixed]\nn_ubatch = 64\n", "belongs in [space]"),
    (TINY_PREFILL + "\n[fixed]\nthreads = 2\n", "unknown RunConfig field 'threads'"),
    (TINY_PREFILL + "\n[pick]\nrequire = { served_share = 0.9 }\n", "served_share needs [prompt_lengths]"),
    ("name = 'x'\nobjectives = ['prefill_tps']\ntrials = 0\n", "trials: Input should be greater than or equal to 1"),
    ("this is = not toml [", "not a TOML file"),
])
def test_bad_study_file_is_one_line(tmp_path, text, expect):
    with pytest.raises(StudyError) as e:
        load_study(_write(tmp_path, text))
    msg = str(e.value)
    assert expect in msg and "\n" not in msg, msg
    assert isinstance(e.value, GGFitError)


def test_unknown_study_names_the_known_ones(tmp_path):
    with pytest.raises(StudyError, match="no study named 'fastest'.*prefill"):
        load_study("fastest")
    with pytest.raises(StudyError, match="does not exist"):
        load_study(tmp_path / "missing.toml")


def test_prompt_length_distribution(tmp_path):
    d = LengthDistribution(PromptLengths(quantiles={"p50": 1000, "p90": 20000, "p99": 103000}))
    assert d.share(1000) == pytest.approx(0.5)
    assert d.share(103000) == pytest.approx(0.99)
    assert 0.5 < d.share(10000) < 0.9
    assert d.share(10**7) == pytest.approx(0.99)  # beyond the largest known quantile: at least that share
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(str(x) for x in range(1, 101)))
    e = LengthDistribution(PromptLengths(file=str(f)))
    assert e.share(95) == pytest.approx(0.95)


def test_space_refuses_an_invalid_config_in_one_line(gemma):
    sp = SearchSpace(load_study("prefill").space, models=[gemma], n_ctx_train=32768, ctx_need=2056)
    with pytest.raises(StudyError, match=r"^\[fixed\] or space gives an invalid config: -ctk q9: unsupported"):
        sp.candidate({**sp.grid()[0], "kv_type": "q9"})


def test_space_keeps_batch_over_ubatch_and_is_deterministic(gemma):
    d = load_study("prefill")
    sp = SearchSpace(d.space, models=[gemma], n_ctx_train=32768, ctx_need=2056)
    grid = sp.grid()
    # -fa on and off with an f16 V, on alone with q8_0 and q4_0 (llama.cpp refuses a quantized V without it)
    assert len(grid) == 7 * 3 * (2 + 1 + 1) * (os.cpu_count() or 1)
    for p in grid:
        c = sp.candidate(p)
        assert c.config.n_batch >= c.config.n_ubatch and c.config.n_ctx == 8192
        assert c.config.type_k == c.config.type_v
        assert sp.candidate(p).key() == c.key()
    cmd = sp.candidate(grid[0]).command()
    assert cmd.startswith("llama-server \\\n  -m ") and "\n  -c 8192 \\\n" in cmd and cmd.endswith("-fit off")


def test_space_refuses_what_cannot_run(gemma, qwen3_draft):
    with pytest.raises(StudyError, match="below the 9000 tokens"):
        SearchSpace(SpaceDef(n_ctx=[2048, 8192]), models=[gemma], n_ctx_train=32768, ctx_need=9000)
    spec = load_study("speculative")
    with pytest.raises(StudyError, match="no drafter is left"):
        SearchSpace(spec.space.model_copy(update={"draft": spec.space.draft.model_copy(update={"kinds": ["model"]})}),
                    models=[gemma], n_ctx_train=32768, ctx_need=512)
    sp = SearchSpace(spec.space, models=[gemma], n_ctx_train=32768, ctx_need=512, drafts=[qwen3_draft])
    notes = sp.notes
    assert sp.dims["draft"] == ["none", Path(qwen3_draft).name]
    assert any("mtp" in n for n in notes)


def test_study_name_is_stable_and_distinct(gemma):
    d = load_study("prefill")
    kw = dict(budget_bytes=8 * 2**30, margin_bytes=2**30, backend=Backend.CPU, runner="python")
    a = study_name(d, [gemma], **kw)
    assert a == study_name(d, [gemma], **kw) and a.startswith("prefill-gemma-3-270m")
    assert a != study_name(d, [gemma], **{**kw, "budget_bytes": 4 * 2**30})
    assert a != study_name(d.model_copy(update={"trials": 31}), [gemma], **kw)
    assert a != study_name(d, [gemma], **{**kw, "runner": "server"})


def test_bad_arguments(tmp_path, gemma, moe_quants):
    d = load_study(_write(tmp_path, TINY_PREFILL))
    url = f"sqlite:///{tmp_path / 's.db'}"
    with pytest.raises(GGFitError, match="--budget"):
        run_study(gemma, d, budget="lots", storage=url, progress=None)
    with pytest.raises(GGFitError, match="leaves nothing"):
        run_study(gemma, d, budget="100MiB", margin="200MiB", storage=url, progress=None)
    with pytest.raises(StudyError, match="not the same model"):
        run_study([gemma, moe_quants[0]], d, budget="4GiB", storage=url, progress=None)
    with pytest.raises(StudyError, match="--storage"):
        run_study(gemma, d, budget="4GiB", storage="postgresql://nobody@127.0.0.1:1/none", progress=None)


# --- real studies -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_prefill_study_gemma(tmp_path, gemma):
    """20 probes on Gemma 270M under a budget that rules out part of the space; no predicted-infeasible config is
    probed; OOMs are model misses; the best config is compared against llama.cpp's defaults."""
    d = load_study(_write(tmp_path, TINY_PREFILL))
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    lines: list[str] = []

    # the budget really rules out part of the space (before any probe)
    pred = Predictor(Backend.CPU, Frontend.SERVER)
    sp = SearchSpace(d.space, models=[gemma], n_ctx_train=32768, ctx_need=72)
    over = []
    for p in sp.grid():
        try:
            over.append(pred.predict(sp.candidate(p)).total_device_bytes > GEMMA_BUDGET - GEMMA_MARGIN)
        except ConfigError:
            pass
    assert 0 < sum(over) < len(over)
    big_f16 = sp.candidate({**sp.grid()[0], "n_ctx": 32768, "kv_type": "f16", "n_ubatch": 512, "flash_attn": "on"})
    assert pred.predict(big_f16).total_device_bytes > GEMMA_BUDGET - GEMMA_MARGIN

    live_out = io.StringIO()
    live = Progress("optimise", stream=live_out, mode="lines")
    res = run_study(gemma, d, budget=GEMMA_BUDGET, margin=GEMMA_MARGIN, storage=url, seed=1, progress=lines.append,
                    live=live)
    print(res.text())
    study = _load(res.study_name, url)
    trials = study.get_trials(deepcopy=False)
    probed = _probed(study)
    assert res.n_probed == len(probed) == 20 == res.counts.probes  # --trials 20: exactly 20 probes of the search
    assert res.counts.total == len(trials) and f"{len(trials)} trials: " in res.text()
    assert len(lines) >= len(trials) and all(ln.startswith("[ggfit]") for ln in lines)
    # live progress: each probe as it starts (n of N, its flags, the best so far), then the comparison
    shown = live_out.getvalue().splitlines()
    starts = [ln for ln in shown if " probing -c " in ln]
    assert len(starts) == 20 and all(ln.startswith("ggfit optimise: [") for ln in shown)
    assert "1/20 trial 1 of 20 (#0), best so far -: probing -c " in starts[0]
    assert "20/20 trial 20 of 20 " in starts[-1] and re.search(r"best so far \d+\.\d tok/s \(#\d+\): probing", starts[-1])
    skipped = [ln for ln in lines if "skipped (predicted over budget)" in ln]
    assert len(skipped) == sum(t.user_attrs.get("status") == "skipped" for t in trials)
    # feasibility first: nothing predicted over the budget (or invalid) was probed, and the sampler was told
    for t in trials:
        ua = t.user_attrs
        if ua.get("status") in ("skipped", "invalid"):
            assert not ua.get("probed") and t.state.name == "PRUNED"
            assert any(v > 0 for v in t.constraints.values()), t.constraints
        if ua.get("probed"):
            assert ua["predicted_fits"] is True and ua["predicted_bytes"] <= GEMMA_BUDGET - GEMMA_MARGIN
    # OOMs: none, or each one a listed model miss (PRUNED + infeasible so TPE stops proposing it)
    ooms = [t.number for t in probed if t.user_attrs["status"] == "oom"]
    assert res.model_misses == ooms
    for t in probed:
        if t.user_attrs["status"] == "oom":
            assert t.user_attrs["model_miss"] and t.state.name == "PRUNED" and t.constraints["probe_failed"] > 0
    # the best config, as a command, as JSON, and against llama.cpp's defaults
    assert res.best is not None and res.best.status == "ok"
    assert res.command.startswith("llama-server \\") and " -c " in res.command and "-t 1" in res.command
    assert res.config["n_ctx"] in (2048, 8192, 32768) and res.config["threads"] == 1
    assert res.baseline is not None
    if res.baseline.status == "ok":
        assert res.best_measured.status == "ok" and res.ratio["prefill_tps"] > 0 and res.compare_probes == 2
        # better, worse, or a tie when the difference is inside the measured spreads (repeats = 2 runs each)
        assert ("beats llama.cpp's defaults" in res.verdict) == (res.outcome["prefill_tps"] == "better")
        assert (res.outcome["prefill_tps"] == "tie") == ("ties llama.cpp's defaults" in res.verdict)
        assert f"({res.ratio['prefill_tps']:.2f}x" in res.verdict and " ± " in res.verdict
        assert "2 more comparing with llama.cpp's defaults" in res.text()
        assert any("comparing with llama.cpp's defaults" in ln for ln in shown)
    elif res.baseline.status == "same config":  # the best config is llama.cpp's defaults: nothing to compare
        assert "llama.cpp's defaults' own run" in res.verdict and res.compare_probes == 0
    else:
        assert "not measured" in res.verdict
    assert study.user_attrs["final"]["verdict"] == res.verdict

    # resuming a finished study probes nothing more
    again = run_study(gemma, d, budget=GEMMA_BUDGET, margin=GEMMA_MARGIN, storage=url, compare_defaults=False,
                      progress=lines.append)
    assert again.n_probed == 20 and again.study_name == res.study_name and "nothing to run" in lines[-1]

    # the report: table, summary, plots
    from search.report import report

    out = tmp_path / "report"
    rep = report(res.study_name, storage=url, out=out, echo=None)
    assert "model misses" in "\n".join(rep.summary) and rep.summary[-1] == res.verdict
    assert len(rep.table.splitlines()) == len(trials) + 1
    for stem in ("history", "importances", "memory"):
        for ext, module in (("html", "plotly"), ("png", "matplotlib")):
            if not _has(module):
                assert any(f"pip install {module}" in n for n in rep.notes)
                continue
            if stem == "importances" and not (out / f"{stem}.{ext}").exists():
                continue  # optuna may decline importances for a degenerate study; the note says why
            assert (out / f"{stem}.{ext}").stat().st_size > 1000, (stem, ext, rep.notes)
    assert (out / "trials.csv").read_text().count("\n") == len(trials) + 1
    with pytest.raises(StudyError, match="no study 'nope'"):
        report("nope", storage=url, echo=None)


@pytest.mark.slow
def test_quant_and_draft_search_on_synthetic_moe(tmp_path, moe_quants, qwen3_draft):
    """The quant parameter (two GGUF files of one MoE) and draft choice / n_max / p_min (a draft of the same vocab)."""
    text = """
name = "spec-test"
objectives = ["decode_tps"]
trials = 10

[workload]
kind = "code"
prompt_tokens = 32
gen_tokens = 16
repeats = 1
warmup = 0

[space]
n_ctx = [1024]
n_ubatch = [64]
threads = [1]
flash_attn = ["on"]

[space.draft]
kinds = ["none", "model", "mtp"]
n_max = { low = 1, high = 4 }
p_min = [0.0, 0.5]

[sampler]
n_startup_trials = 5
"""
    d = load_study(_write(tmp_path, text))
    url = f"sqlite:///{tmp_path / 'moe.db'}"
    res = run_study(moe_quants, d, budget="2GiB", margin="256MiB", storage=url, drafts=[qwen3_draft], seed=3,
                    compare_defaults=False, progress=None)
    study = _load(res.study_name, url)
    trials = study.get_trials(deepcopy=False)
    assert res.n_probed == 10 and any("mtp" in n for n in res.notes)  # no MTP head: left out, with the reason
    quants = {t.params.get("quant") for t in trials}
    assert quants == {Path(q).name for q in moe_quants}
    drafted = [t for t in _probed(study) if t.params.get("draft", "none") != "none"]
    assert drafted and all("draft_n_max" in t.params and "draft_p_min" in t.params for t in drafted)
    for t in drafted:
        assert t.user_attrs["config"]["spec_type"] == "draft-simple"
        assert "acceptance" in t.user_attrs or t.user_attrs["status"] != "ok"
    assert res.best is not None and res.config["model"] in moe_quants


@pytest.mark.slow
def test_long_context_pareto_and_served_share(tmp_path, moe_quants):
    """Two objectives (served share, decode): a Pareto front, the pick rule, the share of requests served, plots."""
    text = """
name = "lc-test"
objectives = ["served_share", "decode_tps"]
trials = 8

[prompt_lengths]
quantiles = { p50 = 300, p90 = 1500, p99 = 3800 }

[workload]
prompt_tokens = 32
gen_tokens = 8
repeats = 1
warmup = 0

[space]
n_ubatch = [32, 64, 128]
threads = [1]
type_k = ["f16", "q8_0"]
flash_attn = ["on"]

[pick]
require = { served_share = 0.99 }
"""
    d = load_study(_write(tmp_path, text))
    url = f"sqlite:///{tmp_path / 'lc.db'}"
    res = run_study(moe_quants[0], d, budget="2GiB", margin="256MiB", storage=url, seed=5, compare_defaults=False,
                    progress=None)
    assert res.n_probed == 8 and res.pareto and res.best is not None
    assert res.served_share is not None and abs(res.best.metrics["served_share"] - res.served_share) < 1e-9
    study = _load(res.study_name, url)
    ctxs = {t.params.get("n_ctx") for t in study.get_trials(deepcopy=False)}
    assert ctxs <= {512, 1536, 3840}
    if any(t.user_attrs.get("config", {}).get("n_ctx") == 3840 and t.user_attrs.get("status") == "ok"
           for t in study.get_trials(deepcopy=False)):
        assert res.config["n_ctx"] == 3840 and res.served_share == pytest.approx(0.99)
    assert "serves" in res.text()
    from search.report import report

    rep = report(res.study_name, storage=url, out=tmp_path / "lc-report", echo=None)
    assert any(line.startswith("Pareto front: trials") for line in rep.summary)
    if _has("plotly"):
        assert (tmp_path / "lc-report" / "pareto.html").exists(), rep.notes
    if _has("matplotlib"):
        assert (tmp_path / "lc-report" / "pareto.png").exists(), rep.notes


# --- resume after SIGKILL ----------------------------------------------------------------------------------------


def _worker_cmd(model: str, study_file: Path, url: str, name: str, budget: str, seed: int) -> list[str]:
    args = json.dumps({"model": model, "study": str(study_file), "storage": url, "name": name, "budget": budget,
                       "seed": seed})
    return [sys.executable, str(Path(__file__).resolve()), args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path, gemma):
    """Kill ggfit (SIGKILL) mid-trial, restart: no completed trial is lost, the running one is failed and retried."""
    import optuna
    from optuna.trial import TrialState

    sfile = _write(tmp_path, TINY_RESUME)
    url = f"sqlite:///{tmp_path / 'resume.db'}"
    name = "resume-test"
    proc = subprocess.Popen(_worker_cmd(gemma, sfile, url, name, "2GiB", 7), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    victim = None
    deadline = time.time() + 180
    try:
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
            try:
                study = optuna.load_study(study_name=name, storage=url)
            except KeyError:
                continue
            trials = study.get_trials(deepcopy=False)
            done = [t for t in trials if t.state == TrialState.COMPLETE]
            running = [t for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get("predicted_fits")]
            if len(done) >= 3 and running:
                victim = running[0].number
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        if proc.poll() is None and victim is None:
            proc.kill()
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert victim is not None, f"never caught a running trial:\n{out}"
    study = optuna.load_study(study_name=name, storage=url)
    before = {t.number: t.values for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE}
    assert study.trials[victim].state == TrialState.RUNNING  # the killed process left it running

    lines: list[str] = []
    res = run_study(gemma, load_study(sfile), budget="2GiB", storage=url, name=name, compare_defaults=False,
                    progress=lines.append)
    study = optuna.load_study(study_name=name, storage=url)
    trials = study.get_trials(deepcopy=False)
    after = {t.number: t.values for t in trials if t.state == TrialState.COMPLETE}
    assert all(after.get(n) == v for n, v in before.items())  # nothing completed was lost
    stale = trials[victim]
    assert stale.state == TrialState.FAIL and stale.user_attrs["status"] == "stale"
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == victim]
    assert len(retries) == 1 and retries[0].params == stale.params and retries[0].state.is_finished()
    assert res.retried == [victim] and any("retried" in ln for ln in lines)
    assert res.n_probed == 7 and not [t for t in trials if t.state == TrialState.RUNNING]


def _study_names_ro(db: Path) -> list[str]:
    """The studies in a SQLite storage, read-only: nothing is created while another process creates the schema."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            return [r[0] for r in con.execute("SELECT study_name FROM studies")]
    except sqlite3.Error:  # no file yet, or no studies table yet
        return []


@pytest.mark.slow
def test_ctrl_c_says_one_line_and_the_trial_runs_again(tmp_path, gemma):
    """Ctrl-C (SIGINT) in `ggfit optimise` mid-probe: exit 130 with the one resume line (no Optuna warning, no
    traceback); the trial it cut short is queued, and the resumed run probes it first and still spends exactly
    --trials probes."""
    import optuna
    from optuna.trial import TrialState

    from search.study import count_trials

    sfile = _write(tmp_path, TINY_RESUME)
    url = f"sqlite:///{tmp_path / 'ctrl-c.db'}"
    argv = ["optimise", gemma, "--study", str(sfile), "--budget", "2GiB", "--storage", url, "--seed", "7",
            "--trials", "4", "--no-compare"]
    # a process started in the background by a non-interactive shell inherits SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: restore it, as an interactive terminal would have it
    code = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); import cli; cli.main(sys.argv[1:])"
    p = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    sent = False
    deadline = time.time() + 180
    try:
        while time.time() < deadline and p.poll() is None and not sent:
            time.sleep(0.2)
            names = _study_names_ro(tmp_path / "ctrl-c.db")  # optuna here would race the child creating the schema
            if not names:
                continue
            trials = optuna.load_study(study_name=names[0], storage=url).get_trials(deepcopy=False)
            done = [t for t in trials if t.state == TrialState.COMPLETE]
            probing = [t for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get("probing")]
            if len(done) >= 1 and probing:
                p.send_signal(signal.SIGINT)  # inside a probe (this one, or the next if this one just ended)
                sent = True
    finally:
        if not sent and p.poll() is None:
            p.kill()
        out, err = p.communicate(timeout=120)
    assert sent, f"never caught a probing trial:\n{err}"
    assert p.returncode == 130, err
    cut = [t for t in optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url).trials
           if t.user_attrs.get("status") == "interrupted"]
    assert len(cut) == 1, err
    victim = cut[0].number
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "failed with" not in err, err
    assert err.strip().splitlines()[-1] == (f"ggfit: interrupted; run the same command to resume "
                                            f"(trial #{victim} runs again first)"), err
    assert sum("interrupted" in ln for ln in err.splitlines()) == 1
    name = optuna.get_all_study_names(url)[0]
    t = optuna.load_study(study_name=name, storage=url).trials[victim]
    assert t.state == TrialState.FAIL and t.user_attrs["status"] == "interrupted"

    r = subprocess.run([sys.executable, "cli.py", *argv], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    trials = optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
    again = [x for x in trials if x.system_attrs.get("failed_trial") == victim]
    assert len(again) == 1 and again[0].params == t.params and again[0].state.is_finished()
    assert again[0].number == victim + 1  # queued: the resumed run's first trial
    c = count_trials(trials)
    assert c.probes == 4 and c.retried == 1 and c.running == 0
    assert f"{c.text()}; 4 probes of the search" in r.stdout


@pytest.mark.slow
def test_trials_goal_counts_probes_running_in_other_workers(tmp_path, gemma):
    """--trials N is N probes in all: when another live worker's probe already makes up the goal, this worker's next
    trial is not probed (it says so) and the study stops, instead of overshooting to N + 1."""
    import optuna

    from search.study.storage import _worker

    d = load_study(_write(tmp_path, TINY_RESUME))
    url = f"sqlite:///{tmp_path / 'goal.db'}"
    name = "goal-test"
    other = optuna.create_study(study_name=name, storage=url, direction="maximize").ask()
    for k, v in {"worker": _worker(), "key": "another config", "probing": True, "status": "running"}.items():
        other.set_user_attr(k, v)  # a live worker (this process) probing the study's one probe right now
    lines: list[str] = []
    res = run_study(gemma, d, budget="2GiB", storage=url, name=name, n_trials=1, compare_defaults=False,
                    progress=lines.append)
    assert res.n_probed == 0 and res.counts.unneeded == 1 and res.counts.running == 1 and res.counts.total == 2
    assert any("not probed (goal reached)" in ln and "1 running in other workers" in ln for ln in lines), lines


# --- two workers on PostgreSQL -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres():
    """A throwaway PostgreSQL server on 127.0.0.1 (trust auth); skips when it cannot be started here."""
    try:
        import psycopg  # noqa: F401  (SQLAlchemy 2.1's driver for postgresql:// URLs)
    except ImportError:
        pytest.skip("needs psycopg 3 (pip install 'psycopg[binary]') for a PostgreSQL storage")
    bindir = None
    for cand in [os.environ.get("PG_BIN")] + [str(p) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin"))]:
        if cand and Path(cand, "initdb").exists():
            bindir = cand
    if bindir is None and shutil.which("initdb") and shutil.which("pg_ctl"):
        bindir = str(Path(shutil.which("initdb")).parent)
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install -y postgresql)")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="ggfit-pg-"))  # not under pytest's tmp root: that is private to this user
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the server as the postgres user
        import pwd

        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        for p in (base, sock):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"] if shutil.which("runuser") else None
        if as_user is None:
            pytest.skip("running as root without runuser to start PostgreSQL as 'postgres'")
    port = _free_port()
    r = subprocess.run(as_user + [f"{bindir}/initdb", "-D", str(data), "-A", "trust", "-U", "postgres"],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"initdb failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off"
    r = subprocess.run(as_user + [f"{bindir}/pg_ctl", "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w",
                                  "-t", "60", "start"], capture_output=True, text=True)
    if r.returncode:
        log = (base / "log").read_text() if (base / "log").exists() else r.stderr
        pytest.skip(f"pg_ctl start failed: {log.strip().splitlines()[-1:]}")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(as_user + [f"{bindir}/pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_two_workers_share_a_postgres_study(tmp_path, postgres, moe_quants):
    """Two ggfit processes on one PostgreSQL study: every trial run once, by one worker, to the shared trial goal."""
    import optuna

    text = TINY_RESUME.replace('name = "resume-test"', 'name = "pg-test"').replace("trials = 7", "trials = 10")
    sfile = _write(tmp_path, text)
    name = "pg-test"
    procs = [subprocess.Popen(_worker_cmd(moe_quants[0], sfile, postgres, name, "2GiB", s), cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for s in (11, 12)]
    outs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]
    study = optuna.load_study(study_name=name, storage=postgres)
    trials = study.get_trials(deepcopy=False)
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers))
    workers = {t.user_attrs["worker"]["pid"] for t in trials if "worker" in t.user_attrs}
    assert workers == {p.pid for p in procs}, (workers, [p.pid for p in procs])
    probed = _probed(study)
    by_worker = {w: sum(t.user_attrs["worker"]["pid"] == w for t in probed) for w in workers}
    assert all(n >= 1 for n in by_worker.values()), by_worker
    assert 10 <= len(probed) <= 11  # the goal, plus at most one trial the other worker had already started
    assert all(t.state.is_finished() for t in trials)
    from search.report import trial_table

    table = trial_table(study).splitlines()
    assert "worker" in table[0].split()
    for t in probed:  # the report names the worker of each trial
        w = t.user_attrs["worker"]
        assert any(ln.split()[0] == str(t.number) and f"{w['host']}:{w['pid']}" in ln for ln in table[1:]), table
    keys = [t.user_attrs["key"] for t in probed]
    dup = len(keys) - len(set(keys))
    print(f"workers {by_worker}, probed {len(probed)}, same config probed twice: {dup}")
    assert dup <= 1  # a later trial waits for an earlier one probing its config; only proposals made within the same milliseconds can both probe


# --- subprocess entry point for the resume and PostgreSQL tests ------------------------------------------------

if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    r = run_study(a["model"], a["study"], budget=a["budget"], storage=a["storage"], name=a["name"], seed=a["seed"],
                  compare_defaults=False, progress=lambda s: print(s, flush=True))
    print(r.text(), flush=True)
