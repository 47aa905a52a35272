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
        out["proposal"] = {"prompt_cache_bytes": proposal.prompt_cache_bytes, "entries": proposal.entries,
                           "limit_bytes": proposal.limit_bytes,
                           "cost": f"a follow-up to a conversation beyond the {proposal.entries} kept re-processes "
                                   f"its whole prompt (up to {c.prompt_tokens} tokens)"}
    return out


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
            print("         no prompt-cache limit makes it fit: lower -c or --max-tokens")
        elif proposal.prompt_cache_bytes == 0:
            print(f"         --prompt-cache-size 0 fits (limit {_mib(proposal.limit_bytes)}): every request "
                  f"re-processes its whole prompt ({c.prompt_tokens} tokens)")
        else:
            print(f"         --prompt-cache-bytes {proposal.prompt_cache_bytes} fits (limit {_mib(proposal.limit_bytes)},"
                  f" {proposal.entries} conversations kept): a follow-up to an older one re-processes its whole "
                  f"prompt (up to {c.prompt_tokens} tokens)")
    print(f"         mlx's buffer cache may hold up to {_mib(CPU_CACHE_LIMIT)} more of freed arrays "
          "(mx.set_cache_limit, the CPU backend's default; Metal's is not modelled)")
