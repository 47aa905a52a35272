"""ggfit's child processes (llama.cpp runs in fitter.oracle.llama_run, probes in search): their events on stdout,
environment, a new process group that dies with its parent (PR_SET_PDEATHSIG, or a watchdog), signals held while one
starts, SIGTERM turned into cleanup, and how a child's end reads (its abort line, its signal)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fitter.errors import SourceError

REPO_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout holding fitter/, for the children's PYTHONPATH


def child_event(line: str) -> dict[str, Any] | None:
    """One line a child wrote on stdout as its JSON event ({"event": ...}), or None for any other line."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        ev = json.loads(line)
    except json.JSONDecodeError:
        return None
    return ev if isinstance(ev, dict) and "event" in ev else None


def child_events(out: bytes) -> list[dict[str, Any]]:
    """The JSON event lines a child wrote on stdout, in order; other lines skipped."""
    return [ev for line in out.decode("utf-8", "replace").splitlines() if (ev := child_event(line)) is not None]


def check_model_path(model_path: str | os.PathLike[str]) -> str:
    p = os.fspath(model_path)
    if "://" in p:
        raise SourceError(f"{p}: llama.cpp needs a local file (download it first)")
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise SourceError(f"{p}: no such file") from None
    except OSError as e:
        raise SourceError(f"{p}: cannot open ({e.strerror})") from None
    if not (st.st_mode & 0o170000 == 0o100000):
        raise SourceError(f"{p}: not a regular file")
    if not os.access(p, os.R_OK):
        raise SourceError(f"{p}: not readable")
    return os.path.abspath(p)


def child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GGML_NO_BACKTRACE", "1")  # ggml_print_backtrace would fork gdb on every abort
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + pp if pp else "")
    if extra:
        env.update(extra)
    return env


# --- children die with ggfit -----------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    f.restype = ctypes.c_int
    return f


_PRCTL = _libc_prctl()


def child_preexec(as_limit: int | None = None) -> Callable[[], None] | None:
    """The `preexec_fn` of every child ggfit starts (it runs in the child between fork and exec).

    On Linux the child gets PR_SET_PDEATHSIG = SIGKILL, which survives exec: when ggfit dies, even of SIGKILL,
    the kernel kills the child (llama-server, a probe or dry-run child) instead of leaving it to PID 1. The
    signal fires when the *thread* that forked the child ends, so a child must be started by the thread that
    waits for it (every caller here does: run_probe and measure block until their child is dead). If ggfit
    died between fork and prctl, the child kills itself. `as_limit`: RLIMIT_AS for the child (a budget).
    Elsewhere (macOS) `watchdog_for` gives the child a watchdog process instead.
    """
    prctl = _pdeathsig()
    if as_limit is None and prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        if as_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # ggfit is already gone
                os.kill(os.getpid(), signal.SIGKILL)

    return preexec


# Where no parent-death signal exists (macOS): a watchdog process holds the read end of a pipe whose write end
# only ggfit holds. ggfit writes one byte once it has reaped the child; if ggfit dies first, however it dies, the
# kernel closes the write end, the watchdog reads EOF and kills the child's process group.
_WATCHDOG = """import os, signal, sys
try:
    gone = os.read(0, 1) == b""
except OSError:
    gone = True
if gone:
    try:
        os.killpg(int(sys.argv[1]), signal.SIGKILL)
    except OSError:
        pass
"""


class Watchdog:
    """Kills the process group `pgid` if ggfit dies before `release()` (see _WATCHDOG)."""

    def __init__(self, pgid: int) -> None:
        r, self._w = os.pipe()  # not inheritable: no other child holds the write end
        try:
            self.proc = subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG, str(pgid)], stdin=r,
                                         start_new_session=True)  # its own group: Ctrl-C to ggfit's group spares it
        finally:
            os.close(r)

    def release(self) -> None:
        """The child is reaped: the watchdog exits without killing anything."""
        if self._w < 0:
            return
        try:
            os.write(self._w, b"x")
        except OSError:
            pass
        os.close(self._w)
        self._w = -1
        self.proc.wait()


def _pdeathsig() -> Any:
    """prctl for PR_SET_PDEATHSIG, or None: not Linux, or GGFIT_WATCHDOG=pipe (the watchdog, as on macOS)."""
    return None if os.environ.get("GGFIT_WATCHDOG") == "pipe" else _PRCTL


def watchdog_for(pgid: int) -> Watchdog | None:
    """A Watchdog where the kernel's parent-death signal is missing."""
    return None if _pdeathsig() is not None else Watchdog(pgid)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C (and `sigterm_cleanup`'s SIGTERM) held while the block starts a child, raised when it leaves.

    subprocess.Popen with a `preexec_fn` runs CPython's after-fork hooks in the parent (logging's lock), and a
    KeyboardInterrupt raised inside one is printed as "Exception ignored" and lost: a study went on after a Ctrl-C
    that landed there. Held, the signal reaches its handler once the child is started (and watched). In the main
    thread, for handlers written in Python; a signal ignored or left to the system is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: dict[int, Callable[[int, Any], Any]] = {}
    got: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)
        if callable(prev):
            held[sig] = prev
            signal.signal(sig, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for held_sig, handler in held.items():
            signal.signal(held_sig, handler)
        for signum in got:  # as they came, now outside the hooks
            held[signum](signum, None)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so that the same cleanup runs (see `sigterm_cleanup`)."""


@contextlib.contextmanager
def sigterm_cleanup() -> Iterator[None]:
    """While the block runs, SIGTERM cleans up as Ctrl-C does, then ends the process as SIGTERM would.

    In the main thread, and only when nobody else handles SIGTERM (its disposition is SIG_DFL): SIGTERM raises
    `Terminated` (a KeyboardInterrupt), so the `finally` blocks that kill a child's process group on Ctrl-C run;
    when it leaves the block, the process kills itself with SIGTERM (exit status 143, as without the handler). A
    second SIGTERM during the cleanup ends the process at once (its children die with it: `child_preexec`).
    Elsewhere (another thread, a handler of the caller's own) it does nothing.
    """
    try:
        ours = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    except (ValueError, OSError):
        ours = False
    if not ours:
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Terminated:
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # die of it, as if nobody had caught it
        raise
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child started with start_new_session, its whole process group, and the child itself."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def short_abort(line: str) -> str:
    """ggml's abort line names the build tree's absolute path; keep it from the llama.cpp root on."""
    for marker in ("/vendor/llama.cpp/", "/llama.cpp/"):
        i = line.find(marker)
        if i >= 0 and i < line.find(":"):
            return line[i + len(marker):]
    return line


def signal_name(rc: int | None) -> str | None:
    """A child's negative exit status as the name of the signal that killed it."""
    if rc is None or rc >= 0:
        return None
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"
