"""One probe at a time per host: the host-wide probe lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from typing import Any

from fitter.progress import Progress

# --- one probe at a time per host -------------------------------------------------------------------------

# Two probes on one host share its cores and memory bandwidth and measure each other (two optimise workers on
# one study once measured 143 tok/s where either alone measured 356-416). So every probe holds this lock from
# before its child starts until the child is dead. /tmp, because the lock must be the same file for every
# user's ggfit on the host: $XDG_RUNTIME_DIR is per user, and tempfile.gettempdir() follows $TMPDIR (per user
# on macOS). GGFIT_PROBE_LOCK=PATH moves it, GGFIT_PROBE_LOCK=off drops it (e.g. probes pinned to separate GPUs).
PROBE_LOCK = "/tmp/ggfit-probe.lock"
LOCK_WAIT_STAGE = "waiting for another probe on this host"


def probe_lock_path() -> str | None:
    v = os.environ.get("GGFIT_PROBE_LOCK")
    if v is None:
        return PROBE_LOCK
    return None if v.strip().lower() in ("", "off", "none", "0") else v


def _open_lock(path: str) -> int | None:
    """A read-only descriptor on the lock file, created readable by all (flock needs no write access). Read-only,
    and without O_CREAT on an existing file: /tmp is sticky and fs.protected_regular refuses O_CREAT on another
    user's file there. None when it cannot be opened (then the probe runs unlocked rather than fails)."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            except OSError:
                return None
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o644)  # whatever the umask: other users must be able to open it
            return fd
        except OSError:
            return None
    return None


@contextlib.contextmanager
def host_probe_lock(progress: Progress | None = None) -> Iterator[dict[str, Any]]:
    """Hold the host-wide probe lock (fcntl.flock, so it dies with the process) for the block; yields
    {"path", "waited_s"}. While another probe holds it, says so on `progress` and waits."""
    info: dict[str, Any] = {"path": probe_lock_path(), "waited_s": 0.0}
    fd = _open_lock(info["path"]) if info["path"] else None
    if fd is None:
        info["path"] = None
        yield info
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress is not None:
                progress.stage(LOCK_WAIT_STAGE)
            t = time.perf_counter()
            fcntl.flock(fd, fcntl.LOCK_EX)  # Ctrl-C / SIGTERM interrupt the wait
            info["waited_s"] = time.perf_counter() - t
        yield info
    finally:
        os.close(fd)  # releases the lock
