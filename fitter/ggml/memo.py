"""A program's recorded runs (ggfit's own): process_program's decisions, replayed where they would be the same.

A program (a segment's or a chunk's nodes, fitter.ggml.replay) that runs again from the same state replays the
allocations, reuses and frees it decided before (ProgramMemo, RecordedRun: fitter.ggml.alloc.Gallocr tells them as
a Recorder), without walking its nodes again; and where it meets the same sizes in buffers whose upper part moved
since, takes that outcome moved (fitter.ggml.shifted).
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Iterable

from fitter.ggml.alloc import ALLOC, FREE, REUSE, Gallocr
from fitter.ggml.graph import Program
from fitter.ggml.tensor import Tensor

if TYPE_CHECKING:
    from fitter.ggml.shifted import Shifted

_STATE = attrgetter("own", "nc", "nv")


class RecordedRun:
    """One recorded run of a program: the layout tests it made (ggml_are_same_layout: child, parent, answer), in order;
    its events (ALLOC t / REUSE t of parent p / FREE t, as event, t, p or t); the children / views counts it changed,
    of the tensors read after it. Each as parallel lists (a graph kept is walked by the cyclic collector: few objects).
    `outside`: it placed a source that may take a parent's memory, deciding from that parent's state (a tensor the
    program may not reach, so not in its key). Once recorded whole (`close`), what fitter.ggml.shifted reads: the
    tensors it places (allocates or reuses a parent for), in order, and at which event; those placed before it that it
    frees or whose memory it reuses; each tensor's `own` after it; the buffers it touches (a tensor's buffer is fixed in
    a graph, a reuse takes its parent's); its outcomes by their entry's key (None while recording, and once given up:
    see fitter.ggml.shifted.replay)."""

    __slots__ = ("checks", "ops", "counts", "outside", "placed", "at", "before", "owns", "buffers", "shifts", "misses")

    def __init__(self) -> None:
        self.outside = False
        self.checks: tuple[list[Tensor], list[Tensor], list[bool]] = ([], [], [])
        self.ops: tuple[list[int], list[Tensor], list[Tensor]] = ([], [], [])
        self.counts: tuple[list[Tensor], list[int], list[int]] = ([], [], [])
        self.placed: list[Tensor] = []
        self.at: list[int] = []  # each placement's event
        self.before: list[Tensor] = []
        self.owns: tuple[list[Tensor], list[bool]] = ([], [])
        self.buffers: list[int] = []
        self.shifts: dict[tuple, Shifted] | None = None
        self.misses = 0  # outcomes missed in a row before the first hit (-1 after it)

    def close(self) -> None:
        """The run recorded whole: what fitter.ggml.shifted reads of it, worked out once."""
        owns: dict[Tensor, bool] = {}
        buffers: set[int] = set()
        for k, (op, t, p) in enumerate(zip(*self.ops)):
            x = p if op == REUSE else t
            if op != ALLOC and x not in owns:
                self.before.append(x)
            buffers.add(x.be)
            if op == FREE:
                owns[t] = False
                continue
            self.placed.append(t)
            self.at.append(k)
            owns[t] = True
            if op == REUSE:
                owns[p] = False
        self.owns = (list(owns), list(owns.values()))
        self.buffers = sorted(buffers)
        self.shifts = {}

    def check(self, t: Tensor, p: Tensor, same: bool) -> None:
        ts, ps, answers = self.checks
        ts.append(t)
        ps.append(p)
        answers.append(same)

    def event(self, op: int, t: Tensor, p: Tensor) -> None:
        events, ts, ps = self.ops
        events.append(op)
        ts.append(t)
        ps.append(p)


class ProgramMemo:
    """A program run again and again (a layer's segment, a chunk of Metal's reordered layers), its runs recorded.

    process_program decides from its tensors' state alone (allocated or not, n_children, n_views, and the layout test
    where a node may run in place) what to allocate, reuse and free; sizes and addresses only follow those decisions.
    The caller resets the state of its own tensors before each run (`reset`, a segment's or chunk's, but for the `loose`
    placeholders it hands the previous output), so the decisions follow from the state of the others (`entry`: the
    global tensors it reads, the placeholders) and the layout tests' answers. A run whose entry state was met before,
    and whose layout tests answer as they did then, replays the events recorded (`replay`): the same calls to the
    dynamic allocators, in the same order. The first run records nothing (a program run once, as by `fit -c`, costs
    nothing more). A recorded run that placed one of its sources in place of a parent (RecordedRun.outside) decided from a
    tensor the key may not hold: the program is walked from then on."""

    __slots__ = ("prog", "reset", "loose", "kept", "ran", "walks", "entry", "watch", "runs")

    def __init__(self, prog: Program, reset: Iterable[Tensor], loose: Iterable[Tensor], kept: Iterable[Tensor]) -> None:
        # the tensors the caller resets before each run, those of them it then hands a state (placeholders), and the
        # tensors it reads after a run; iterables read once, at the second run (the first needs none of them)
        self.prog, self.reset, self.loose, self.kept = prog, reset, loose, kept
        self.ran = False
        self.walks = False  # a run was decided by a tensor outside the key (RecordedRun.outside): every run is walked
        self.entry: list[Tensor] = []
        self.watch: list[Tensor] | None = None  # (worked out at the second run)
        self.runs: dict[tuple, RecordedRun] = {}

    def _tensors(self) -> None:
        touched: dict[Tensor, None] = {}
        for node, _, allocs, uses in zip(*self.prog):
            touched[node] = None
            touched.update(dict.fromkeys(allocs))
            for p in uses:
                touched[p] = None
                if p.vs is not None:
                    touched[p.vs] = None
            if node.inpl:
                touched.update(dict.fromkeys(p for p in node.src if p is not None))
        # an external tensor is never allocated (its counts decide nothing), a fixed one is reset before each run
        fixed = set(self.reset).difference(self.loose)
        keep = set(self.kept)
        self.entry = [t for t in touched if not t.ext and t not in fixed]
        self.watch = [t for t in touched if t not in fixed or t in keep]  # the counts read after a run

    def run(self, ga: Gallocr) -> None:
        """ga.process_program(self.prog), replayed where its entry state was recorded."""
        if self.walks or not self.ran:
            self.ran = True
            ga.process_program(self.prog)
            return
        if self.watch is None:
            self._tensors()
        key = tuple(map(_STATE, self.entry))
        run = self.runs.get(key)
        if run is not None:
            for t, p, same in zip(*run.checks):
                if (p.type == t.type and p.ne == t.ne and p.nb == t.nb) is not same:  # as _place tested it
                    break
            else:
                replay(ga, run)
                return
        before = [(t, t.nc, t.nv) for t in self.watch or ()]
        ga._rec = run = RecordedRun()
        try:
            ga.process_program(self.prog)
        finally:
            ga._rec = None
        if run.outside:
            self.walks = True
            self.runs.clear()
            return
        changed = [(t, t.nc - nc, t.nv - nv) for t, nc, nv in before if t.nc != nc or t.nv != nv]
        run.counts = ([t for t, _, _ in changed], [a for _, a, _ in changed], [b for _, _, b in changed])
        run.close()
        if len(self.runs) >= _RUNS_MAX:
            self.runs.pop(next(iter(self.runs)))
        self.runs[key] = run


_RUNS_MAX = 64  # entry states a program keeps runs for (one per place it runs in a graph, at most a few dozen)


def replay(ga: Gallocr, run: RecordedRun) -> None:
    """process_program's run as recorded (ProgramMemo): its allocations, in-place reuses and frees, without the
    walk over nodes and sources that decided them; then the children / views counts it left. A run that met the
    same sizes before, in buffers moved since (fitter.ggml.shifted), takes that outcome moved."""
    if run.shifts is None:
        ga._events(zip(*run.ops))
    else:
        from fitter.ggml import shifted  # (imported by a command's first replay, not by every command)

        shifted.replay(ga, run)
    for t, dnc, dnv in zip(*run.counts):
        t.nc += dnc
        t.nv += dnv
