"""Cache sizes and the ubatch as integer forms, so that one built graph serves every context size and ubatch
(ggfit's own, not ggml's).

A graph built for one n_ctx and n_ubatch differs from the graph for another only where the KV caches' cell counts
and the number of tokens reach: the caches, the masks, the activations, the views of K and V and the scores over
them. While a graph is traced, those counts are `Sym`s: ints that also carry how they follow from the variables
(the cell counts and the tokens, as k . m + c over the monomials m of degree one and two of the variables, so that
a stride of cells x tokens keeps its form). Arithmetic that stays in that form keeps it; every other use of the
value (a comparison, a branch, a non-exact division, a product of degree three, an index, a string) returns the
plain value and records a guard: the condition that the use gives the same answer. For other values of the
variables, where every guard holds, the same program takes the same path, so the graph has the same nodes,
placement and splits, and each shape is its form evaluated at the new values.
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Callable

from fitter.cache import CACHES

# the variables: 0 the full KV cache's cells (n_ctx_seq), 1 the sliding-window cache's (swa_cells), 2 the tokens
# of the reserved ubatch in units of a power of two (GraphContext.tokens_unit: GGML_PAD and chunkings stay exact)
N_VARS = 3
# the monomials a form's coefficients go with: the variables, then their products of two
MONOMIALS: tuple[tuple[int, ...], ...] = (*((i,) for i in range(N_VARS)),
                                          *((i, j) for i in range(N_VARS) for j in range(i, N_VARS)))
N_MONO = len(MONOMIALS)
_LINEAR = N_VARS  # the coefficients past it are of degree two
_PRODUCT = {(i, j): MONOMIALS.index((min(i, j), max(i, j))) for i in range(N_VARS) for j in range(N_VARS)}
_ZERO = (0,) * N_MONO

# (coefficients, constant, op, argument, expected): op(value, argument) == expected must hold for a reuse
Guard = tuple[tuple[int, ...], int, Callable[[Any, Any], Any], Any, Any]

class Recording(threading.local):
    """The guards of the trace this thread records (`trace`; None: none), on this object, not in a module name;
    CACHES.clear() (the tests' fixture) ends any a failed test left."""

    guards: set[Guard] | None = None

    def clear(self) -> None:
        self.guards = None


RECORDING = CACHES.keep(Recording(), "traced")


def _record(k: tuple[int, ...], c: int, op: Callable[[Any, Any], Any], arg: Any, expected: Any) -> None:
    g = RECORDING.guards
    if g is not None:
        g.add((k, c, op, arg, expected))


def _mk(k: tuple[int, ...], c: int, value: int) -> int:
    if not any(k):
        return c
    return Sym(value, k, c)


class Sym(int):
    """An int traced as k . cells + c (see the module's docstring)."""

    k: tuple[int, ...]
    c: int

    def __new__(cls, value: int, k: tuple[int, ...], c: int) -> "Sym":
        o = int.__new__(cls, value)
        o.k = k
        o.c = c
        return o

    @classmethod
    def var(cls, i: int, value: int, unit: int = 1) -> "Sym":
        """Variable i, whose value here is `value` (a multiple of `unit`): unit . x_i."""
        return cls(value, tuple(unit if j == i else 0 for j in range(N_MONO)), 0)

    def pin(self) -> int:
        """The plain value, on the guard that it stays this value."""
        v = int.__int__(self)
        _record(self.k, self.c, operator.eq, v, True)
        return v

    # -- affine arithmetic ----------------------------------------------------------------------------------
    def __add__(self, o: Any) -> Any:
        if type(o) is Sym:
            return _mk(tuple(a + b for a, b in zip(self.k, o.k)), self.c + o.c, int.__add__(self, o))
        if isinstance(o, int):
            return Sym(int.__add__(self, o), self.k, self.c + int(o))
        return self.pin() + o

    __radd__ = __add__

    def __neg__(self) -> Any:
        return Sym(-int.__int__(self), tuple(-a for a in self.k), -self.c)

    def __pos__(self) -> "Sym":
        return self

    def __sub__(self, o: Any) -> Any:
        if isinstance(o, int):
            return self + (-o)
        return self.pin() - o

    def __rsub__(self, o: Any) -> Any:
        if isinstance(o, int):
            return (-self) + o
        return o - self.pin()

    def __mul__(self, o: Any) -> Any:
        if type(o) is Sym:
            a, b = self.k, o.k
            if any(a[_LINEAR:]) or any(b[_LINEAR:]):  # degree three: pinned
                return self.pin() * o.pin()
            ca, cb = self.c, o.c  # (a . x + ca)(b . x + cb)
            k = [x * cb + y * ca for x, y in zip(a, b)]
            for i in range(_LINEAR):
                if a[i]:
                    for j in range(_LINEAR):
                        if b[j]:
                            k[_PRODUCT[i, j]] += a[i] * b[j]
            return _mk(tuple(k), ca * cb, int.__mul__(self, o))
        if isinstance(o, int):
            o = int(o)
            return _mk(tuple(a * o for a in self.k), self.c * o, int.__mul__(self, o))
        return self.pin() * o

    __rmul__ = __mul__

    def __floordiv__(self, o: Any) -> Any:
        if type(o) is not Sym and isinstance(o, int) and o and all(a % o == 0 for a in self.k):
            o = int(o)  # (k s + c) // d = (k / d) s + c // d when d divides every k
            return _mk(tuple(a // o for a in self.k), self.c // o, int.__floordiv__(self, o))
        if type(o) is not Sym and isinstance(o, int) and o:
            q = int.__floordiv__(self, o)
            _record(self.k, self.c, operator.floordiv, int(o), q)
            return q
        return self.pin() // (o.pin() if type(o) is Sym else o)

    def __mod__(self, o: Any) -> Any:
        if type(o) is not Sym and isinstance(o, int) and o:
            o = int(o)
            if all(a % o == 0 for a in self.k):
                return self.c % o
            r = int.__mod__(self, o)
            _record(self.k, self.c, operator.mod, o, r)
            return r
        return self.pin() % (o.pin() if type(o) is Sym else o)

    # -- comparisons: the sign of the difference is guarded ------------------------------------------------
    def _cmp(self, o: Any, op: Callable[[Any, Any], bool]) -> Any:
        if not isinstance(o, int):
            return op(self.pin(), o)
        d = self - o
        r = op(int(d) if type(d) is not Sym else int.__int__(d), 0)
        if type(d) is Sym:
            _record(d.k, d.c, op, 0, r)
        return r

    def __lt__(self, o: Any) -> Any:
        return self._cmp(o, operator.lt)

    def __le__(self, o: Any) -> Any:
        return self._cmp(o, operator.le)

    def __gt__(self, o: Any) -> Any:
        return self._cmp(o, operator.gt)

    def __ge__(self, o: Any) -> Any:
        return self._cmp(o, operator.ge)

    def __eq__(self, o: object) -> Any:
        return self._cmp(o, operator.eq)

    def __ne__(self, o: object) -> Any:
        return self._cmp(o, operator.ne)

    def __bool__(self) -> bool:
        return bool(self._cmp(0, operator.ne))

    # -- any other use: the plain value, pinned ---------------------------------------------------------------
    def __hash__(self) -> int:
        return hash(self.pin())

    def __int__(self) -> int:
        return self.pin()

    def __index__(self) -> int:
        return self.pin()

    def __float__(self) -> float:
        return float(self.pin())

    def __repr__(self) -> str:
        return repr(self.pin())

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(self.pin(), spec)


def _pinned(name: str) -> Callable[..., Any]:
    base = getattr(int, name)

    def f(self: Sym, *args: Any) -> Any:
        return base(self.pin(), *(a.pin() if type(a) is Sym else a for a in args))

    f.__name__ = name
    return f


for _name in ("__truediv__", "__rtruediv__", "__rfloordiv__", "__rmod__", "__divmod__", "__rdivmod__", "__pow__",
              "__rpow__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__",
              "__rlshift__", "__rshift__", "__rrshift__", "__invert__", "__abs__", "__round__", "__trunc__",
              "__floor__", "__ceil__", "bit_length", "to_bytes", "as_integer_ratio", "conjugate"):
    setattr(Sym, _name, _pinned(_name))


def form(v: int) -> tuple[int, ...]:
    """v as (k..., c): its coefficients on the monomials (MONOMIALS) and its constant."""
    if type(v) is Sym:
        return (*v.k, v.c)
    return (*_ZERO, int(v))


def monomials(values: tuple[int, ...]) -> tuple[int, ...]:
    """The monomials (MONOMIALS) at these values of the variables."""
    out = list(values)
    for m in MONOMIALS[_LINEAR:]:
        out.append(values[m[0]] * values[m[1]])
    return tuple(out)


def holds(guards: list[Guard], values: tuple[int, ...]) -> bool:
    """Whether every guard of a trace gives the same answer at these values of the variables."""
    m = monomials(values)
    for k, c, op, arg, expected in guards:
        v = c
        for a, x in zip(k, m):
            if a:
                v += a * x
        if op(v, arg) != expected:
            return False
    return True


class trace:
    """`with trace() as guards:` records the guards of the Syms used inside it."""

    def __enter__(self) -> set[Guard]:
        self.prev = RECORDING.guards
        g: set[Guard] = set()
        RECORDING.guards = g
        return g

    def __exit__(self, *exc: object) -> None:
        RECORDING.guards = self.prev

