"""`ggfit fit`'s session (issue 48): what llama-server holds after load over a session of requests (its host prompt
cache and context checkpoints, fitter.session.server), its ceiling, whether that still fits what the load leaves, and
caps that make it fit with what they cost. fitter.fit.plan.plan() adds it to the plan (Plan.session) when the request
asks (FitRequest.session); cli_fit prints `FitSession.lines()` and `as_json()`."""

from __future__ import annotations

from typing import Any

from fitter.llama.cparams import ConfigError
from fitter.record import Record
from fitter.session.server import MIB, CacheFlags, ServerSession, host_on_budget, server_session


class SessionAsk(Record):
    """The session `fit` shows: llama-server's cache flags, and N requests of P prompt + G generated tokens."""

    flags: CacheFlags = CacheFlags()
    requests: int = 100
    prompt: int | None = None  # None: 4096, at most the slot's context less `gen`
    gen: int = 256


def _mib(b: float) -> str:
    return f"{b / MIB:,.0f} MiB" if b >= 10 * MIB else f"{b / MIB:,.1f} MiB"


class Proposal(Record):
    flags: list[str]
    ceiling_bytes: int
    cost: str


class FitSession(Record, frozen=False):
    session: ServerSession
    requests: int
    where: str  # what the session counts against: "budget" (CPU, Metal's unified memory) or "host" (next to a GPU)
    headroom_bytes: int | None  # left by the load in that budget (None: no such budget)
    proposals: list[Proposal]

    @property
    def at_n(self) -> int:
        return self.session.points[-1].bytes if self.session.points else 0

    @property
    def fits(self) -> bool | None:
        return None if self.headroom_bytes is None else self.session.ceiling_bytes <= self.headroom_bytes

    def as_json(self) -> dict[str, Any]:
        s = self.session
        return {"prompt_tokens": s.prompt_tokens, "gen_tokens": s.gen_tokens, "n_slots": s.n_slots,
                "kv_unified": s.kv_unified, "flags": s.flags.model_dump(mode="json"), "state_bytes": s.state_bytes,
                "checkpoint_bytes": s.checkpoints, "entry_bytes": s.entry_bytes, "requests": self.requests,
                "after_requests_bytes": self.at_n, "points": [p.model_dump(mode="json") for p in s.points],
                "ceiling_bytes": s.ceiling_bytes, "ceiling_entries": s.limit.cache_entries,
                "allocator_bytes": s.allocator_bytes, "counts_against": self.where,
                "headroom_bytes": self.headroom_bytes, "fits": self.fits,
                "proposals": [p.model_dump(mode="json") for p in self.proposals]}

    def lines(self) -> list[str]:
        """`fit`'s session line, and a line per proposed cap."""
        s, f = self.session, self.session.flags
        cap = {0: "off", -1: "no size limit"}.get(f.cache_ram_mib, f"{f.cache_ram_mib:,} MiB")
        ckpt = f"{len(s.checkpoints)} checkpoint(s) of {_mib(max(s.checkpoints))}" if s.checkpoints else "no checkpoints"
        out = [f"session  llama-server, prompts of {s.prompt_tokens:,} + {s.gen_tokens:,} tokens (--cache-ram {cap}, "
               f"{s.n_slots} slots): each saved prompt {_mib(s.entry_bytes)} (state {_mib(s.state_bytes)}, {ckpt}); "
               f"host memory after {self.requests} requests {_mib(self.at_n)}, ceiling {_mib(s.ceiling_bytes)} "
               f"({s.limit.cache_entries} prompts cached)" + self._verdict()]
        return out + [f"         to fit: {' '.join(p.flags)} -> ceiling {_mib(p.ceiling_bytes)}; cost: {p.cost}"
                      for p in self.proposals]

    def _verdict(self) -> str:
        if self.headroom_bytes is None:
            return ""
        where = "the budget" if self.where == "budget" else "the host budget"
        if self.headroom_bytes < 0:
            return f"; the load alone is over {where}"
        return (f"; fits the {_mib(self.headroom_bytes)} {where} leaves after load" if self.fits
                else f"; does NOT fit the {_mib(self.headroom_bytes)} {where} leaves after load")


def _proposals(spec: Any, cp: Any, s: ServerSession, headroom: int, run) -> list[Proposal]:
    """Caps that bring the ceiling within `headroom`: the largest --cache-ram that does, else --cache-ram 0, then
    --ctx-checkpoints 1 when the slots' own checkpoints are still too many."""
    f = s.flags
    live = s.limit.checkpoint_bytes + s.allocator_bytes
    cap = (headroom - live) // MIB
    out: list[Proposal] = []
    if f.cache_ram_mib != 0 and cap * MIB >= s.entry_bytes:
        t = run(f.model_copy(update={"cache_ram_mib": int(cap)}))
        if t.ceiling_bytes <= headroom:
            kept = t.limit.cache_entries
            return [Proposal(flags=["--cache-ram", str(int(cap))], ceiling_bytes=t.ceiling_bytes,
                             cost=f"keeps the {kept} most recent prompts (of {s.limit.cache_entries}): an older "
                                  f"prompt that returns is processed again ({s.prompt_tokens:,} tokens)")]
    off = f.model_copy(update={"cache_ram_mib": 0})
    t = run(off)
    out.append(Proposal(flags=["--cache-ram", "0"], ceiling_bytes=t.ceiling_bytes,
                        cost=f"no prompt cache: a prompt not in one of the {s.n_slots} slots is processed again "
                             f"({s.prompt_tokens:,} tokens)"))
    if t.ceiling_bytes > headroom and s.checkpoints:
        one = run(off.model_copy(update={"ctx_checkpoints": 1}))
        out.append(Proposal(flags=["--cache-ram", "0", "--ctx-checkpoints", "1"], ceiling_bytes=one.ceiling_bytes,
                            cost="one checkpoint per slot: a prompt that diverges before the slot's last checkpoint "
                                 "is processed again from its start"))
    return out


def session_of(r: Any, ask: SessionAsk) -> FitSession | None:
    """fit's session for plan `r` (fitter.fit.plan.Plan; llama-server frontend only), against the budget (CPU, Metal:
    one memory) or the host budget (next to a discrete GPU, when there is one)."""
    flags, requests, prompt, gen = ask.flags, ask.requests, ask.prompt, ask.gen
    if r.fe.value != "server" or r.pred is None:
        return None
    cp = r.pred.context
    if prompt is None and gen >= cp.n_ctx_seq:  # a slot smaller than the default request: half prompt, half output
        gen = max(1, cp.n_ctx_seq // 2)
    p = prompt if prompt is not None else max(1, min(4096, cp.n_ctx_seq - gen))
    if p + gen > cp.n_ctx_seq:  # llama-server refuses such a request ("exceeds the available context size")
        raise ConfigError(f"--session-prompt {p} + --session-gen {gen} exceed a slot's context "
                          f"(n_ctx_seq = {cp.n_ctx_seq})")

    dcp = r.pred.draft_context
    draft = None if dcp is None else (r.spec, dcp, True) if r.cfg.spec_type == "draft-mtp" else (r.draft[1], dcp, False)

    sizes: dict[tuple[int, bool], int] = {}  # the states' and checkpoints' bytes, the same for every run's flags

    def run(fl: CacheFlags, n_requests: tuple[int, ...] = ()) -> ServerSession:
        """The session with these flags: its points after n_requests (none for a proposed cap: only its ceiling,
        a closed form, is printed)."""
        return server_session(r.spec, cp, p, gen, list(n_requests), fl, draft=draft, sizes=sizes)

    s = run(flags, (requests,))
    if not host_on_budget(r.be):
        where = "host"
        headroom = None if r.host is None or r.host_avail is None else r.host_avail - r.pred.host_bytes
    else:
        where = "budget"
        b = r.budgets
        headroom = b.available - r.pred.total_device_bytes if not b.per_device else None
    props = _proposals(r.spec, cp, s, headroom, run) if headroom is not None and 0 <= headroom < s.ceiling_bytes else []
    return FitSession(session=s, requests=requests, where=where, headroom_bytes=headroom, proposals=props)
