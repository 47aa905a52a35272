"""A recorded run's outcome taken again under a shift of the buffers (fitter.ggml.shifted) against the replay itself.

A run taken from a shifted outcome must leave every allocator and every tensor as Gallocr's replay of its events
would: the same buffer sizes, peaks and addresses. The reference is that replay, forced for every run (the shift
machinery off); the replay against the walk is test_program_memo's, ggml-alloc.c against llama.cpp the dry runs'.
"""

from __future__ import annotations

import pytest

from fitter.ggml import alloc
from fitter.ggml import shifted as S
from fitter.ggml.alloc import Gallocr
from fitter.ggml.graph import Segment, program
from fitter.ggml.memo import ProgramMemo, RecordedRun
from fitter.ggml.tensor import FLAG_OUTPUT, Tensor, contig_nb
from fitter.ggml.types import F32
from tests.ggml.sweep import compute_sweep
from tests.synth import build


def _t(op: str, ne: list[int], src: tuple, name: str, ext: bool = False) -> Tensor:
    return Tensor(op, F32, ne, contig_nb(F32, ne), src, None, name, ext=ext)


def _taken(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per run taken from a shifted outcome."""
    taken: list[int] = []
    inner = S.Shifted.apply

    def spy(self, *args) -> None:
        taken.append(1)
        inner(self, *args)

    monkeypatch.setattr(S.Shifted, "apply", spy)
    return taken


def _no_shifts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "entry", lambda ga, run: None)


def _layer() -> tuple[list[Tensor], list[Tensor], Tensor]:
    """A mask placed first (its rows vary: a cache's n_ctx), then a layer over x: mm, an add in place, a dying
    temporary and a kept output."""
    w = _t("NONE", [64, 64, 1, 1], (), "w", ext=True)
    mask = _t("NONE", [64, 8, 1, 1], (), "mask")
    x = _t("NONE", [64, 8, 1, 1], (), "x")
    a = _t("MUL_MAT", [64, 8, 1, 1], (w, x), "a")
    b = _t("ADD", [64, 8, 1, 1], (a, mask), "b")
    c = _t("MUL_MAT", [64, 16, 1, 1], (w, b), "c")
    d = _t("SCALE", [64, 8, 1, 1], (c,), "d")
    e = _t("MUL_MAT", [64, 8, 1, 1], (w, d), "e")
    e.flags |= FLAG_OUTPUT
    return [a, b, c, d, e], [x, a, b, c, d, e], mask


def _state(ga: Gallocr, ts: list[Tensor]) -> tuple:
    return (ga.sizes(), ga.peak_lives, [(t.name, t.addr, t.size, t.own, t.be) for t in ts],
            [t.chunks for t in ga.tallocs])


def _runs(rows: tuple[int, ...], mask_kept: bool, trace: bool, max_buffer_size: int = alloc.SIZE_MAX,
          c_rows: tuple[int, ...] = ()) -> list[tuple]:
    """The layer's program run once per mask size, each run from a new allocator: the mask placed, then x, then the
    program (one ProgramMemo: its first run walks, the second records). `mask_kept`: a later layer reads the mask
    (the program does not free it). `max_buffer_size`: the buffer's, as a Metal device's maxBufferLength. `c_rows`:
    c's rows in each run, sized anew each time (as a FLASH_ATTN_EXT output whose size moves with n_ctx)."""
    nodes, ts, mask = _layer()
    memo = ProgramMemo(program(nodes), ts, (), ts[-1:])
    out = []
    for n, r in enumerate(rows):
        if c_rows:
            c = ts[3]
            c.ne = [64, c_rows[n], 1, 1]
            c.nb = contig_nb(F32, c.ne)
            c.memo = None
        counts, _ = Segment._counts(nodes)
        for t in (mask, *ts):
            t.own, t.nc, t.nv, t.size = False, 0, 0, 0
        mask.ne = [64, r, 1, 1]
        mask.nb = contig_nb(F32, mask.ne)
        mask.memo = None  # (its size moved)
        for t, n_children, n_views in counts:
            t.nc, t.nv = n_children, n_views
        mask.nc += mask_kept
        ga = Gallocr(32, trace=trace, max_buffer_size=max_buffer_size)
        ga._allocate(mask)
        ga._allocate(ts[0])
        memo.run(ga)
        out.append(_state(ga, [mask, *ts]))
    return out


ROWS = (8, 16, 8, 24, 40, 4, 4, 64)


@pytest.mark.parametrize("trace", [True, False])
def test_a_run_above_a_growing_mask_is_taken_shifted(trace: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _taken(monkeypatch)
    shifted = _runs(ROWS, True, trace)
    assert len(taken) == 5  # the first two runs walk and record; the third keeps its outcome; then each is taken
    _no_shifts(monkeypatch)
    assert _runs(ROWS, True, trace) == shifted


@pytest.mark.parametrize("trace", [True, False])
def test_an_allocation_sized_anew_on_top_is_taken_at_its_size(trace: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """c takes the buffer's last block and is freed before anything is placed above it: its size changes nothing
    but its own end (the mark), except where a free block below would take it (4 rows fit the 2 KiB one there)."""
    c_rows = (16, 24, 40, 32, 64, 4, 48, 56)
    taken = _taken(monkeypatch)
    got = _runs(ROWS, True, trace, c_rows=c_rows)
    assert len(taken) == 4  # the third run keeps its outcome; 4 rows fit a free block below: replayed
    _no_shifts(monkeypatch)
    assert _runs(ROWS, True, trace, c_rows=c_rows) == got


def test_a_run_that_frees_below_the_move_is_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer frees the mask (its last reader): a size below the move differs, the run is replayed (but where the
    mask's size comes back)."""
    rows = (8, 16, 24, 32, 24, 40, 48, 56)
    taken = _taken(monkeypatch)
    got = _runs(rows, False, True)
    assert len(taken) == 1
    _no_shifts(monkeypatch)
    assert _runs(rows, False, True) == got


def test_a_buffer_with_a_maximum_size_is_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a buffer may take a second chunk, the last block's size decides: no run is taken shifted."""
    taken = _taken(monkeypatch)
    got = _runs(ROWS, True, True, 1 << 20)
    assert not taken
    _no_shifts(monkeypatch)
    assert _runs(ROWS, True, True, 1 << 20) == got


# n_ctx steps at one ubatch (a search's asks, a sweep), then another ubatch and back
SWEEP = ((8192, 512), (8448, 512), (9216, 512), (7936, 512), (8192, 1024), (12288, 1024), (16384, 512), (4096, 512),
         (16640, 1024))


def _shifted_equal_the_replay(path: str, backend: str, monkeypatch: pytest.MonkeyPatch, **kw) -> int:
    taken = _taken(monkeypatch)
    got = compute_sweep(path, backend, SWEEP, **kw)
    with monkeypatch.context() as m:
        _no_shifts(m)
        assert got == compute_sweep(path, backend, SWEEP, **kw)
    return len(taken)


def test_a_runs_net_effect_on_the_live_tensors_is_its_events_one_by_one() -> None:
    """_net (a run that raises no mark) against _track: random runs as the allocator makes them (a tensor placed once,
    by an allocation or in place of a parent it owns, freed at most once), from random live dicts; the same tensors,
    in the same order. A child of a parent placed before the run joins only where that parent was live; a tensor of
    the run still live from an earlier run (a chunk run again) keeps its place."""
    import random

    rnd = random.Random(5)
    for _ in range(400):
        before = [_t("NONE", [4, 1, 1, 1], (), f"b{i}") for i in range(5)]
        mine = [_t("NONE", [4, 1, 1, 1], (), f"r{i}") for i in range(6)]
        run = RecordedRun()
        ops, ts, ps = run.ops
        owned = list(before)  # what an event may free or a placement take the place of
        for t in mine:
            while owned and rnd.random() < 0.4:  # frees
                x = owned.pop(rnd.randrange(len(owned)))
                ops.append(alloc.FREE), ts.append(x), ps.append(x)
            if owned and rnd.random() < 0.5:  # in place of a parent
                p = owned.pop(rnd.randrange(len(owned)))
                ops.append(alloc.REUSE), ts.append(t), ps.append(p)
            else:
                ops.append(alloc.ALLOC), ts.append(t), ps.append(t)
            owned.append(t)
        others = [_t("NONE", [4, 1, 1, 1], (), f"o{i}") for i in range(3)]
        pool = before + others + mine
        start = rnd.sample(pool, rnd.randrange(len(pool) + 1))
        expected = {t: t for t in start}  # (as Gallocr keeps them: each tensor by itself)
        S._track(expected, zip(*run.ops))
        live = {t: t for t in start}
        S._take_net(live, S._net(run))
        assert list(live) == list(expected)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen35moe", "deepseek2"])
def test_predictions_with_shifted_runs_equal_the_replay(arch: str, backend: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _shifted_equal_the_replay(str(build(arch)), backend, monkeypatch)


def test_full_size_metal_predictions_with_shifted_runs_equal_the_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.6-35B-A3B's shape on Metal: its reordered layers are chunks, most of them above the mask; and with a
    maximum buffer size, in chunks of 1 GiB (the host's buffer, unlimited, still moves)."""
    from tests.synth.shapes import build_shape

    path = str(build_shape("qwen36-35b-a3b"))
    assert _shifted_equal_the_replay(path, "metal", monkeypatch)
    _shifted_equal_the_replay(path, "metal", monkeypatch, metal_max_buffer_length=1 << 30)
