"""`probe --soak N`: N more requests, one after another, and the server's memory growth after each; with the server
runner (ggfit starts llama-server, so it knows the model and the flags) the predicted session beside it
(fitter.session.server: the host prompt cache and context checkpoints after that many requests, and the ceiling).

The server runner's soak prompts are distinct random tokens (no shared prefix), as fitter.session models a session
and benchmarks/session_here.py measured it; the workload's own requests before them count as requests of the same
length.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable, Literal

from pydantic import BaseModel

SOAK_GROWTH_MIN = 32 * 2**20  # below this, RSS moves are allocator noise, not a ratchet
MIB = 2**20


class Soak(BaseModel):
    requests: int
    rss_after: list[int]  # the server's RSS after each request
    growth_bytes: int  # last - first
    verdict: Literal["growing", "flat"]
    # fitter.session's prediction (server runner only; None: not predicted): the host memory llama-server holds
    # beyond its load after the session's requests (the workload's and the soak's), its growth over the soak (after
    # the first soak request to after the last, as growth_bytes), and the ceiling however many requests come
    predicted_after_bytes: int | None = None
    predicted_growth_bytes: int | None = None
    predicted_ceiling_bytes: int | None = None

    def line(self) -> str:
        out = f"soak {self.requests} requests: {self.verdict} ({self.growth_bytes / MIB:+.0f} MiB)"
        if self.predicted_ceiling_bytes is not None:
            out += (f", predicted {(self.predicted_growth_bytes or 0) / MIB:+.0f} MiB over the soak, "
                    f"{(self.predicted_after_bytes or 0) / MIB:.0f} MiB held after it, "
                    f"ceiling {self.predicted_ceiling_bytes / MIB:.0f} MiB")
        return out


def soak_verdict(n: int, after: list[int]) -> Soak:
    """growing: the RSS after the last requests is above the first by more than noise, and it rose through the
    run (the median of the second half above that of the first half)."""
    if len(after) < 2:
        return Soak(requests=n, rss_after=after, growth_bytes=0, verdict="flat")
    growth = after[-1] - after[0]
    half = len(after) // 2
    rising = statistics.median(after[half:]) - statistics.median(after[:half]) > SOAK_GROWTH_MIN / 2
    verdict: Literal["growing", "flat"] = "growing" if growth > SOAK_GROWTH_MIN and rising else "flat"
    return Soak(requests=n, rss_after=after, growth_bytes=growth, verdict=verdict)


def cache_flags(args: list[str]):
    """The session flags (--cache-ram, --ctx-checkpoints, ...) among llama-server flags ggfit passes as they are;
    None when one has a value that is not a number (llama-server refuses it itself)."""
    from fitter.session.router import PresetError, session_flags

    words: list[str] = []
    for a in args:  # --flag=value as llama-server reads it
        words += a.split("=", 1) if a.startswith("--") and "=" in a else [a]
    try:
        return session_flags(words)
    except PresetError:
        return None


def predict_soak(model_path: str, config, extra_args: list[str], prompt: int, gen: int, before: int,
                 n: int) -> dict[str, int] | None:
    """fitter.session's prediction for `before` requests then `n` soak requests of `prompt` + `gen` tokens; None
    when ggfit cannot predict this config. The context comes from the CPU backend's prediction: the session's
    state is copied to host memory whatever the device, and its size follows the context (n_ctx, slots)."""
    from fitter.errors import GGFitError
    from fitter.fit.memory import predict
    from fitter.ggml.backends import Backend
    from fitter.llama.model import load_model_spec
    from fitter.session.server import server_session

    flags = cache_flags(extra_args)
    if flags is None:
        return None
    try:
        header, spec = load_model_spec(model_path)
        cp = predict(header, spec, config, Backend.CPU).context
        first, last = before + 1, before + n
        s = server_session(spec, cp, prompt, gen, [first, last], flags)
    except GGFitError:
        return None
    at = {p.requests: p.bytes for p in s.points}
    return {"predicted_after_bytes": at[last], "predicted_growth_bytes": at[last] - at[first],
            "predicted_ceiling_bytes": s.ceiling_bytes}


def server_soak(request: Callable[[dict[str, Any]], Any], rss: Callable[[], int | None], n: int, n_vocab: int,
                prompt: int, gen: int, say: Callable[[str], None], seed: int = 48) -> Soak:
    """N completions of distinct random token prompts (`request`: POST /completion with this body), the server's
    RSS after each."""
    rng = random.Random(seed)
    after: list[int] = []
    for i in range(n):
        tokens = [rng.randrange(min(100, n_vocab - 1), n_vocab) for _ in range(prompt)]
        request({"prompt": tokens, "n_predict": gen, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
                 "stream": False, "return_tokens": False})
        time.sleep(0.05)  # the idle-slot save runs as the next task starts; the slot's release settles first
        after.append(rss() or 0)
        say(f"soak request {i + 1} of {n} done: server RSS {after[-1] / MIB:,.0f} MiB")
    return soak_verdict(n, after)
