"""`fit --engine mlx`'s session lines and JSON: the peak after --session-requests requests of one -c, the limit
as requests grow, what caps it and, when it does not fit, the --prompt-cache-bytes that does (fitter.mlx.session_fit)."""

from __future__ import annotations

from fitter.errors import GGFitError
from fitter.mlx.config import MlxModel
from fitter.mlx.memory import MlxRun
from fitter.mlx.session import CPU_CACHE_LIMIT
from fitter.mlx.session_fit import CacheProposal, SessionCeiling, propose_cap, session_ceiling


def _mib(b: int) -> str:
    return f"{b / 2**20:,.1f} MiB"


def mlx_session(model: MlxModel, run: MlxRun, draft: MlxModel | None, available: int, *, requests: int | None,
                prompt_cache_size: int) -> tuple[SessionCeiling, CacheProposal | None, bool]:
    """(the ceiling, a proposal when its limit is over `available`, whether the session fits)."""
    if requests is not None and requests < 1:
        raise GGFitError(f"--session-requests {requests}: must be at least 1")
    c = session_ceiling(model, run, draft, requests=requests, prompt_cache_size=prompt_cache_size)
    worst = c.peak_bytes if requests else c.limit_bytes
    proposal = None
    if c.limit_bytes > available:
        proposal = propose_cap(model, run, available, draft, prompt_cache_size=prompt_cache_size)
    return c, proposal, worst <= available


def session_json(c: SessionCeiling, proposal: CacheProposal | None, fits: bool) -> dict:
    out = c.to_json() | {"fits": fits, "proposal": None}
    if proposal is not None:
        out["proposal"] = {"flag": proposal.flag, "value": proposal.value, "entries": proposal.entries,
                           "limit_bytes": proposal.limit_bytes, "cost": _cost(c, proposal)}
    return out


def _cost(c: SessionCeiling, p: CacheProposal) -> str:
    if p.entries == 0 or (p.flag == "--prompt-cache-size" and p.value == 0):
        return f"no conversation is kept: every request re-processes its whole prompt ({c.prompt_tokens} tokens)"
    return (f"at most {p.entries} prompt-cache entries kept (a conversation is one, two for a model with linear "
            f"attention); a follow-up to an older one re-processes its whole prompt (up to {c.prompt_tokens} tokens)"
            " instead of its new turn")


def print_session(c: SessionCeiling, proposal: CacheProposal | None, available: int) -> None:
    reqs = f"after {c.requests} requests" if c.requests else "over a session"
    print(f"\nsession  {reqs} of {c.prompt_tokens} prompt + {c.generated} generated tokens"
          + (f": peak {_mib(c.peak_bytes)}" if c.requests else "")
          + f"; limit {_mib(c.limit_bytes)} ({c.entries} prompt-cache entries, capped by {c.capped_by})"
          + ("" if c.limit_bytes <= available else f", {_mib(c.limit_bytes - available)} over the budget"))
    for n in c.notes:
        print("         " + n)
    if c.limit_bytes > available:
        if proposal is None:
            print("         no prompt-cache limit makes it fit, not even --prompt-cache-size 0: lower -c or --max-tokens")
        else:
            print(f"         {proposal.flag} {proposal.value} fits (limit {_mib(proposal.limit_bytes)}): "
                  + _cost(c, proposal))
    print(f"         mlx's buffer cache may hold up to {_mib(CPU_CACHE_LIMIT)} more of freed arrays "
          "(mx.set_cache_limit, the CPU backend's default; Metal's default is far larger, bounded by memory "
          "pressure: not modelled)")
