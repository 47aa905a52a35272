"""The pinned llama-server with --mmproj, started as ggfit's probe starts it, reserves the projector's compute buffer
that ggfit predicts (its own "reserve_compute_meta: CPU compute buffer size" line, -v)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

from fitter.bundled import resolve_model
from fitter.fit.memory import predict
from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import RunConfig
from fitter.llama.model import load_model_spec
from search.server import server_command
from tests.synth.mmproj import build_mmproj

M = "gemma3-270m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_llama_server_reserves_the_predicted_compute_buffer(llama_server: str, tmp_path) -> None:
    mm = str(build_mmproj("gemma3", proj_dim=640, pos_f32=True))  # 640: the text model's n_embd (mtmd checks it)
    cfg = RunConfig(n_ctx=2048, mmproj=mm)
    cmd = server_command(llama_server, resolve_model(M), cfg, port=_free_port(), threads=2, use_extra_bufts=False)
    # clip reserves its compute buffer in its warmup only: the probe must not pass --no-warmup with a projector
    assert cmd[cmd.index("--mmproj") + 1] == mm and "--no-warmup" not in cmd
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([*cmd, "-v"], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        line = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"reserve_compute_meta: +(\S+) compute buffer size = +([\d.]+) MiB", log.read_text())
            if m:
                line = (m[1], float(m[2]))
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert line is not None, log.read_text()[-3000:]
    header, spec = load_model_spec(resolve_model(M))
    rows = [b for b in predict(header, spec, cfg, Backend.CPU).buffers if b.owner == "mmproj" and b.kind == "compute"]
    assert [(b.device, round(b.bytes / 2**20, 2)) for b in rows] == [line]
