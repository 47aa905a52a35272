"""A program's recorded runs (fitter.ggml.memo.ProgramMemo) against the allocator's walk over its nodes.

A replayed run must leave every allocator and every tensor as Gallocr.process_program would: the same buffer sizes,
peaks and addresses. The reference is the walk itself, forced for every run; ggml-alloc.c against llama.cpp is what
the dry-run tests check.
"""

from __future__ import annotations

import pytest

from fitter.ggml import memo as M
from fitter.ggml.alloc import Gallocr
from fitter.ggml.graph import Segment, program
from fitter.ggml.memo import ProgramMemo
from fitter.ggml.tensor import FLAG_OUTPUT, Tensor, contig_nb
from fitter.ggml.types import F32
from tests.ggml.sweep import compute_sweep
from tests.synth import build


def _t(op: str, ne: list[int], src: tuple, name: str, ext: bool = False) -> Tensor:
    return Tensor(op, F32, ne, contig_nb(F32, ne), src, None, name, ext=ext)


def _count_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per run replayed."""
    replays: list[int] = []
    inner = M.replay

    def spy(ga: Gallocr, run) -> None:
        replays.append(1)
        inner(ga, run)

    monkeypatch.setattr(M, "replay", spy)
    return replays


def _chain() -> tuple[list[Tensor], list[Tensor]]:
    """x -> mm -> add (in place over mm where the layouts match) -> mm -> add (an output), weights external."""
    w = _t("NONE", [64, 64, 1, 1], (), "w", ext=True)
    x = _t("NONE", [64, 8, 1, 1], (), "x")
    a = _t("MUL_MAT", [64, 8, 1, 1], (w, x), "a")
    b = _t("ADD", [64, 8, 1, 1], (a, w), "b")
    c = _t("MUL_MAT", [64, 8, 1, 1], (w, b), "c")
    d = _t("ADD", [64, 8, 1, 1], (c, w), "d")
    d.flags |= FLAG_OUTPUT
    return [a, b, c, d], [x, a, b, c, d]


def _state(ga: Gallocr, ts: list[Tensor], kept: Tensor) -> tuple:
    """What a later run or the caller reads: the allocator, every tensor's place, the kept tensor's counts (the
    others' are reset before the next run, so a replay leaves them as they were)."""
    return ga.sizes(), ga.peak_lives, [(t.name, t.addr, t.size, t.own) for t in ts], (kept.nc, kept.nv)


def _once(nodes: list[Tensor], ts: list[Tensor], run) -> tuple:
    counts, _ = Segment._counts(nodes)
    for t in ts:
        t.own, t.nc, t.nv, t.size, t.memo = False, 0, 0, 0, None
    for t, a, b in counts:
        t.nc, t.nv = a, b
    ga = Gallocr(32, trace=True)
    ga._allocate(ts[0])
    run(ga)
    return _state(ga, ts, ts[-1])


def test_a_replayed_run_equals_the_walk_and_a_changed_layout_is_walked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes, ts = _chain()
    prog = program(nodes)
    memo = ProgramMemo(prog, ts, (), ts[-1:])
    replays = _count_replays(monkeypatch)
    b = ts[2]
    # the rows grow (every size moves), then b's layout differs from a's (no reuse in place), then matches again
    for rows, b_rows in ((8, 8), (16, 16), (24, 24), (32, 32), (32, 16), (40, 20), (48, 48), (56, 56)):
        for t in ts:
            t.ne = [64, rows, 1, 1]
            t.nb = contig_nb(F32, t.ne)
        b.ne = [64, b_rows, 1, 1]
        b.nb = contig_nb(F32, b.ne)
        walked = _once(nodes, ts, lambda ga: ga.process_program(prog))
        assert _once(nodes, ts, memo.run) == walked, (rows, b_rows)
    assert len(memo.runs) == 1  # one entry state; re-recorded where b's layout changed, and back
    assert len(replays) == 4  # (24, 24), (32, 32), (40, 20) and (56, 56): the run recorded before them answers


def test_a_run_that_places_a_source_in_place_is_walked_from_then_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source the program places itself, of an op that may take its dying parent's memory: that parent is outside
    the program (not in the key), so its state must not be taken from a recorded run."""
    w = _t("NONE", [64, 64, 1, 1], (), "w", ext=True)
    y = _t("NONE", [64, 8, 1, 1], (), "y")  # outside the program
    x = _t("SCALE", [64, 8, 1, 1], (y,), "x")  # placed by the program, in y's memory where y is dying
    a = _t("MUL_MAT", [64, 8, 1, 1], (w, x), "a")
    prog = program([a])
    memo = ProgramMemo(prog, [x, a], (), [a])
    replays = _count_replays(monkeypatch)

    def once(run, y_alive: bool) -> tuple:
        for t in (y, x, a):
            t.own, t.nc, t.nv, t.size, t.memo = False, 0, 0, 0, None
        x.nc = 1
        ga = Gallocr(32, trace=True)
        if y_alive:
            ga._allocate(y)
            y.nc = 1
        run(ga)
        return _state(ga, [y, x, a], a)

    for y_alive in (True, True, False, True, False, False):
        walked = once(lambda ga: ga.process_program(prog), y_alive)
        assert once(memo.run, y_alive) == walked, y_alive
    assert memo.walks and not memo.runs and not replays


ARCHS = ("llama", "qwen3", "gemma3", "qwen3moe", "qwen35moe", "gpt-oss", "deepseek2")
SWEEP = ((4096, 512), (8192, 512), (4352, 1024), (33024, 512), (1024, 256), (8192, 1024), (65536, 512))


def _replays_equal_the_walk(path: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """A sweep of contexts on traced graphs (their programs run again and again), with the runs replayed and with
    the walk forced: the compute buffers, peaks included, are equal. Returns how many runs were replays."""
    replays = _count_replays(monkeypatch)
    got = compute_sweep(path, backend, SWEEP)
    monkeypatch.setattr(M.ProgramMemo, "run", lambda memo, ga: ga.process_program(memo.prog))
    assert got == compute_sweep(path, backend, SWEEP)
    return len(replays)


@pytest.mark.parametrize("backend", ["cpu", "cuda", "metal"])
@pytest.mark.parametrize("arch", ARCHS)
def test_predictions_with_replayed_runs_equal_the_walk(arch: str, backend: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # (Metal allocates these small synthetic graphs whole, the layers not cut into programs: nothing to replay)
    replays = _replays_equal_the_walk(str(build(arch)), backend, monkeypatch)
    assert replays or backend == "metal"


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_full_size_predictions_with_replayed_runs_equal_the_walk(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.6-35B-A3B's shape: on Metal its reordered layers are chunks (fitter.ggml.backends.metal.segments)."""
    from tests.synth.shapes import build_shape

    assert _replays_equal_the_walk(str(build_shape("qwen36-35b-a3b")), backend, monkeypatch)
