"""The search for the largest k (a context in steps of 256) whose total fits: an exact bracket narrowed by
interpolation (fitter.fit.solver's contexts, fitter.fit.quant_fit's quants, fitter.mlx's contexts).

The total grows with k piecewise linearly but not strictly monotonically (fitter.fit.solver's docstring says where it
dips); the answer is then a k that fits with k + 1 asked and over the budget, as a binary search's is.
"""

from __future__ import annotations

from collections.abc import Callable

Hint = tuple[int, int]  # (k, bytes per step): where a search like this one ended, and how steeply its total grew


def largest_fitting(total: Callable[[int], int], available: int, k_max: int, *, hint: Hint | None = None,
                    asked: dict[int, int] | None = None) -> tuple[int, int]:
    """The largest k in 1..k_max with total(k) <= available, and total(k); (0, 0) when not even k = 1 fits.

    `total` grows with k, piecewise linearly (KV cells and masks grow linearly; compute buffers in
    steps), so the answer is bracketed and then found by interpolating the bracket's ends: a guess and its
    neighbour usually settle it, where bisection takes log2(k_max) predictions. Every step keeps the
    bracket exact (total(lo) <= available < total(hi)); a guess's neighbour is asked only when the guess
    lands within two average steps of the budget. A total that bends (compute growing faster than
    the KV cache) keeps one end for several steps: that end then counts for half, a quarter ... (the
    Illinois rule of regula falsi), and a third step in a row that does not halve the bracket is a
    bisection, so it takes at most about four times bisection's steps. Same answer as a binary
    search where `total` is monotone; where it is not (see the module's docstring), a k that fits with k + 1
    asked and over the budget (or k_max), as a binary search's is.

    `hint` (from `next_hint`: the last search of the same model, at another ubatch or quant) starts the search at
    that search's answer, then where its bytes per step put the budget: three or four predictions, without k_max
    or its eighths (fit's table on a 35B MoE, five f16 ubatches: 4 + 3 + 3 + 3 + 4 with solve's slopes carried along
    (_extrapolated), 4 + 4 + 5 + 5 + 5 without a hint). The bracket is checked all the same, so a wrong hint costs
    predictions (three at most), never a different answer. `asked` (a dict of the caller's) keeps every k asked.
    """
    memo: dict[int, int] = {} if asked is None else asked

    def t(k: int) -> int:
        if k not in memo:
            memo[k] = total(k)
        return memo[k]

    if k_max <= 1:
        if t(1) > available:  # asked even for k_max = 0: it raises what llama.cpp refuses
            return 0, 0
        return (1, t(1)) if k_max == 1 else (0, 0)
    lo, hi = 0, k_max  # total(lo) fits (once lo > 0), total(hi) does not (once hi is asked)
    if hint is not None and hint[0] >= 1 and hint[1] > 0:
        lo, hi = _hinted_bracket(t, available, k_max, hint)
        if hi == 1:
            return 0, 0  # not even k = 1 fits
    if hi == k_max and t(k_max) <= available:
        return k_max, t(k_max)
    lo, hi = _lower_end(t, available, lo, hi)
    if not lo:
        return 0, 0
    lo = _narrowed(t, available, lo, hi)
    return lo, t(lo)


def _lower_end(t: Callable[[int], int], available: int, lo: int, hi: int) -> tuple[int, int]:
    """largest_fitting's bracket with a lower end (lo 0: not even k = 1 fits): an eighth of the upper, and so on
    down; k = 1 last, only where nothing larger fits (a prediction saved: a larger k that fits is a lower end
    already)."""
    k = hi // 8
    while k > 1 and not lo:
        if t(k) <= available:
            lo = k
        else:
            hi, k = k, k // 8
    if not lo:
        if t(1) > available:
            return 0, hi
        lo = 1
    return lo, hi


def _narrowed(t: Callable[[int], int], available: int, lo: int, hi: int) -> int:
    """The largest k of an exact bracket (t(lo) <= available < t(hi)) that fits: interpolation between the ends,
    Illinois-weighted, a bisection after three steps that did not halve it."""
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
    return lo


def _hinted_bracket(t: Callable[[int], int], available: int, k_max: int, hint: Hint) -> tuple[int, int]:
    """largest_fitting's bracket from a hint: (lo, hi) with t(lo) <= available (lo 0: none asked fits) and
    t(hi) > available (hi k_max: maybe not asked yet). It asks the hint's answer, that corrected to the nearest step
    by the hint's bytes per step, and, where one end is still missing, a second correction past the budget: a bracket
    whose interpolation lands on the answer or next to it. A hint at k_max or beyond (the last search fitted there:
    `quants`' smaller quants) keeps its slope: k_max is asked, then corrected the same way, not halved by eighths."""
    k0, step = min(hint[0], k_max), hint[1]
    lo, hi = 0, k_max

    def toward(k: int, past: bool) -> int:
        """Where the line through (k, t(k)) at `step` bytes per step meets the budget: the nearest step, or (past)
        the first step beyond it."""
        d = available - t(k)
        if d >= 0:
            return k + max(1, d // step + 1 if past else (d + step // 2) // step)
        return max(1, k - max(1, (-d + (step - 1 if past else step // 2)) // step))

    def ask(k: int) -> None:
        nonlocal lo, hi
        if lo < k < hi:
            if t(k) <= available:
                lo = k
            else:
                hi = k

    ask(k0)
    ask(toward(k0, past=False))
    if not lo:
        ask(toward(hi, past=True))
    elif hi == k_max:
        ask(toward(lo, past=True))
    return lo, hi


def next_hint(asked: dict[int, int], k: int, prev: Hint | None = None) -> Hint | None:
    """The hint for the next search of the same model (largest_fitting's `hint`): this search's answer k, and the
    bytes per step between the farthest two k it asked (`prev`'s where it asked one k only)."""
    step = 0
    if len(asked) > 1:
        a, b = min(asked), max(asked)
        step = (asked[b] - asked[a]) // (b - a)
    if step <= 0 and prev is not None:
        step = prev[1]
    return (max(k, 1), step) if step > 0 else None


def _extrapolated(hint: Hint | None, slopes: list[tuple[int, int]], ub: int) -> Hint | None:
    """The hint for the search at ubatch `ub`, its bytes per step carried along the line through the last two
    searches' (ubatch, bytes per step): the attention scratch and mask grow with cells x tokens, so each step of
    context costs more at a larger ubatch, by the same amount per token."""
    if hint is None or len(slopes) < 2:
        return hint
    (u0, s0), (u1, s1) = slopes[-2], slopes[-1]
    if u1 == u0:
        return hint
    return hint[0], max(1, s1 + (s1 - s0) * (ub - u1) // (u1 - u0))
