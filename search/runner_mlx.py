"""The mlx runner: ggfit starts `mlx_lm.server` itself on 127.0.0.1 with a trial's flags, proves it
with the openai runner's streamed requests (the same measurement as any OpenAI-compatible server),
and stops it: the server's whole process group goes, also on timeout, crash or Ctrl-C (search.server.Proc).

`served_probe` does the same for any server command, so that llama-server and mlx_lm.server are
measured the same way in an engine comparison.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from fitter.mlx import require_mlx_lm
from fitter.progress import Progress
from search.runner_openai import OpenAIProbe, OpenAIProbeResult
from search.server import Proc, free_port


@dataclass(frozen=True)
class MlxFlags:
    """mlx_lm.server's flags a trial may set (mlx-lm 0.32.2, server.py's argument parser)."""

    prefill_step_size: int = 2048
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000
    max_tokens: int = 512
    prompt_cache_bytes: int | None = None
    draft_model: str | None = None
    num_draft_tokens: int | None = None
    extra_args: tuple[str, ...] = ()  # further mlx_lm.server flags, verbatim

    def args(self) -> list[str]:
        a = ["--prefill-step-size", str(self.prefill_step_size), "--max-tokens", str(self.max_tokens)]
        if self.kv_bits is not None:
            a += ["--kv-bits", str(self.kv_bits), "--kv-group-size", str(self.kv_group_size),
                  "--quantized-kv-start", str(self.quantized_kv_start)]
        if self.prompt_cache_bytes is not None:
            a += ["--prompt-cache-bytes", str(self.prompt_cache_bytes)]
        if self.draft_model:
            a += ["--draft-model", self.draft_model]
            if self.num_draft_tokens is not None:
                a += ["--num-draft-tokens", str(self.num_draft_tokens)]
        return a + list(self.extra_args)


def mlx_server_command(model_dir: str, flags: MlxFlags, port: int) -> list[str]:
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
            *flags.args()]


def _healthy(proc: Proc, port: int, deadline: float) -> bool:
    while time.perf_counter() < deadline:
        if not proc.alive:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        proc.exited.wait(0.1)
    return False


def served_probe(command: Callable[[int], list[str]], probe: Callable[[str, int], OpenAIProbe], timeout: float,
                 name: str, progress: Progress | None = None) -> tuple[OpenAIProbeResult, list[str]]:
    """Start `command(port)` in its own process group, wait for /health, run `probe(url, pid)`, stop the group.
    A server that exits before it is healthy is a crash; one not healthy within `timeout` a timeout. `progress`
    hears the start, the wait and the stop."""
    say = progress.stage if progress is not None else (lambda text: None)
    port = free_port()
    cmd = command(port)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    say(f"starting {name} on 127.0.0.1:{port}, waiting for /health (up to {timeout:g} s)")
    proc = Proc(cmd, merge_stderr=True)
    try:
        if not _healthy(proc, port, t0 + timeout):
            last = " | ".join(ln.strip() for ln in proc.lines[-3:] if ln.strip())
            status = "timeout" if proc.alive else "crash"
            msg = (f"{name} not ready after {timeout:g} s" if proc.alive
                   else f"{name} exited with status {proc.returncode} while loading: {last}")
            return OpenAIProbeResult(status=status, message=msg, url=url, pid=proc.pid), cmd
        say(f"{name} ready after {time.perf_counter() - t0:.1f} s")
        left = max(1.0, timeout - (time.perf_counter() - t0))
        p = probe(url, proc.pid)
        p.timeout = left
        res = p.run()
    except BaseException:
        proc.kill()
        raise
    finally:
        if proc.alive:
            say(f"stopping {name}")
        proc.stop()
    return res, cmd


def mlx_probe(model_dir: str, flags: MlxFlags, probe: Callable[[str, int], OpenAIProbe], *,
              timeout: float = 300.0, progress: Progress | None = None) -> tuple[OpenAIProbeResult, list[str]]:
    """mlx_lm.server with `flags`, proven by the openai runner. Without mlx-lm: one clear GGFitError."""
    require_mlx_lm()
    return served_probe(lambda port: mlx_server_command(model_dir, flags, port), probe, timeout, "mlx_lm.server",
                        progress)
