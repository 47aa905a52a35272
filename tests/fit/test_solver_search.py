"""The solver's search (fitter.fit.largest.largest_fitting) gives a binary search's answer in fewer predictions.

The tables it produces are compared byte for byte with the committed grid (tests/test_prediction_grid.py); here the
search itself is checked against a plain binary search on monotone functions of every shape the memory model has
(linear, stepped, flat stretches, jumps), and its cost is counted.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fitter.bundled import resolve_model
from fitter.fit.largest import _extrapolated, largest_fitting, next_hint
from fitter.fit.memory import predict
from fitter.llama.cparams import Backend, RunConfig
from fitter.llama.model import load_model_spec


def _binary(total, available: int, k_max: int) -> int:
    lo, hi = 0, k_max
    if total(1) > available:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(mid) <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo


@st.composite
def _monotone(draw):
    k_max = draw(st.integers(0, 4096))
    base = draw(st.integers(0, 10**9))
    slope = draw(st.integers(0, 10**7))
    step = draw(st.integers(1, 64))
    jump = draw(st.integers(0, 10**8))
    jumps = sorted(draw(st.lists(st.integers(1, 4096), max_size=4)))
    available = draw(st.integers(0, base + slope * 4096 + jump * 5))
    return k_max, available, lambda k: base + slope * k + jump * (k // step) + jump * sum(k >= j for j in jumps)


@settings(max_examples=400, deadline=None)
@given(_monotone())
def test_same_answer_as_a_binary_search(case):
    k_max, available, total = case
    k, t = largest_fitting(total, available, k_max)
    assert k == _binary(total, available, k_max)
    assert t == (total(k) if k else 0)


@settings(max_examples=400, deadline=None)
@given(_monotone(), st.integers(-10, 5000), st.integers(-10, 10**9))
def test_any_hint_gives_a_binary_search_s_answer(case, k0, step):
    """A hint only moves where the search starts: a wrong one (any k, any bytes per step) costs predictions, never
    a different answer."""
    k_max, available, total = case
    asked: set[int] = set()
    k, t = largest_fitting(lambda k: asked.add(k) or total(k), available, k_max, hint=(k0, step))
    assert k == _binary(total, available, k_max)
    assert t == (total(k) if k else 0)
    assert len(asked) <= 8 * max(1, k_max).bit_length() + 4 + 3  # a hint asks three more at most


@st.composite
def _bumpy(draw):
    """A total that mostly grows but may fall from one step to the next (the allocator's fragmentation: a compute
    buffer a few MiB smaller at a larger context, which llama.cpp's own dry run shows)."""
    k_max = draw(st.integers(0, 600))
    base = draw(st.integers(0, 10**6))
    slope = draw(st.integers(0, 10**4))
    dips = draw(st.dictionaries(st.integers(1, 600), st.integers(-3 * 10**4, 3 * 10**4), max_size=40))
    available = draw(st.integers(0, base + slope * 600 + 10**5))

    def total(k: int) -> int:
        return base + slope * k + sum(v for j, v in dips.items() if j <= k)

    return k_max, available, total


@settings(max_examples=400, deadline=None)
@given(_bumpy(), st.one_of(st.none(), st.tuples(st.integers(-10, 700), st.integers(-10, 10**5))))
def test_the_answer_is_a_checked_crossing_even_where_the_total_falls(case, hint):
    """Where the total is not monotone (a larger context can fit where a smaller one does not), the answer is still
    a context that fits with the next step predicted not to (or k_max): never a step inferred without its
    prediction. A binary search gives such a crossing too, not always the same one."""
    k_max, available, total = case
    asked: dict[int, int] = {}
    k, t = largest_fitting(total, available, k_max, hint=hint, asked=asked)
    if k == 0:
        assert k_max == 0 or (1 in asked and asked[1] > available)
        return
    assert k in asked and t == total(k) <= available
    assert k == k_max or (k + 1 in asked and asked[k + 1] > available)


def test_the_last_search_s_hint_settles_the_next_in_three_predictions():
    """`fit`'s table: a larger ubatch moves the total up by a little; the last ubatch's answer and slope (next_hint)
    then bracket the new answer without k_max or k_max / 8 being asked."""
    def total(k: int, extra: int) -> int:
        return 20_000 * 2**20 + extra + k * 4 * 2**20 + (k // 4) * 2**19

    available = 22_222 * 2**20
    asked: dict[int, int] = {}
    k, _ = largest_fitting(lambda k: total(k, 0), available, 1024, asked=asked)
    hint = next_hint(asked, k)
    assert hint is not None and hint[0] == k
    for extra in (0, 3 * 2**20, 40 * 2**20, -40 * 2**20, 2_000 * 2**20):
        calls: list[int] = []
        got, _ = largest_fitting(lambda k: calls.append(k) or total(k, extra), available, 1024, hint=hint)  # noqa: B023
        assert got == _binary(lambda k: total(k, extra), available, 1024)  # noqa: B023 - runs now
        assert len(set(calls)) <= 3 and 1024 not in calls, (extra, calls)
    assert next_hint({1024: 5}, 1024) is None  # one k asked: no slope
    assert next_hint({1024: 5}, 1024, (7, 3)) == (1024, 3)  # the last slope kept


def test_a_hint_at_k_max_keeps_its_slope():
    """`quants`: a quant that fits at k_max hands the next one (k_max, the slope kept from before); where the next
    does not fit at k_max, the slope corrects k_max straight to the answer: k_max, the answer and its neighbour,
    without k_max / 8."""
    def total(k: int) -> int:
        return 20_000 * 2**20 + k * 4 * 2**20 + (k // 4) * 2**19

    slope = 4 * 2**20 + 2**17
    for available in (24_000 * 2**20, 23_000 * 2**20, 20_000 * 2**20 + 1024 * slope + 1):
        calls: list[int] = []
        got, _ = largest_fitting(lambda k: calls.append(k) or total(k), available, 1024,  # noqa: B023
                                 hint=(1024, slope))
        assert got == _binary(total, available, 1024)
        assert len(set(calls)) <= 3 and 128 not in calls, (available, calls)


def test_slopes_carried_along_the_ubatches_settle_each_search_in_three_predictions():
    """`fit`'s table along one K/V row: each step of context costs more at a larger ubatch (cells x tokens), by the
    same amount per token; the hint's slope carried along the last two searches' (_extrapolated) lands the first
    correction on the answer, where the last search's slope alone falls short by more than a step."""
    def total(k: int, ub: int) -> int:
        return 20_000 * 2**20 + ub * 2**18 + k * (4 * 2**20 + ub * 1024)

    available = 24_000 * 2**20
    counts = {}
    for carry in (False, True):
        hint, slopes, n = None, [], []
        for ub in (256, 512, 1024, 2048, 4096):
            asked: dict[int, int] = {}
            h = _extrapolated(hint, slopes, ub) if carry else hint
            k, _ = largest_fitting(lambda k: total(k, ub), available, 1024, hint=h, asked=asked)  # noqa: B023
            assert k == _binary(lambda k: total(k, ub), available, 1024)  # noqa: B023 - runs now
            n.append(len(asked))
            hint = next_hint(asked, k, hint)
            if hint is not None and len(asked) > 1:
                slopes.append((ub, hint[1]))
        counts[carry] = n
    assert counts[True][2:] == [3, 3, 3] and sum(counts[True]) < sum(counts[False]), counts
    assert _extrapolated((500, 7), [(256, 5)], 512) == (500, 7)  # one slope: the hint as it is
    assert _extrapolated((500, 7), [(256, 5), (512, 7)], 1024) == (500, 11)


def test_a_near_linear_total_takes_a_handful_of_predictions():
    calls = []

    def total(k: int) -> int:  # KV linear in n_ctx, compute stepping every 4 steps: like a real model
        calls.append(k)
        return 20_000 * 2**20 + k * 4 * 2**20 + (k // 4) * 2**19

    available = 22_222 * 2**20
    k, _ = largest_fitting(total, available, 1024)
    searched = len(set(calls))
    assert k == _binary(total, available, 1024) and 0 < k < 1024
    assert searched <= 6  # a binary search over 1024 steps asks 11


@settings(max_examples=300, deadline=None)
@given(_monotone())
def test_never_far_more_than_a_binary_search(case):
    k_max, available, total = case
    asked: set[int] = set()
    largest_fitting(lambda k: asked.add(k) or total(k), available, k_max)
    steps = max(1, k_max).bit_length()
    assert len(asked) <= 8 * steps + 4  # at most four steps per halving, two predictions each


def test_a_bending_total_takes_a_handful_of_predictions():
    """Compute growing faster than the KV cache (the line through the ends overshoots, step after step)."""
    def total(k: int) -> int:  # KV linear, the attention scratch of a big ubatch growing faster
        return 20_000 * 2**20 + k * 2**20 + (k * k // 64) * 2**16

    for available in (20_500 * 2**20, 21_000 * 2**20, 21_500 * 2**20):
        calls: list[int] = []
        k, _ = largest_fitting(lambda k: calls.append(k) or total(k), available, 1024)  # noqa: B023 - runs now
        assert k == _binary(total, available, 1024) and 0 < k < 1024
        assert len(set(calls)) <= 11, calls  # the line through the ends alone took up to 15


def test_the_smallest_context_is_asked_only_where_nothing_larger_fits():
    """k = 1 is asked last, only where no larger lower end fits (one prediction saved)."""
    def total(k: int) -> int:
        return 20_000 * 2**20 + k * 4 * 2**20

    for available, k_max in ((22_222 * 2**20, 1024), (30_000 * 2**20, 1024), (20_010 * 2**20, 1024), (20_004 * 2**20, 1024),
                             (22_222 * 2**20, 7)):
        calls: list[int] = []
        k, _ = largest_fitting(lambda k: calls.append(k) or total(k), available, k_max)  # noqa: B023 - runs now
        assert k == _binary(total, available, k_max)
        anchors = [a for a in (k_max // 8, k_max // 64, k_max // 512) if a > 1]  # the lower ends tried, k_max // 8 on
        assert (1 in calls) == (k < k_max and (not anchors or k < anchors[-1])), (available, k_max, calls)
    calls = []
    assert largest_fitting(lambda k: calls.append(k) or total(k), 10 * 2**20, 1024) == (0, 0)
    assert calls[-1] == 1  # nothing fits: k = 1 settles it


@pytest.mark.parametrize("backend", [Backend.CPU, Backend.CUDA, Backend.METAL])
def test_predictions_without_terms_have_the_same_bytes(backend: Backend):
    """predict(terms=False), as the solver's searches ask: every buffer's bytes as with terms, the compute buffers'
    details empty; a prediction with terms asked after one without (same config) still has them."""
    from tests.synth.shapes import build_shape

    for path in (resolve_model("gemma3-270m"), str(build_shape("qwen36-35b-a3b"))):
        header, spec = load_model_spec(path)
        for n_ctx, n_ubatch, kv in ((4096, 512, "f16"), (33024, 1024, "q8_0"), (131072, 2048, "q4_0")):
            cfg = RunConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, type_k=kv, type_v=kv)
            bare = predict(header, spec, cfg, backend, terms=False)
            full = predict(header, spec, cfg, backend)
            rows = [[(b.device, b.kind, b.bytes) for b in p.buffers] for p in (bare, full)]
            assert rows[0] == rows[1]
            compute = [b for b in full.buffers if b.kind == "compute"]
            assert compute and all(b.detail for b in compute)
            assert all(not b.detail for b in bare.buffers if b.kind == "compute")
