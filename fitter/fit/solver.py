"""Solve for the largest context that fits a budget, per ubatch and K/V type pair, and recommend one.

The device total is monotone in n_ctx (KV cells and attention scratch only grow) and piecewise linear,
so the largest n_ctx (a multiple of 256: llama.cpp pads n_ctx to 256 anyway) is found by interpolation
inside an exact bracket (`largest_fitting`), in a handful of predictions.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict

from fitter.fit.memory import Prediction, predict
from fitter.gguf.reader import GGUFHeader
from fitter.llama.cparams import DEFAULT_N_BATCH, Backend, ConfigError, Frontend, RunConfig
from fitter.llama.hparams import ModelSpec

UBATCHES = (256, 512, 1024, 2048, 4096)
KV_PAIRS = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"))
KV_QUALITY = {"f32": 4, "f16": 3, "bf16": 3, "q8_0": 2, "q5_1": 1, "q5_0": 1, "q4_1": 0, "q4_0": 0, "iq4_nl": 0}
CTX_STEP = 256


class Solution(BaseModel):
    model_config = ConfigDict(frozen=True)

    n_ubatch: int
    n_batch: int
    type_k: str
    type_v: str
    draft: bool
    n_ctx: int  # largest fitting context (0: not even 256 fits)
    total_device_bytes: int  # at that context
    headroom_bytes: int  # budget - margin - total

    @property
    def fits(self) -> bool:
        return self.n_ctx > 0


def _config_for(base: RunConfig, n_ctx: int, ub: int, tk: str, tv: str, draft: bool) -> RunConfig:
    n_batch = max(base.n_batch or DEFAULT_N_BATCH, ub)  # -b must reach -ub or llama.cpp clamps ubatch down to it
    update = {"n_ctx": n_ctx, "n_ubatch": ub, "n_batch": n_batch, "type_k": tk, "type_v": tv}
    if not draft:
        update.update({"spec_type": "none", "draft_model": None})
    return base.model_copy(update=update)


def largest_fitting(total: Callable[[int], int], available: int, k_max: int) -> tuple[int, int]:
    """The largest k in 1..k_max with total(k) <= available, and total(k); (0, 0) when not even k = 1 fits.

    `total` is monotone in k and piecewise linear (KV cells and masks grow linearly; compute buffers in
    steps), so the answer is bracketed and then found by interpolating the bracket's ends: a guess and its
    neighbour usually settle it, where bisection takes log2(k_max) predictions. Every step keeps the
    bracket exact (total(lo) <= available < total(hi)); a guess's neighbour is asked only when the guess
    lands within two average steps of the budget. A total that bends (compute growing faster than
    the KV cache) keeps one end for several steps: that end then counts for half, a quarter ... (the
    Illinois rule of regula falsi), and a third step in a row that does not halve the bracket is a
    bisection, so it takes at most about four times bisection's steps. Same answer as a binary
    search.
    """
    memo: dict[int, int] = {}

    def t(k: int) -> int:
        if k not in memo:
            memo[k] = total(k)
        return memo[k]

    if t(1) > available:  # k = 1 is asked first, as a binary search would: it raises what llama.cpp refuses
        return 0, 0
    if k_max <= 1 or t(k_max) <= available:
        k = max(1, k_max) if k_max >= 1 else 0
        return k, t(k) if k else 0
    lo, hi = 1, k_max  # total(lo) fits, total(hi) does not
    bisect = False
    misses = 0
    side = 0  # which end the last step moved: -1 lo, 1 hi, 0 both
    lo_halved = hi_halved = 0  # Illinois: an end kept step after step counts for half, then a quarter ...
    while hi - lo > 1:
        width = hi - lo
        if bisect:
            g = (lo + hi) // 2
        else:  # where the line through the bracket's ends (weighted) crosses the budget
            under, over = (available - t(lo)) << hi_halved, (t(hi) - available) << lo_halved
            g = lo + under * width // max(1, under + over)
        g = min(max(g, lo + 1), hi - 1)
        near = 2 * (t(hi) - t(lo)) // width  # two average steps: a guess this close asks its neighbour
        was_lo, was_hi = lo, hi
        if t(g) <= available:
            lo = g
            if g + 1 < hi and available - t(g) <= near and t(g + 1) > available:
                hi = g + 1
        else:
            hi = g
            if g - 1 > lo and t(g) - available <= near and t(g - 1) <= available:
                lo = g - 1
        now = (hi != was_hi) - (lo != was_lo)  # 1: only hi moved, -1: only lo moved, 0: both
        lo_halved = lo_halved + 1 if now == 1 and side == 1 else 0
        hi_halved = hi_halved + 1 if now == -1 and side == -1 else 0
        side = now
        # after three steps in a row that did not halve the bracket, a bisection
        misses = 0 if hi - lo <= width // 2 else misses + 1
        bisect = misses >= 3 and not bisect
    return lo, t(lo)


def largest_context(
    header: GGUFHeader,
    spec: ModelSpec,
    base: RunConfig,
    backend: Backend,
    frontend: Frontend,
    available: int,
    *,
    n_ubatch: int,
    type_k: str,
    type_v: str,
    with_draft: bool,
    draft: tuple[GGUFHeader, ModelSpec] | None,
    ctx_max: int,
) -> Solution:
    def total(steps: int) -> int:
        cfg = _config_for(base, steps * CTX_STEP, n_ubatch, type_k, type_v, with_draft)
        return predict(header, spec, cfg, backend, frontend, draft if with_draft else None).total_device_bytes

    steps, best_total = largest_fitting(total, available, ctx_max // CTX_STEP)
    n_batch = max(base.n_batch or DEFAULT_N_BATCH, n_ubatch)
    return Solution(
        n_ubatch=n_ubatch, n_batch=n_batch, type_k=type_k, type_v=type_v, draft=with_draft,
        n_ctx=steps * CTX_STEP, total_device_bytes=best_total, headroom_bytes=available - best_total,
    )


def solve(
    header: GGUFHeader,
    spec: ModelSpec,
    base: RunConfig,
    backend: Backend,
    frontend: Frontend,
    budget_bytes: int,
    margin_bytes: int,
    *,
    draft: tuple[GGUFHeader, ModelSpec] | None = None,
    ubatches: tuple[int, ...] = UBATCHES,
    kv_pairs: tuple[tuple[str, str], ...] = KV_PAIRS,
    ctx_max: int | None = None,
) -> list[Solution]:
    """Largest n_ctx for every ubatch x K/V pair, with and without the draft (or MTP head)."""
    available = budget_bytes - margin_bytes
    ctx_max = ctx_max or spec.n_ctx_train
    has_spec = draft is not None or base.spec_type == "draft-mtp"
    out = []
    for with_draft in ((True, False) if has_spec else (False,)):
        for tk, tv in kv_pairs:
            if base.flash_attn == "off" and tv not in ("f16", "f32", "bf16"):
                continue  # quantized V needs flash attention
            for ub in ubatches:
                try:
                    out.append(
                        largest_context(
                            header, spec, base, backend, frontend, available, n_ubatch=ub, type_k=tk, type_v=tv,
                            with_draft=with_draft, draft=draft, ctx_max=ctx_max,
                        )
                    )
                except ConfigError:
                    continue  # a pair llama.cpp refuses for this model (block size, MLA K != V)
    return out


def recommend(solutions: list[Solution], ctx_target: int) -> Solution | None:
    """The config to run: keep the draft if it still reaches the target context, prefer the best K/V
    type that reaches it, then the largest ubatch up to 2048 (prefill speed); if nothing reaches the
    target, the largest context."""
    fitting = [s for s in solutions if s.fits]
    if not fitting:
        return None
    reach = [s for s in fitting if s.n_ctx >= ctx_target]
    if reach:
        return max(reach, key=lambda s: (s.draft, KV_QUALITY.get(s.type_v, 0) + KV_QUALITY.get(s.type_k, 0),
                                         min(s.n_ubatch, 2048), -s.n_ubatch, s.headroom_bytes))
    return max(fitting, key=lambda s: (s.n_ctx, s.draft, KV_QUALITY.get(s.type_v, 0), min(s.n_ubatch, 2048)))


def prediction_for(
    header: GGUFHeader, spec: ModelSpec, base: RunConfig, backend: Backend, frontend: Frontend, s: Solution,
    draft: tuple[GGUFHeader, ModelSpec] | None = None,
) -> Prediction:
    cfg = _config_for(base, s.n_ctx, s.n_ubatch, s.type_k, s.type_v, s.draft)
    return predict(header, spec, cfg, backend, frontend, draft if s.draft else None)


class Alternative(BaseModel):
    """One change that makes an over-budget config fit (what `fit` suggests, one change at a time)."""

    model_config = ConfigDict(frozen=True)

    flags: list[str]  # the llama-server flags to change, one item per flag ([]: drop the draft / nothing fits)
    reason: str  # e.g. "fits at -c 32768", "largest context that fits", "no context fits with these settings"

    @property
    def line(self) -> str:
        if not self.flags:
            return self.reason
        return " ".join(self.flags) + ("" if self.reason == "largest context that fits" else f" ({self.reason})")


def what_to_change(header: GGUFHeader, spec: ModelSpec, cfg: RunConfig, backend: Backend, frontend: Frontend,
                   available: int, draft: tuple[GGUFHeader, ModelSpec] | None, pred: Prediction) -> list[Alternative]:
    """For a prediction over budget: the largest context that fits, and each other single change (a quantized K/V
    cache, a smaller ubatch, no draft) that keeps the requested context."""
    cp = pred.context
    with_draft = draft is not None or cfg.spec_type == "draft-mtp"
    fits_at = f"fits at -c {cp.n_ctx}"

    def largest(base: RunConfig, *, ub: int = cp.n_ubatch, tk: str = cp.type_k, tv: str = cp.type_v,
                drafted: bool = with_draft) -> int:
        return largest_context(header, spec, base, backend, frontend, available, n_ubatch=ub, type_k=tk, type_v=tv,
                               with_draft=drafted, draft=draft if drafted else None, ctx_max=cp.n_ctx).n_ctx

    n_ctx = largest(cfg)
    out = [Alternative(flags=[f"-c {n_ctx}"], reason="largest context that fits") if n_ctx
           else Alternative(flags=[], reason="no context fits with these settings")]
    # a quantized V cache needs flash attention: suggest both together when it is off
    fa_cfg, fa_flags = (cfg, []) if cp.flash_attn else (cfg.model_copy(update={"flash_attn": "on"}), ["-fa on"])
    for tk, tv in (("q8_0", "q8_0"), ("q4_0", "q4_0")):
        if (tk, tv) != (cp.type_k, cp.type_v):
            try:
                n_ctx = largest(fa_cfg, tk=tk, tv=tv)
            except ConfigError:
                continue  # llama.cpp refuses this pair for the model (block size, MLA)
            if n_ctx >= cp.n_ctx:
                out.append(Alternative(flags=[*fa_flags, f"-ctk {tk}", f"-ctv {tv}"], reason=fits_at))
                break
    for ub in (1024, 512, 256):
        if ub < cp.n_ubatch and largest(cfg, ub=ub) >= cp.n_ctx:
            out.append(Alternative(flags=[f"-ub {ub}"], reason=fits_at))
            break
    if with_draft and largest(cfg, drafted=False) >= cp.n_ctx:
        out.append(Alternative(flags=[], reason=f"drop the draft model ({fits_at})"))
    return out
