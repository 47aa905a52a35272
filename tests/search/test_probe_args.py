"""`ggfit probe` refuses a bad argument at once, whatever other probes the host runs (issue 49): the arguments are
checked before the host probe lock is waited for. Here the lock (a private one, GGFIT_PROBE_LOCK) is held by this
test the whole time: a check made after taking it would wait for ever (the subprocess's timeout fails the test)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from search.probe import LOCK_WAIT_STAGE

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def held_lock(tmp_path):
    path = tmp_path / "probe.lock"
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield str(path)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def mmproj() -> str:
    from tests.synth.mmproj import build_mmproj

    return str(build_mmproj("gemma3"))


@pytest.mark.parametrize("args, phrase", [
    (["--mmproj", "{mm}"], "--mmproj: the python runner loads no multimodal projector; use --runner server"),
    (["--spec-type", "draft-simple"], "--spec-type draft-simple needs a draft model (-md)"),
    (["--lora", "{missing}"], "no-such-adapter.gguf"),
    (["-md", "{missing}"], "no-such-adapter.gguf"),
    (["--runner", "server", "--llama-server", "{missing}"], "is not an executable file"),
])
def test_bad_arguments_do_not_wait_for_the_probe_lock(args, phrase, gemma, mmproj, held_lock, tmp_path):
    argv = [a.format(mm=mmproj, missing=str(tmp_path / "no-such-adapter.gguf")) for a in args]
    env = {**os.environ, "GGFIT_PROBE_LOCK": held_lock, "GGFIT_PROGRESS": "lines"}
    r = subprocess.run([sys.executable, "cli.py", "probe", gemma, *argv], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("ggfit: error: ") and phrase in lines[0], r.stderr
    assert LOCK_WAIT_STAGE not in r.stderr
