"""Children do not outlive ggfit, probes on one host do not overlap, and a probe says what it is doing.

- SIGTERM or SIGKILL to `ggfit probe` (both runners), `ggfit optimise` (both runners) or `ggfit calibrate`
  (llama.cpp's dry-run children) while its child runs: within 2 s nothing of the child's process group is left
  (SIGTERM: cleaned up like Ctrl-C, then ggfit dies of SIGTERM, exit status 143; SIGKILL: the kernel kills the child,
  PR_SET_PDEATHSIG). The moment to kill is found by watching /proc for the child, not by sleeping.
- Two probes started together run one after the other (the host-wide probe lock); one that waits says so and its
  wait does not count against its --timeout.
- A probe reports its stages (load, prefill, decode) while its child runs, not after.
- A Ctrl-C or SIGTERM that lands while a child is being started is raised once it is started, not lost.

The server-runner cases need the pinned llama-server (the `llama_server` fixture of tests/conftest.py builds it, or
skips under GGFIT_NO_SERVER_BUILD=1 when it is not cached).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fitter.llama.cparams import RunConfig
from fitter.progress import Progress
from search.probe import LOCK_WAIT_STAGE, run_probe
from search.workload import Workload
from tests.procs import group_alive, live_processes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ONE = Workload(prompt_tokens=16, gen_tokens=4, repeats=1, warmup=0)
LINGER_S = 2.0  # what the issue allows a child after ggfit is gone


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _child(parent: int, marker: str) -> int | None:
    """A live child of `parent` whose command line contains `marker` (so it has exec'd: its preexec_fn ran)."""
    for pid, fields in live_processes():
        if int(fields[1]) == parent and marker in _cmdline(pid):
            return pid
    return None


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["XDG_DATA_HOME"] = str(tmp_path / "data")  # studies, calibrations: nothing lands in the user's home
    env["GGFIT_PROBE_LOCK"] = str(tmp_path / "probe.lock")  # not queued behind other tests' probes on this host
    env["GGFIT_PROGRESS"] = "lines"
    return env


def _maps(pid: int, what: str) -> bool:
    try:
        return what in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _kill_during_child(args: list[str], marker: str, sig: int, tmp_path: Path, ready=lambda kid, log: True,
                       wait_s: float = 300, env: dict[str, str] | None = None, said: str | None = None) -> None:
    """Start `python cli.py ARGS`; once its child (`marker` in its command line) runs and `ready(child, log)`,
    send `sig`; then ggfit dies of `sig` (having said `said` on its way out, for SIGTERM) and within LINGER_S nothing
    is left of the child's process group."""
    logf = tmp_path / "ggfit.log"
    log = open(logf, "wb")
    p = subprocess.Popen([sys.executable, "cli.py", *args], cwd=REPO, env={**_env(tmp_path), **(env or {})}, stdout=log,
                         stderr=subprocess.STDOUT)
    kid = None
    try:
        deadline = time.monotonic() + wait_s
        while p.poll() is None and time.monotonic() < deadline:
            kid = kid if kid and group_alive(kid) else _child(p.pid, marker)
            if kid is not None and ready(kid, logf.read_text(errors="replace")):
                break
            time.sleep(0.02)
        assert kid is not None and p.poll() is None, f"no {marker} child to kill: {logf.read_text()[-2000:]}"
        p.send_signal(sig)
        rc = p.wait(timeout=60)
        gone = time.monotonic() + LINGER_S
        while group_alive(kid) and time.monotonic() < gone:
            time.sleep(0.05)
        left = group_alive(kid)
        assert left == [], f"{marker} (pid {kid}) outlived ggfit: {[_cmdline(x) for x in left]}"
        assert rc == -sig, (rc, logf.read_text()[-2000:])  # 143 / 137 in a shell
        if said and sig == signal.SIGTERM:
            assert said in logf.read_text(errors="replace").splitlines()[-1], logf.read_text()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if kid is not None and group_alive(kid):  # a failed check leaves no orphan behind for the next test
            try:
                os.killpg(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def _server_args(request: pytest.FixtureRequest, runner: str) -> list[str]:
    if runner == "python":
        return []
    return ["--runner", "server", "--llama-server", request.getfixturevalue("llama_server")]


MARKER = {"python": "search._probe_child", "server": "--no-warmup"}  # llama-server's probe command line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("runner", ["python", "server"])
def test_probe_children_die_with_ggfit(runner, sig, tmp_path, request):
    """Killed in the middle of a long decode (the python child writes nothing then, so a broken pipe would not stop
    it; an idle llama-server writes nothing at all)."""
    args = ["probe", "gemma3-270m", "-c", "2048", "-t", "1", "--gen-tokens", "1024", *_server_args(request, runner)]
    _kill_during_child(args, MARKER[runner], sig, tmp_path, ready=lambda kid, log: "decode" in log,
                       said="ggfit: terminated (SIGTERM); the probe was stopped")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("runner", ["python", "server"])
def test_optimise_children_die_with_ggfit(runner, sig, gemma, tmp_path, request):
    """Killed once the probe's child has mapped the model."""
    args = ["optimise", "gemma3-270m", "--budget", "2GiB", "--trials", "2",
            "--storage", f"sqlite:///{tmp_path}/x.db", *_server_args(request, runner)]
    name = Path(gemma).name
    _kill_during_child(args, MARKER[runner], sig, tmp_path, ready=lambda kid, log: _maps(kid, name),
                       said="ggfit: terminated (SIGTERM); run the same command to resume (trial #")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_dry_run_children_die_with_ggfit(sig, tmp_path):
    """`ggfit calibrate` runs llama.cpp's dry run in one child after another (fitter.oracle.llama_run.measure)."""
    _kill_during_child(["calibrate", "gemma3-270m"], "fitter.oracle._llama_child", sig, tmp_path,
                       ready=lambda kid, log: _maps(kid, "libllama"))  # importing llama_cpp, or past it


def test_watchdog_kills_children_where_there_is_no_parent_death_signal(tmp_path, request):
    """macOS has no PR_SET_PDEATHSIG: there a watchdog process kills the child's group when ggfit dies, even of
    SIGKILL. GGFIT_WATCHDOG=pipe uses the watchdog here instead of the kernel's signal. llama-server is the child
    that needs it most: idle or decoding, it writes nothing, so no broken pipe ever stops it."""
    args = ["probe", "gemma3-270m", "-c", "2048", "-t", "1", "--gen-tokens", "1024", *_server_args(request, "server")]
    _kill_during_child(args, MARKER["server"], signal.SIGKILL, tmp_path, ready=lambda kid, log: "decode" in log,
                       env={"GGFIT_WATCHDOG": "pipe"})


def test_watchdog_released_kills_nothing():
    """A child reaped normally: the watchdog exits without touching the (by then maybe reused) process group."""
    from fitter.oracle.child_process import Watchdog

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        w = Watchdog(sleeper.pid)
        w.release()
        assert w.proc.returncode == 0 and sleeper.poll() is None  # released: the group was left alone
    finally:
        sleeper.kill()
        sleeper.wait()


# --- one probe at a time on a host ---------------------------------------------------------------------------


def test_probes_on_one_host_take_turns_and_a_wait_is_not_a_timeout(moe, tmp_path):  # noqa: F811
    """Two `ggfit probe --timeout 15` wait (and say so) 16 s for the lock this test holds, then run one after the
    other, both ok."""
    import fcntl

    lock = tmp_path / "probe.lock"
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    procs, errs = [], []
    try:
        for k in range(2):
            errs.append(open(tmp_path / f"err{k}", "wb"))
            procs.append(subprocess.Popen(
                [sys.executable, "cli.py", "probe", moe, "-c", "512", "-t", "1", "--prompt-tokens", "16",
                 "--gen-tokens", "4", "--repeats", "1", "--timeout", "15", "--json"],
                cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=errs[-1]))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                LOCK_WAIT_STAGE in (tmp_path / f"err{k}").read_text() for k in range(2)):
            time.sleep(0.1)
        assert all(LOCK_WAIT_STAGE in (tmp_path / f"err{k}").read_text() for k in range(2))
        assert [p.poll() for p in procs] == [None, None]  # waiting, not failed
        time.sleep(16)  # longer than their --timeout
        t_released = time.time()
    finally:
        os.close(fd)
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for e in errs:
        e.close()
    res = [json.loads(o) for o in outs]
    for r in res:
        assert r["status"] == "ok", (r["status"], r["message"])
        assert r["timings"]["lock_wait_s"] >= 15 and r["started_at"] >= t_released
    a, b = sorted(res, key=lambda r: r["started_at"])
    assert a["ended_at"] <= b["started_at"], "the two probes' children overlapped"


# --- live progress ---------------------------------------------------------------------------------------------


class _Stamped(io.StringIO):
    """A progress stream that remembers when each line was written."""

    def __init__(self) -> None:
        super().__init__()
        self.stamped: list[tuple[float, str]] = []

    def write(self, s: str) -> int:
        if s.strip():
            self.stamped.append((time.time(), s.strip()))
        return super().write(s)


def _check_live(res, stream: _Stamped, stages: list[str]) -> None:
    assert res.status == "ok", (res.message, res.evidence)
    lines = [t for _, t in stream.stamped]
    at = []
    for stage in stages:
        hits = [k for k, t in enumerate(lines) if stage in t]
        assert hits, f"no {stage!r} in {lines}"
        at.append(hits[0])
    assert at == sorted(at), lines  # in the order they happen
    for k in at:  # reported as it happened, not read back after the child died
        assert stream.stamped[k][0] <= res.ended_at, (stream.stamped[k], res.ended_at)


def test_python_probe_reports_its_stages_live(moe, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("GGFIT_PROBE_LOCK", str(tmp_path / "probe.lock"))
    stream = _Stamped()
    res = run_probe(moe, RunConfig(n_ctx=512), Workload(prompt_tokens=16, gen_tokens=4, repeats=1, warmup=1),
                    threads=1, progress=Progress("probe", stream=stream, mode="lines"))
    _check_live(res, stream, ["loading the model", "creating the context", "prompt 1 (warm-up): prefill 16 tokens",
                              "prompt 1 (warm-up): decode 4 tokens", "prompt 2: prefill 16 tokens",
                              "prompt 2: decode 4 tokens"])


def test_server_probe_reports_its_stages_live(moe, llama_server, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("GGFIT_PROBE_LOCK", str(tmp_path / "probe.lock"))
    stream = _Stamped()
    res = run_probe(moe, RunConfig(n_ctx=512, n_parallel=1), ONE, runner="server", llama_server=llama_server,
                    threads=1, progress=Progress("probe", stream=stream, mode="lines"))
    _check_live(res, stream, ["starting llama-server", "loading the model", "prompt 1: prefill 16 + decode 4 tokens"])


# A Ctrl-C (or sigterm_cleanup's SIGTERM) that lands while a child is being started: subprocess.Popen with a
# preexec_fn runs CPython's after-fork hooks in the parent, and a KeyboardInterrupt raised inside one is printed as
# "Exception ignored" and lost (a study once went on to its end after one). Here an after-fork hook sends the signal.
_FORK_SIGNAL = """import os, signal, sys
sys.path.insert(0, {repo!r})
from fitter.oracle.child_process import sigterm_cleanup
from search.server import Proc
sent = []
def hook():
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.{sig})
os.register_at_fork(after_in_parent=hook)
marker = "ggfit-fork-signal-%d" % os.getpid()
def left():  # the child, if it still runs (Linux: /proc)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    return True
        except OSError:
            pass
    return False
try:
    with sigterm_cleanup():  # a preexec_fn on any OS: Popen then runs the hooks
        p = Proc([sys.executable, "-c", "import time; time.sleep(60)", marker], as_limit=1 << 40)
        p.wait(60)
    print("lost")
except KeyboardInterrupt as e:
    print("raised", type(e).__name__, "child-left" if left() else "child-gone")
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the child in /proc")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_during_a_childs_start_is_raised_not_lost(sig):
    r = subprocess.run([sys.executable, "-c", _FORK_SIGNAL.format(repo=str(REPO), sig=sig)], capture_output=True,
                       text=True, timeout=120)
    if sig == "SIGINT":
        # and the child it had started is gone: the Proc was never returned, so nobody else could stop it
        assert r.stdout.split() == ["raised", "KeyboardInterrupt", "child-gone"], (r.stdout, r.stderr)
    else:  # sigterm_cleanup's Terminated, then the process ends of SIGTERM as it would have without the handler
        assert r.returncode == -signal.SIGTERM and "lost" not in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert "Exception ignored" not in r.stderr, r.stderr
