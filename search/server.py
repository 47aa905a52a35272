"""llama-server as a probe runner, and the process plumbing both runners share.

`Proc` runs a command in its own session (process group) and reaps it with `os.wait4`, which gives
that very child's resource usage (`ru_maxrss`: its RSS high-water mark) even when it dies of a signal;
`Proc.kill()` kills the whole group, so nothing the child started survives a timeout or Ctrl-C.

`LlamaServer` starts `llama-server` on 127.0.0.1 on a free port with a `RunConfig`'s flags and automatic
fitting off (`-fit off`), waits for `/health`, and talks to it over HTTP with the standard library only.
Its whole log (stdout and stderr merged) is collected line by line as it comes.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from fitter.errors import GGFitError
from fitter.llama.cparams import RunConfig
from fitter.oracle.child_process import child_preexec, kill_group, signals_held, watchdog_for

MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
# A budget is enforced with RLIMIT_AS; glibc would reserve 64 MiB of address space per malloc arena (up to
# 8 per core, created when threads happen to contend), which makes the baseline random. One arena fixes it.
BUDGET_ENV = {"MALLOC_ARENA_MAX": "1"}


def server_as_allowance(n_parallel: int, threads: int) -> int:
    """Address space llama-server holds before it loads anything, measured on the pinned build (Linux x86_64,
    MALLOC_ARENA_MAX=1): ~44 MiB (binary, libc, heap) + one stack (RLIMIT_STACK, 8 MiB) per thread; threads =
    HTTP workers (max(n_parallel + 4, cores - 1), tools/server/server-http.cpp) + compute threads + ~4 others.
    Measured 124 / 148 / 244 MiB for -np 1 / 4 / 16 on 2 cores; this returns ~50 MiB more."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = 8 << 20 if stack in (resource.RLIM_INFINITY, -1) or stack <= 0 else stack
    n_http = max(n_parallel + 4, (os.cpu_count() or 1) - 1)
    return (96 << 20) + stack * (n_http + threads + 4)


class ServerNotFound(GGFitError):
    """No llama-server binary to run."""


def find_llama_server(explicit: str | os.PathLike[str] | None = None) -> str:
    """The llama-server to use: `explicit`, else $GGFIT_LLAMA_SERVER, else ggfit's cached build, else PATH."""
    from search.build_server import server_binary  # noqa: PLC0415

    cands: list[tuple[str, str]] = []
    if explicit:
        cands.append((os.fspath(explicit), "--llama-server"))
    elif os.environ.get("GGFIT_LLAMA_SERVER"):
        cands.append((os.environ["GGFIT_LLAMA_SERVER"], "$GGFIT_LLAMA_SERVER"))
    else:
        cands.append((str(server_binary()), "ggfit's build"))
        w = shutil.which("llama-server")
        if w:
            cands.append((w, "PATH"))
    for path, _ in cands:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.abspath(path)
    if explicit or os.environ.get("GGFIT_LLAMA_SERVER"):
        path, why = cands[0]
        raise ServerNotFound(f"{why}: {path} is not an executable file")
    raise ServerNotFound("no llama-server found: pass --llama-server PATH, or build the pinned one with "
                         "`python -m search.build_server`")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child in its own process group, reaped by os.wait4 (exit status and its own rusage).

    It dies with ggfit (`child_preexec`); start it from the thread that waits for it. `on_stdout_line` is
    called from the reader thread with each stdout line as it comes (a probe child's live events).
    `started_at` / `ended_at`: wall-clock times (time.time()) of the start and of the reaping."""

    def __init__(self, cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                 stdin: bytes | None = None, merge_stderr: bool = False, as_limit: int | None = None,
                 on_stdout_line=None):
        self.t0 = time.perf_counter()
        self.started_at = time.time()
        self.ended_at: float | None = None
        try:
            with signals_held():  # a Ctrl-C during the fork is raised as it leaves, not lost
                self.popen = subprocess.Popen(
                    cmd, env=env, cwd=cwd,
                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                    start_new_session=True,  # its own process group: kill() takes everything it started
                    preexec_fn=child_preexec(as_limit),  # RLIMIT_AS, and (Linux) it dies when ggfit dies, even of SIGKILL
                )
                self.pid = self.popen.pid
                self._watchdog = watchdog_for(self.pid)  # None on Linux (the parent-death signal does it)
        except BaseException:
            if hasattr(self, "popen"):  # started, then interrupted: the caller never gets this Proc to stop it
                self._kill_unwatched()
            raise
        self.out = bytearray()
        self.err = bytearray()
        self.lines: list[str] = []  # stdout split into lines as they come (merged log for the server)
        self._on_line = on_stdout_line
        self.status: int | None = None
        self.signalled = False  # ggfit signalled the group while the child was alive (stop/kill)
        self.rusage: resource.struct_rusage | None = None
        self.exited = threading.Event()
        self.wall_s: float | None = None
        self._threads = [threading.Thread(target=self._read, args=(self.popen.stdout, self.out, True), daemon=True)]
        if not merge_stderr:
            self._threads.append(threading.Thread(target=self._read, args=(self.popen.stderr, self.err, False), daemon=True))
        self._threads.append(threading.Thread(target=self._wait, daemon=True))
        for t in self._threads:
            t.start()
        if stdin is not None:
            assert self.popen.stdin is not None  # Popen(stdin=PIPE)
            try:
                self.popen.stdin.write(stdin)
                self.popen.stdin.close()
            except (BrokenPipeError, OSError):
                pass

    def _kill_unwatched(self) -> None:
        """SIGKILL the group of a child whose reader and waiter threads never started, and reap it."""
        kill_group(self.popen)
        self.popen.wait()
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.release()

    def _read(self, f, buf: bytearray, split: bool) -> None:
        pending = b""
        for chunk in iter(lambda: f.read1(65536), b""):
            buf += chunk
            if split:
                pending += chunk
                *full, pending = pending.split(b"\n")
                for ln in full:
                    self._line(ln.decode("utf-8", "replace"))
        if split and pending:
            self._line(pending.decode("utf-8", "replace"))

    def _line(self, s: str) -> None:
        self.lines.append(s)
        if self._on_line:
            try:
                self._on_line(s)
            except Exception as e:  # noqa: BLE001 - a reporting callback must never stop the reading: said once, then off
                self._on_line = None
                print(f"ggfit: warning: the progress display failed ({type(e).__name__}: {e}); the probe goes on",
                      file=sys.stderr)

    def _wait(self) -> None:
        _, status, ru = os.wait4(self.pid, 0)
        self.status, self.rusage = status, ru
        self.wall_s = time.perf_counter() - self.t0
        self.ended_at = time.time()
        self.popen.returncode = os.waitstatus_to_exitcode(status)  # keeps Popen from waiting again
        self.exited.set()
        if self._watchdog is not None:
            self._watchdog.release()

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode if self.exited.is_set() else None

    @property
    def alive(self) -> bool:
        return not self.exited.is_set()

    def wait(self, timeout: float | None) -> bool:
        """True once the child has exited (and its output has been read to the end)."""
        if not self.exited.wait(timeout):
            return False
        for t in self._threads:
            t.join(5)
        return True

    def signal_group(self, sig: int) -> None:
        if self.alive:
            self.signalled = True
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the whole group and reap the child."""
        self.signal_group(signal.SIGKILL)
        self.wait(10)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the group, wait `grace` seconds, then SIGKILL it; the group is gone afterwards."""
        if self.alive:
            self.signal_group(signal.SIGTERM)
            if not self.wait(grace):
                self.signal_group(signal.SIGKILL)
                self.wait(10)
        self.signal_group(signal.SIGKILL)  # anything left in the group (a grandchild) goes too
        self.wait(10)

    @property
    def peak_rss_bytes(self) -> int | None:
        return self.rusage.ru_maxrss * MAXRSS_UNIT if self.rusage is not None else None


# --- llama-server command line -------------------------------------------------------------------------


def server_command(
    binary: str, model_path: str, config: RunConfig, *, port: int, threads: int | None,
    use_extra_bufts: bool, n_min: int | None = None, p_min: float | None = None,
    extra_args: list[str] | None = None,
) -> list[str]:
    """llama-server's argv for `config`: only flags the user set (None keeps llama-server's default), plus
    `-fit off` (no automatic fitting), the repack switch, threads, and `--no-warmup` (the probe warms up itself) unless
    there is an --mmproj."""
    c = config
    cmd = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-fit", "off"]
    # --no-warmup would also skip clip's warmup, the only place it reserves the projector's compute buffer at load
    # (mtmd_context_params.warmup): with --mmproj the server warms up, so that the probe holds what ggfit predicts
    if c.mmproj:
        cmd += ["--mmproj", c.mmproj] + (["--no-mmproj-offload"] if c.no_mmproj_offload else [])
    else:
        cmd += ["--no-warmup"]
    if c.n_ctx is not None:
        cmd += ["-c", str(c.n_ctx)]
    if c.n_batch is not None:
        cmd += ["-b", str(c.n_batch)]
    if c.n_ubatch is not None:
        cmd += ["-ub", str(c.n_ubatch)]
    if c.type_k != "f16":
        cmd += ["-ctk", c.type_k]
    if c.type_v != "f16":
        cmd += ["-ctv", c.type_v]
    if c.flash_attn != "auto":
        cmd += ["-fa", c.flash_attn]
    if c.n_parallel is not None:
        cmd += ["-np", str(c.n_parallel)]
    if c.kv_unified is not None:
        cmd += ["--kv-unified" if c.kv_unified else "--no-kv-unified"]
    if c.swa_full:
        cmd += ["--swa-full"]
    if c.n_gpu_layers != -1:
        cmd += ["-ngl", str(c.n_gpu_layers)]
    for group in c.placement_args():  # -ot, --cpu-moe, --n-cpu-moe, -nkvo, --no-op-offload, -sm, -mg, -ts
        cmd += group
    if c.no_mmap:
        cmd += ["-lm", "none"]  # the pinned build spells --no-mmap as --load-mode none
    cmd += ["--repack" if use_extra_bufts else "--no-repack"]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    if c.embeddings:
        cmd += ["--embeddings"]
    if c.spec_type != "none":
        cmd += ["--spec-type", c.spec_type, "--spec-draft-n-max", str(c.draft_n_max)]
        if c.draft_model:
            cmd += ["-md", c.draft_model]
        if c.draft_type_k != "f16":
            cmd += ["-ctkd", c.draft_type_k]
        if c.draft_type_v != "f16":
            cmd += ["-ctvd", c.draft_type_v]
        if n_min is not None:
            cmd += ["--spec-draft-n-min", str(n_min)]
        if p_min is not None:
            cmd += ["--spec-draft-p-min", str(p_min)]
    cmd += list(extra_args or [])
    return cmd


class HTTPFailure(Exception):
    def __init__(self, status: int | None, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class LlamaServer:
    """One llama-server process for one probe.

    Budget: with `as_limit` the server runs under RLIMIT_AS (set between fork and exec) and with
    MALLOC_ARENA_MAX=1. The caller adds `server_as_allowance()` to the budget: unlike the python runner
    (whose baseline is measured right before the load), the server's own address space before it loads the
    model (binary, thread stacks) cannot be measured from outside in time, so a formula fitted to
    measurements stands for it, erring ~50 MiB on the generous side; the server's budget is therefore a
    coarser bound than the python runner's.
    """

    def __init__(self, cmd: list[str], *, port: int, env: dict[str, str] | None = None, as_limit: int | None = None):
        self.cmd = cmd
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        e = dict(os.environ if env is None else env)
        e.setdefault("GGML_NO_BACKTRACE", "1")
        if as_limit is not None:
            e.update(BUDGET_ENV)
        self.proc = Proc(cmd, env=e, merge_stderr=True, as_limit=as_limit)

    @property
    def log(self) -> str:
        return "\n".join(self.proc.lines)

    def request(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=max(0.05, timeout)) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                msg = json.loads(raw).get("error", {}).get("message") or raw.decode("utf-8", "replace")
            except (ValueError, AttributeError):
                msg = raw.decode("utf-8", "replace")
            raise HTTPFailure(e.code, msg.strip()) from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, http.client.HTTPException) as e:
            raise HTTPFailure(None, f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None

    def wait_healthy(self, deadline: float) -> bool:
        """Poll /health until it answers 200 (True), the server exits or the deadline passes (False)."""
        while time.perf_counter() < deadline:
            if not self.proc.alive:
                return False
            try:
                r = self.request("GET", "/health", None, min(2.0, deadline - time.perf_counter()))
                if r.get("status") == "ok":
                    return True
            except HTTPFailure:
                pass  # 503 while loading, connection refused before listen()
            self.proc.exited.wait(0.02)
        return False

    def stop(self) -> None:
        self.proc.stop()


_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ ([A-Z]) (.*)$")
_TAG = re.compile(r"^(\w{1,6})\s+(\S+:.*)$")


def split_log_line(line: str) -> tuple[str | None, str]:
    """llama-server's `0.00.938.721 W spec common_specu: message` -> ("W", "common_specu: message").

    The level letter is None for lines printed without the log prefix (e.g. argument errors)."""
    line = line.strip()
    m = _PREFIX.match(line)
    if not m:
        return None, line
    level, rest = m.group(1), m.group(2).strip()
    t = _TAG.match(rest)
    if t and not t.group(1).endswith(":"):
        rest = t.group(2)
    return level, rest


def server_devices(binary: str, timeout: float = 60) -> list[str] | None:
    """`llama-server --list-devices`: the accelerator devices of this build ([] for a CPU-only build, None if unknown)."""
    r = _ask_binary(binary, "--list-devices", timeout)
    if r is None or r.returncode != 0 or "Available devices" not in r.stdout + r.stderr:
        return None
    lines = (r.stdout + r.stderr).split("Available devices:", 1)[1].splitlines()
    return [ln.strip() for ln in lines if ln.strip() and ln.strip() != "(none)"]


def _ask_binary(binary: str, flag: str, timeout: float) -> subprocess.CompletedProcess[str] | None:
    """`binary flag`, run once per binary path and modification time (None when it cannot run)."""
    try:
        st = os.stat(binary)
    except OSError:
        return None
    return _ask_binary_cached(binary, flag, st.st_mtime_ns, timeout)


@functools.lru_cache(maxsize=16)
def _ask_binary_cached(binary: str, flag: str, _mtime: int, timeout: float) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run([binary, flag], capture_output=True, text=True, timeout=timeout,
                              preexec_fn=child_preexec())
    except (OSError, subprocess.TimeoutExpired):
        return None


_VERSION = re.compile(r"build (\d+), commit ([0-9a-f]+|unknown)\)")


def parse_build(version_text: str | None, log: str = "") -> dict[str, str | None]:
    """The commit and compiler from `llama-server --version`, the CPU features from the log's `system_info:` line."""
    out: dict[str, str | None] = {"ggml_commit": None, "llama_version": None, "system_info": None}
    if version_text:
        m = _VERSION.search(version_text)
        if m:
            out["ggml_commit"] = m.group(2)
        out["llama_version"] = " ".join(version_text.split())
    for line in log.splitlines():
        i = line.find("system_info:")
        if i >= 0:
            out["system_info"] = line[i + len("system_info:"):].strip()
            break
    return out


def server_version(binary: str, timeout: float = 30) -> str | None:
    """`llama-server --version` (cached per binary path and modification time)."""
    r = _ask_binary(binary, "--version", timeout)
    return ((r.stdout + r.stderr).strip() or None) if r is not None else None


