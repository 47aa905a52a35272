"""SIGTERM and Ctrl-C in `ggfit optimise` and `ggfit probe` (issue 49): one line, the trial cut short marked as such
and queued again, and the process still dies of SIGTERM (exit status 143 in a shell), as before.

Fast: optimise's probe is replaced by one that waits (run_study's `probe` hook, in the child), probe talks to the fake
OpenAI server told to hang. The moment to signal is read from the child's output, not slept for. That no llama.cpp
child outlives ggfit is tests/search/test_lifecycle.py's (real probes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
from optuna.trial import TrialState  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

STUDY = """
name = "sig-test"
objectives = ["prefill_tps"]
trials = 3

[workload]
prompt_tokens = 32
gen_tokens = 4
repeats = 1
warmup = 0

[space]
n_ctx = [2048]
n_ubatch = [64, 128]
threads = [1]
"""

# the child: `ggfit optimise` whose probes say PROBING on stdout and then wait (a probe in flight)
CHILD = """
import signal, sys, time
sys.path.insert(0, {repo!r})
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal has it (a background shell ignores it)
import search.study.run as run

def probe(*a, **kw):
    print("PROBING", flush=True)
    time.sleep(120)

run.run_study.__kwdefaults__["probe"] = probe
import cli
cli.main(sys.argv[1:])
"""


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "GGFIT_PROBE_LOCK": str(tmp_path / "lock"),
            "GGFIT_PROGRESS": "lines"}


def _signal_when(p: subprocess.Popen, marker: str, sig: int) -> str:
    """Send `sig` once `marker` is on the child's stdout; returns the stdout read until then."""
    out = ""
    deadline = time.monotonic() + 120
    assert p.stdout is not None
    while marker not in out and time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        out += line
    assert marker in out, out
    p.send_signal(sig)
    return out


@pytest.mark.parametrize("sig, rc, said", [
    (signal.SIGTERM, -signal.SIGTERM, "terminated (SIGTERM)"),
    (signal.SIGINT, 130, "interrupted"),
])
def test_optimise_says_one_line_and_marks_the_trial(tmp_path, gemma, sig, rc, said):
    (tmp_path / "s.toml").write_text(STUDY)
    url = f"sqlite:///{tmp_path / 's.db'}"
    p = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=str(REPO)), "optimise", gemma, "--study",
                          str(tmp_path / "s.toml"), "--budget", "2GiB", "--storage", url, "--no-compare"],
                         cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _signal_when(p, "PROBING", sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == rc, err
    assert "Traceback" not in err and "failed with" not in err, err
    assert err.strip().splitlines()[-1] == f"ggfit: {said}; run the same command to resume (trial #0 runs again first)"
    study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
    first, again = study.trials[0], study.trials[-1]
    status = "terminated" if sig == signal.SIGTERM else "interrupted"
    assert first.state == TrialState.FAIL and first.user_attrs["status"] == status, first.user_attrs
    assert again.state == TrialState.WAITING and again.system_attrs["failed_trial"] == 0  # run again first on resume
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]  # nothing left RUNNING until the next run


@pytest.mark.parametrize("sig, rc, said", [
    (signal.SIGTERM, -signal.SIGTERM, "terminated (SIGTERM)"),
    (signal.SIGINT, 130, "interrupted"),
])
def test_probe_says_one_line(tmp_path, sig, rc, said):
    """`probe --runner openai` against a server that stops answering: the signal ends it with one line."""
    from search.server import Proc, free_port

    port = free_port()
    srv = Proc([sys.executable, "-m", "tests.search.fake_openai", str(port), "--hang-at", "1"], merge_stderr=True)
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"sys.path.insert(0, {str(REPO)!r}); import cli; cli.main(sys.argv[1:])")
    try:
        p = subprocess.Popen([sys.executable, "-c", code, "probe", "--runner", "openai", "--url",
                              f"http://127.0.0.1:{port}", "--timeout", "120"], cwd=REPO, env=_env(tmp_path),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stderr is not None
        deadline = time.monotonic() + 60
        seen = ""
        while "warm-up request 1 of 1" not in seen and time.monotonic() < deadline:
            seen += p.stderr.readline()
        time.sleep(0.3)  # the request is on its way (the server hangs after its first token)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        srv.stop()
        if p.poll() is None:
            p.kill()
    assert p.returncode == rc, seen + err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"ggfit: {said}; the probe was stopped", err
