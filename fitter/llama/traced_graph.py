"""A built graph kept for reuse (ggfit's own): its cache sizes and tokens traced as forms (fitter.ggml.symbolic),
evaluated again for another n_ctx or n_ubatch of the same model and context where the trace's guards hold.

fitter.llama.context builds, places and splits a graph once under `trace()` and keeps it here (`_Traced`, in
`_TRACED`); `_allocated` there reuses it. `predict_once` turns the trace off for callers that ask each graph once.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Callable, Iterator

from fitter.cache import CACHES
from fitter.ggml.alloc import AllocResult, Gallocr
from fitter.ggml.graph import Segment
from fitter.ggml.symbolic import MONOMIALS, Sym, form, monomials
from fitter.ggml.tensor import _NB_SLOT, Tensor
from fitter.llama.graph import GraphContext
from fitter.llama.graph_details import GraphDetails

# a shape (ne or nb) of a traced tensor, once per index: its getter of the forms' values (_take), whether a cell count
# reaches it, its plain values, and the values themselves (kept alive: the index is by their identities)
_Shape = tuple[Callable[[list[int]], tuple[int, ...]], bool, list[int], list[int]]


class _Forms:
    """The distinct forms of a traced graph's shapes, indexed as first met (`forms`; `cell_forms`: those with a
    cell count, `of_cells` their indices): the index of a value's form by the value (`ix`), of a shape's (`shape`)."""

    def __init__(self) -> None:
        self.forms: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self.cell_forms: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self.index: dict[tuple[int, ...], int] = {}
        self.cells = [j for j, mono in enumerate(MONOMIALS) if 0 in mono or 1 in mono]  # the monomials with a cell count
        self.of_cells: set[int] = set()  # the forms with one
        # the index of a value's form, by the value: most shapes share their Syms (the tokens) and small ints
        self.of_sym: dict[int, tuple[int, Sym]] = {}  # by the Sym's identity (the Sym kept alive here)
        self.of_int: dict[int, int] = {}
        # each shape by its values' identities (most tensors share the very Syms and ints of their shape with others)
        self.of_shape: dict[tuple[int, ...], _Shape] = {}

    def at(self, f: tuple[int, ...]) -> int:
        i = self.index.get(f)
        if i is None:
            i = self.index[f] = len(self.index)
            sparse = (i, tuple((j, a) for j, a in enumerate(f[:-1]) if a) + ((-1, f[-1]),))
            self.forms.append(sparse)
            if any(f[j] for j in self.cells):
                self.cell_forms.append(sparse)
                self.of_cells.add(i)
        return i

    def ix(self, x: int) -> int:
        if type(x) is Sym:
            hit = self.of_sym.get(id(x))
            if hit is None:
                hit = self.of_sym[id(x)] = (self.at(form(x)), x)
            return hit[0]
        i = self.of_int.get(x)
        if i is None:
            i = self.of_int[x] = self.at(form(x))
        return i

    def shape(self, xs: list[int]) -> _Shape:
        key = tuple(map(id, xs))
        hit = self.of_shape.get(key)
        if hit is None:
            at_ = [self.ix(x) for x in xs]
            hit = self.of_shape[key] = (_take(at_), not self.of_cells.isdisjoint(at_), [int.__int__(x) for x in xs], xs)
        return hit


class _Traced:
    """A graph built, placed and split once with its cache sizes and tokens symbolic (fitter.ggml.symbolic), for
    every context that differs from it only in those and keeps its guards: each tensor whose shape (or preset size:
    the scheduler's copies) follows from them gets it evaluated, every tensor its allocator state reset.

    What only the tokens reach (most activations) is evaluated again only when the tokens change, and kept with
    their alloc sizes (Tensor.memo) per tokens value: a sweep of n_ctx at one ubatch, or a few ubatches in turn, pays
    for the tensors the cells reach."""

    __slots__ = ("spec", "details", "guards", "run", "ts", "sizes", "bes", "types_read", "cell_shapes", "token_shapes",
                 "token_groups", "token_tensors", "token_sizes", "forms", "cell_forms", "v", "fresh_cells", "fresh_tokens",
                 "tokens_at", "at_tokens")

    def __init__(self, c: GraphContext, details: GraphDetails | None, guards: set, run: Callable[[Gallocr], AllocResult],
                 segs: list[Segment], types_read: bool, values: tuple[int, int, int]) -> None:
        self.spec = c.spec
        self.details = details
        self.guards = list(guards)
        self.run = run
        self.types_read = types_read
        seen = _reachable(segs)
        self._index(seen)
        m = (*monomials(values), 1)
        self.v = [sum([m[j] * a for j, a in f]) for _, f in self.forms]  # the forms' values at the values applied
        self._fresh(seen)
        self.token_sizes = [(i, size) for _, i, _, _, size in self.token_shapes if size >= 0 and i >= 0]
        # the token_shapes' tensors by their shapes' getters (ne, nb): a group's tensors have equal shapes at any
        # tokens, and _move gives them one list each (no code changes a shape's list in place)
        groups: dict[tuple, list[Tensor]] = {}
        for t, _, ne, nb, _ in self.token_shapes:
            groups.setdefault((ne, nb), []).append(t)
        self.token_groups = [(ne, nb, ts) for (ne, nb), ts in groups.items()]
        self.tokens_at = values[2]  # the tokens the graph's shapes and alloc sizes are at
        # tokens -> the token_tensors' (tensor, ne, nb, alloc size) there (fresh_cells' alloc sizes reset after)
        self.at_tokens: dict[int, list[tuple]] = {}

    def _index(self, seen: dict[Tensor, None]) -> None:
        """Each tensor's shape (and preset size) as indices in the distinct forms, its Syms replaced by their values."""
        # before the first allocation, in parallel lists (fewer objects for the collector): the tensors the allocator
        # may touch (not weights and caches, never allocated, their counts never read), their sizes and backends
        self.ts: list[Tensor] = []
        self.sizes: list[int] = []
        self.bes: list[int] = []
        # where the variables reach: (tensor, its index in ts or -1, ne, nb, preset size or -1): ne and nb as getters of
        # their forms' values (_take), the size an index in the distinct forms, kept sparse ((monomial, coefficient),
        # ..., (-1, constant)); where a cell count reaches, and where the tokens alone do
        self.cell_shapes: list[tuple] = []
        self.token_shapes: list[tuple] = []
        forms = _Forms()
        self.forms, self.cell_forms = forms.forms, forms.cell_forms
        ix, shape, of_cells = forms.ix, forms.shape, forms.of_cells

        ts, sizes, bes = self.ts, self.sizes, self.bes
        for t in seen:
            nb, size = _NB_SLOT.__get__(t, Tensor), t.size
            k = len(ts) if not t.ext else -1
            if type(size) is Sym or Sym in map(type, t.ne) or Sym in map(type, nb):
                (ne_of, ne_cells, ne, _), (nb_of, nb_cells, nb, _) = shape(t.ne), shape(nb)
                size_at = ix(size) if type(size) is Sym else -1
                e = (t, k, ne_of, nb_of, size_at)
                if ne_cells or nb_cells or size_at in of_cells:
                    self.cell_shapes.append(e)
                else:
                    self.token_shapes.append(e)
                t.ne = list(ne)
                t.nb = list(nb)  # (a plain store: only reading a weight's nb marks types read)
                t.size = size = int.__int__(size)
            if k >= 0:
                ts.append(t)
                sizes.append(size)
                bes.append(t.be)

    def _fresh(self, seen: dict[Tensor, None]) -> None:
        # the tensors whose alloc size the variables reach: their own shapes or their sources' (FLASH_ATTN_EXT's
        # K and V, MUL_MAT_ID's ids): computed again at each reuse (those the tokens alone reach: when they change,
        # or as they were at those tokens), the others' kept (Tensor.memo)
        dep_cells = {e[0] for e in self.cell_shapes}
        dep = dep_cells | {e[0] for e in self.token_shapes}
        self.fresh_cells: list[Tensor] = []
        self.fresh_tokens: list[Tensor] = []
        for t in seen:
            if t in dep_cells or (t.src and not dep_cells.isdisjoint(t.src)):
                self.fresh_cells.append(t)
            elif t in dep or (t.src and not dep.isdisjoint(t.src)):
                self.fresh_tokens.append(t)
        # what moves with the tokens alone: fresh_tokens, and the token_shapes' tensors in fresh_cells (a source's)
        in_fresh = set(self.fresh_tokens)
        self.token_tensors = self.fresh_tokens + [e[0] for e in self.token_shapes if e[0] not in in_fresh]

    @staticmethod
    def values(c: GraphContext) -> tuple[int, int, int]:
        """The variables (fitter.ggml.symbolic.N_VARS) for this context: the cells, the SWA cells, the tokens."""
        return c.cells(), c.cells(swa=True), c.n_tokens // c.tokens_unit if c.tokens_unit else 0

    def apply(self, values: tuple[int, int, int]) -> None:
        m = (*monomials(values), 1)  # the constant's monomial last (index -1)
        moved = values[2] != self.tokens_at
        v = self.v
        for i, f in self.forms if moved else self.cell_forms:
            v[i] = sum([m[j] * a for j, a in f])
        sizes = self.sizes
        if moved:
            self._move(values[2])
        for t, i, ne, nb, size in self.cell_shapes:
            t.ne = list(ne(v))
            t.nb = list(nb(v))
            if size >= 0 and i >= 0:
                sizes[i] = v[size]
        for t in self.fresh_cells:
            t.memo = None
        for t, size, be in zip(self.ts, sizes, self.bes):
            t.own = False
            t.nc = 0
            t.nv = 0
            t.size = size
            t.be = be

    def _move(self, tokens: int) -> None:
        """The tensors the tokens alone reach, to these tokens: as they were left there, or evaluated (self.v)."""
        kept = self.at_tokens
        if self.tokens_at not in kept:  # as the first allocation at those tokens left them (every later one alike)
            tt = self.token_tensors  # (zip and map: no Python frame a tensor)
            kept[self.tokens_at] = list(zip(tt, map(_NE, tt), map(_NB_SLOT.__get__, tt, repeat(Tensor)), map(_MEMO, tt)))
            if len(kept) > _AT_TOKENS_MAX:
                kept.pop(next(iter(kept)))
        self.tokens_at = tokens
        v, sizes = self.v, self.sizes
        back = kept.get(tokens)
        if back is None:
            for ne_of, nb_of, ts in self.token_groups:
                ne, nb = list(ne_of(v)), list(nb_of(v))
                for t in ts:
                    t.ne = ne
                    t.nb = nb
            for t in self.fresh_tokens:
                t.memo = None
        else:
            for t, ne, nb, mt in back:
                t.ne = ne
                t.nb = nb
                t.memo = mt
        for i, size in self.token_sizes:
            sizes[i] = v[size]


_NE = attrgetter("ne")
_MEMO = attrgetter("memo")


def _take(at: list[int]) -> Callable[[list[int]], tuple[int, ...]]:
    """The values (_Traced.v) of a shape's forms, in one C call (a tuple, whatever the number of dimensions)."""
    if len(at) == 1:
        i = at[0]
        return lambda v: (v[i],)
    return itemgetter(*at) if at else (lambda v: ())


_AT_TOKENS_MAX = 8  # tokens values a traced graph keeps its tensors at: `fit` asks 5 ubatches, a study a few
_TRACED: dict[tuple, _Traced] = CACHES.keep({}, "traced")
_TRACED_BY_CONTENT: dict[tuple, _Traced] = CACHES.keep({}, "traced")  # those that read no weight's type, by content (_allocated)
# dropped at exit, before the interpreter's last collection walks them (~10 ms off a `fit`)
atexit.register(_TRACED.clear)
atexit.register(_TRACED_BY_CONTENT.clear)
# a few graphs, the most recently used: a search or a sweep asks one (model, ubatch, K/V type) after another, and
# every graph kept is ~3K objects the cyclic collector walks again and again (and once more at exit)
_TRACED_MAX = 4


class Tracing(threading.local):
    """Whether a graph built now, in this thread, is traced for reuse (predict_once: not), on this object rather than
    in a module name; CACHES.clear() (the tests' fixture) restores the default."""

    on: bool = True

    def clear(self) -> None:
        self.on = True


TRACING = CACHES.keep(Tracing(), "traced")


@contextlib.contextmanager
def predict_once() -> Iterator[None]:
    """Inside, a graph is built and allocated for its one prediction, not traced for another n_ctx or n_ubatch
    (a traced graph already kept is still reused): for a caller that asks each model, context and placement once, as
    `ggfit fit -c` does, the trace is work no later prediction uses (~6% of that command's instructions)."""
    was, TRACING.on = TRACING.on, False
    try:
        yield
    finally:
        TRACING.on = was


def _reachable(segs: list[Segment]) -> dict[Tensor, None]:
    """Every tensor the segments' nodes, leafs, created tensors and placeholders reach (tensors hash by identity)."""
    seen: dict[Tensor, None] = {}
    stack: list = []
    for seg in segs:
        stack += seg.nodes
        stack += seg.leafs
        stack += seg.created
        stack.append(seg.inp)
    pop = stack.pop
    while stack:
        t = pop()
        if t is None or t in seen:
            continue
        seen[t] = None
        stack += t.src
        if t.vs is not None:
            stack.append(t.vs)
    return seen
