"""The openai runner: probe any OpenAI-compatible server the user runs, at --url (llama-server,
mlx_lm.server, mlx_vlm.server, vllm-mlx, Rapid-MLX, mlx-serve).

Each request is a streamed `/v1/chat/completions` (temperature 0, `stream_options.include_usage`,
reasoning off through `chat_template_kwargs.enable_thinking = false` where the template reads it).
From the stream: time to first token (the first delta with text or reasoning), and from the usage
counts the server reports, at each context depth (filler text placed before the question, as llama-benchy
does) and with N concurrent clients (each sending `repeats` requests one after the other):

- prefill tok/s (per request) = prompt_tokens / TTFT; the median over the requests;
- decode tok/s per request = (completion_tokens - 1) / (last token - first token): the first token comes
  with the prefill; the median over the requests;
- decode tok/s of all clients together = every request's (completion_tokens - 1) / the time during which
  at least one request was decoding (the union of their first-to-last-token spans). At concurrency 1 it
  is the same measure as per request, over all requests at once; with N clients it is the server's
  aggregate decode rate;
- end to end tok/s = every request's completion_tokens / the level's wall time, prefill and TTFT
  included: what a user waiting on the whole answer sees (below the decode rates whenever prefill takes
  time, even at concurrency 1).

With a `progress` (fitter.progress.Progress: stderr) each warm-up, level, request and soak step is reported as it
happens.

Memory: with the server's pid (`--pid`, or known because ggfit started it), its process group's RSS
from /proc before, during (sampled) and after the requests. `--soak N` sends N requests one after the
other and reports the growth of the RSS after each: `growing` when it keeps rising (the ratchet of a
leaking server), else `flat`.

`warmup` requests (default 1) go first and are not measured.

A server that drops the connection is a crash when its pid is known and gone (else an error); one
that stops answering past --timeout is a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from fitter.progress import Progress
from search.errors import ProbeError
from search.soak import Soak, soak_verdict
from search.workload import corpus

Status = Literal["ok", "crash", "timeout", "error"]
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RequestSample(BaseModel):
    depth: int
    client: int
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float
    prefill_tps: float | None
    decode_tps: float | None
    decode_from_s: float = 0.0  # first token, seconds after the level started
    decode_to_s: float = 0.0  # last token, seconds after the level started


class Level(BaseModel):
    """One context depth x concurrency: per-request medians and the rates of all clients together (the module's
    docstring defines each)."""

    depth: int
    concurrency: int
    requests: list[RequestSample]
    ttft_s: float
    prefill_tps: float | None
    decode_tps: float | None  # per request: (completion tokens - 1) / first-to-last-token time, median
    total_decode_tps: float  # all clients: decoded tokens / time at least one request was decoding
    end_to_end_tps: float = 0.0  # all clients: completion tokens / wall time of the level (prefill included)
    wall_s: float


class Memory(BaseModel):
    before: int | None = None
    peak: int | None = None
    after: int | None = None


class OpenAIProbeResult(BaseModel):
    status: Status
    message: str | None = None
    url: str
    model: str | None = None
    levels: list[Level] = Field(default_factory=list)
    memory: Memory = Field(default_factory=Memory)
    soak: Soak | None = None
    pid: int | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def summary(self) -> str:
        if not self.ok:
            return f"{self.status}: {self.message or ''}"
        parts = []
        for lv in self.levels:
            pre = f"{lv.prefill_tps:.1f}" if lv.prefill_tps else "-"
            dec = f"{lv.decode_tps:.1f}" if lv.decode_tps else "-"
            parts.append(f"depth {lv.depth} x{lv.concurrency}: prefill {pre} tok/s, decode {dec} tok/s per request, "
                         f"{lv.total_decode_tps:.1f} tok/s all clients together, {lv.end_to_end_tps:.1f} tok/s end to "
                         f"end, TTFT {lv.ttft_s * 1e3:.0f} ms")
        m = self.memory
        if m.before is not None:
            parts.append(f"server RSS {m.before / 2**20:.0f} -> peak {(m.peak or 0) / 2**20:.0f} -> "
                         f"{(m.after or 0) / 2**20:.0f} MiB")
        if self.soak:
            parts.append(self.soak.line())
        return "ok: " + "; ".join(parts) + "\n" + RATES_TEXT


RATES_TEXT = ("  (prefill = prompt tokens / TTFT; decode = (completion tokens - 1) / first-to-last-token time, "
              "the median request; all clients together = every request's decoded tokens / the time any was "
              "decoding; end to end = completion tokens / wall time, prefill included)")


class _Failed(Exception):
    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def group_rss(pid: int) -> int | None:
    """RSS of `pid` and every process of its process group (a server's workers), from /proc."""
    try:
        pgid = os.getpgid(pid)
    except (ProcessLookupError, PermissionError, OSError):
        return None
    total, found = 0, False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(entry) != pid and int(fields[2]) != pgid:  # field 5: pgrp
                continue
            with open(f"/proc/{entry}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
            found = True
        except (OSError, IndexError, ValueError):
            continue
    return total if found else None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (our own unreaped child) is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class OpenAIProbe:
    url: str
    model: str | None = None
    prompt_tokens: int = 128  # the question's length, in the server's tokens (approximately: text is cut by chars)
    gen_tokens: int = 32
    depths: tuple[int, ...] = (0,)
    concurrency: tuple[int, ...] = (1,)
    repeats: int = 1
    timeout: float = 300.0
    pid: int | None = None
    soak: int = 0
    reasoning: bool = False
    chars_per_token: float = 4.0
    warmup: int = 1  # requests sent first and not measured (a server's first request pays its lazy setup)
    progress: Progress | None = None  # where each step is reported as it happens (stderr)

    def _text(self, n_tokens: int, seed: int) -> str:
        text = corpus("prose")
        n = max(1, int(n_tokens * self.chars_per_token))
        start = (seed * 7919) % max(1, len(text) - n)
        return text[start: start + n]

    def _request(self, depth: int, seed: int, client: int, deadline: float, t_ref: float | None = None) -> RequestSample:
        """One streamed request; `t_ref`: the level's start (the sample's decode span is given from it)."""
        msgs = []
        if depth:
            msgs.append({"role": "system", "content": self._text(depth, seed + 100_003)})
        msgs.append({"role": "user", "content": self._text(self.prompt_tokens, seed)})
        body: dict[str, Any] = {"messages": msgs, "max_tokens": self.gen_tokens, "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if not self.reasoning:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        req = urllib.request.Request(self.url.rstrip("/") + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        t0 = time.perf_counter()
        t_first = t_last = None
        usage: dict[str, Any] = {}
        n_chunks = 0
        try:
            with urllib.request.urlopen(req, timeout=max(0.1, deadline - t0)) as r:
                for raw in r:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    ev = json.loads(data)
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev.get("choices") or []:
                        d = ch.get("delta") or {}
                        if d.get("content") or d.get("reasoning_content") or d.get("reasoning"):
                            now = time.perf_counter()
                            t_first = t_first or now
                            t_last = now
                            n_chunks += 1
                    if time.perf_counter() > deadline:
                        raise _Failed("timeout", f"no end of the response within {self.timeout:g} s")
        except urllib.error.HTTPError as e:
            raise _Failed("error", f"HTTP {e.code}: {e.read()[:300].decode('utf-8', 'replace')}") from None
        except (socket.timeout, TimeoutError):
            raise _Failed("timeout", f"the server stopped answering ({self.timeout:g} s)") from None
        except (urllib.error.URLError, ConnectionError, OSError, ValueError) as e:
            raise self._dropped(e) from None
        if t_first is None:
            if not _alive(self.pid):
                raise _Failed("crash", "the server died during the request")
            raise _Failed("error", "the stream ended without a token")
        t_end = time.perf_counter()
        pt = int(usage.get("prompt_tokens") or 0)
        ct = int(usage.get("completion_tokens") or n_chunks)
        ttft = t_first - t0
        dec_s = (t_last or t_first) - t_first
        ref = t0 if t_ref is None else t_ref
        return RequestSample(depth=depth, client=client, prompt_tokens=pt, completion_tokens=ct, ttft_s=ttft,
                             total_s=t_end - t0, prefill_tps=pt / ttft if pt and ttft > 0 else None,
                             decode_tps=(ct - 1) / dec_s if ct > 1 and dec_s > 0 else None,
                             decode_from_s=t_first - ref, decode_to_s=(t_last or t_first) - ref)

    def _dropped(self, e: BaseException) -> _Failed:
        reason = getattr(e, "reason", e)
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return _Failed("timeout", f"the server stopped answering ({self.timeout:g} s)")
        time.sleep(0.2)  # a dying server: give it the time to be gone
        if self.pid is not None and not _alive(self.pid):
            return _Failed("crash", f"the server died during the request ({type(e).__name__}: {reason})")
        return _Failed("error", f"{type(e).__name__}: {reason}")

    def _level(self, depth: int, conc: int, seed: int, deadline: float) -> Level:
        samples: list[RequestSample] = []
        errors: list[_Failed] = []
        lock = threading.Lock()

        total = conc * self.repeats
        where = f"depth {depth} x{conc}"

        def client(i: int) -> None:
            for rep in range(self.repeats):
                try:
                    s = self._request(depth, seed + i * 1000 + rep, i, deadline, t0)
                except _Failed as f:
                    with lock:
                        errors.append(f)
                    return
                with lock:
                    samples.append(s)
                    n = len(samples)
                dec = f"{s.decode_tps:.1f}" if s.decode_tps else "-"
                self._say(f"{where}: request {n} of {total} done: TTFT {s.ttft_s * 1e3:.0f} ms, decode {dec} tok/s")

        self._say(f"{where}: {conc} client{'s' if conc > 1 else ''}, {self.repeats} request"
                  f"{'s' if self.repeats > 1 else ''} each")
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(conc)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.1, deadline - time.perf_counter()) + 5)
        wall = time.perf_counter() - t0
        if errors:
            raise min(errors, key=lambda f: ("crash", "timeout", "error").index(f.status))
        if any(t.is_alive() for t in threads):
            raise _Failed("timeout", f"a client was still waiting after {self.timeout:g} s")
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        decoding = _union([(s.decode_from_s, s.decode_to_s) for s in samples if s.completion_tokens > 1])
        decoded = sum(s.completion_tokens - 1 for s in samples if s.completion_tokens > 1)
        return Level(depth=depth, concurrency=conc, requests=samples, ttft_s=med([s.ttft_s for s in samples]) or 0.0,
                     prefill_tps=med([s.prefill_tps for s in samples if s.prefill_tps]),
                     decode_tps=med([s.decode_tps for s in samples if s.decode_tps]),
                     total_decode_tps=decoded / decoding if decoding > 0 else 0.0,
                     end_to_end_tps=sum(s.completion_tokens for s in samples) / wall if wall > 0 else 0.0, wall_s=wall)

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.stage(text)

    def run(self) -> OpenAIProbeResult:
        if not self.url.startswith(("http://", "https://")):
            raise ProbeError(f"--url {self.url}: use an http:// or https:// address")
        for flag, v in (("--prompt-tokens", self.prompt_tokens), ("--gen-tokens", self.gen_tokens),
                        ("--repeats", self.repeats)):
            if v < 1:
                raise ProbeError(f"{flag} {v}: must be at least 1")
        if any(d < 0 for d in self.depths) or any(c < 1 for c in self.concurrency) or self.soak < 0 or self.warmup < 0:
            raise ProbeError("--depth must be 0 or more, --concurrency 1 or more, --soak 0 or more")
        if self.pid is not None and (self.pid <= 0 or not _exists(self.pid)):
            raise ProbeError(f"--pid {self.pid}: no such process (the server's pid, for its memory)")
        res = OpenAIProbeResult(status="ok", url=self.url, model=self.model, pid=self.pid)
        t0 = time.perf_counter()
        deadline = t0 + self.timeout
        stop = threading.Event()
        peak = [0]

        def sample() -> None:
            while not stop.wait(0.05):
                v = group_rss(self.pid) if self.pid else None
                if v:
                    peak[0] = max(peak[0], v)

        sampler = threading.Thread(target=sample, daemon=True)
        if self.pid:
            res.memory.before = group_rss(self.pid)
            peak[0] = res.memory.before or 0
            sampler.start()
        try:
            for i in range(self.warmup):
                self._say(f"warm-up request {i + 1} of {self.warmup} (not measured)")
                self._request(0, 900_000 + i, 0, deadline)
            seed = 1
            for depth in self.depths:
                for conc in self.concurrency:
                    res.levels.append(self._level(depth, conc, seed, deadline))
                    seed += 10_000
            if self.soak:
                after = []
                for i in range(self.soak):
                    self._request(0, 500_000 + i, 0, deadline)
                    if self.pid:
                        after.append(group_rss(self.pid) or 0)
                    rss = f": server RSS {after[-1] / 2**20:,.0f} MiB" if self.pid else ""
                    self._say(f"soak request {i + 1} of {self.soak} done{rss}")
                res.soak = soak_verdict(self.soak, after)
        except _Failed as f:
            res.status, res.message = f.status, f.message
        finally:
            stop.set()
            if sampler.is_alive():
                sampler.join(1)
            if self.pid:
                res.memory.after = group_rss(self.pid)
                res.memory.peak = max(peak[0], res.memory.after or 0) or None
            res.wall_s = time.perf_counter() - t0
        return res


def _exists(pid: int) -> bool:
    """Whether process `pid` exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: beyond pid_t
        return False
    except PermissionError:
        return True
    return True


def _union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end] spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
