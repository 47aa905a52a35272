"""fitter.record.Record: a dataclass whose __init__, __repr__, __eq__ and __hash__ are Record's, behaving as the
dataclass decorator's would, with pydantic's model methods through a TypeAdapter."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from fitter.record import Record


class _Frozen(Record):
    name: str
    n: int = 0
    items: list[int] = dataclasses.field(default_factory=list)


class _Mutable(Record, frozen=False):
    name: str
    n: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Reference:  # what the dataclass decorator makes of _Frozen's fields
    name: str
    n: int = 0
    items: list[int] = dataclasses.field(default_factory=list)


def test_behaves_as_the_dataclass_decorator_would():
    a, ref = _Frozen(name="x", n=2), _Reference(name="x", n=2)
    assert repr(a) == repr(ref).replace("_Reference", "_Frozen")
    assert dataclasses.is_dataclass(a) and [f.name for f in dataclasses.fields(a)] == ["name", "n", "items"]
    assert a == _Frozen(n=2, name="x") and a != _Frozen(name="x") and a != ref
    assert a.items == [] and a.items is not _Frozen(name="x").items  # default_factory, once per instance
    assert dataclasses.replace(a, n=3) == _Frozen(name="x", n=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.n = 3  # type: ignore[misc]
    with pytest.raises(TypeError, match="missing name"):
        _Frozen()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="no field nope"):
        _Frozen(name="x", nope=1)  # type: ignore[call-arg]


class _InOrder(Record, kw_only=False):
    name: str
    n: int = 0
    items: list[int] = dataclasses.field(default_factory=list)


def test_kw_only_false_takes_the_fields_in_order_as_the_decorator_would():
    assert _InOrder("x", 2) == _InOrder("x", n=2) == _InOrder(name="x", n=2)
    assert _InOrder("x").items == [] and _InOrder("x", 1, [3]).items == [3]
    with pytest.raises(TypeError, match="n given twice"):
        _InOrder("x", 2, n=3)  # type: ignore[misc]
    with pytest.raises(TypeError, match="at most 3 positional"):
        _InOrder("x", 1, [], 4)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing name"):
        _InOrder(n=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="keyword arguments only"):
        _Frozen("x")  # type: ignore[misc]


def test_hash_is_the_fields_in_order():
    f = _Frozen.model_fields
    assert list(f) == ["name", "n", "items"] and f["n"].default == 0

    class Two(Record):
        a: int
        b: tuple[int, ...] = ()

    assert hash(Two(a=1, b=(2,))) == hash(Two(b=(2,), a=1)) == hash((1, (2,)))
    m = _Mutable(name="x")
    m.n = 5
    m.cached = "not a field"  # type: ignore[attr-defined]  # compared as a dataclass: the fields only
    assert m == _Mutable(name="x", n=5)
    with pytest.raises(TypeError):
        hash(m)


def test_model_methods():
    a = _Frozen(name="x", items=[1])
    b = a.model_copy(update={"n": 4})
    assert (b.n, b.items is a.items, a.n) == (4, True, 0)  # shallow and unchecked, as pydantic's
    with pytest.raises(TypeError):
        a.model_copy(update={"nope": 1})
    assert a.model_dump() == {"name": "x", "n": 0, "items": [1]}
    assert a.model_dump_json() == '{"name":"x","n":0,"items":[1]}'
    assert _Frozen.model_validate({"name": "x", "n": "3"}) == _Frozen(name="x", n=3)


def test_fitter_does_not_import_pydantic():
    code = ("import sys, fitter.fit.solver, fitter.fit.quant_fit, fitter.llama.model; "
            "sys.exit('pydantic' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_field_options_record_does_not_honour_are_refused():
    with pytest.raises(TypeError, match="takes? every field"):
        class Bad(Record):
            a: int
            b: int = dataclasses.field(default=0, compare=False)


def _every_record() -> list[type]:
    """Every Record subclass in fitter, search and the CLI (their modules imported)."""
    import importlib
    import pkgutil

    import fitter
    import search

    for pkg in (fitter, search):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not m.name.rsplit(".", 1)[-1].startswith("_"):
                importlib.import_module(m.name)
    importlib.import_module("cli")
    out, todo = [], list(Record.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] in ("fitter", "search", "cli"):  # not the tests' own (some refused)
            out.append(cls)
        todo += cls.__subclasses__()
    return out


def test_fields_are_the_ones_the_dataclass_decorator_finds():
    # Record reads each class's fields itself and makes it a dataclass only when asked (fitter.record._Lazy): for
    # every Record, what it read is what dataclasses then finds
    records = _every_record()
    assert len(records) > 40
    for cls in records:
        names, defaults, factories = cls._names, dict(cls._defaults), dict(cls._factories)
        assert "__dataclass_fields__" in cls.__dict__
        fields = dataclasses.fields(cls)  # made a dataclass here
        assert names == tuple(f.name for f in fields), cls
        assert defaults == {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}, cls
        assert factories == {f.name: f.default_factory for f in fields if f.default_factory is not dataclasses.MISSING}
        assert list(cls.model_fields) == list(names)


def test_a_record_becomes_a_dataclass_when_first_asked():
    class Base(Record):
        a: int
        b: list[int] = dataclasses.field(default_factory=list)

    class Sub(Base):
        c: int = 3
        a: int = 1  # declared again: keeps its place, takes the default

    assert not dataclasses.is_dataclass(Record)
    assert type(Sub.__dict__["__dataclass_fields__"]).__name__ == "_Lazy"
    assert Sub._names == ("a", "b", "c") and Sub._defaults == {"a": 1, "c": 3}
    assert Sub() == Sub(a=1, b=[], c=3) and Sub(a=2).b == []
    assert dataclasses.is_dataclass(Sub) and [f.name for f in dataclasses.fields(Sub)] == ["a", "b", "c"]
    assert isinstance(Base.__dict__["__dataclass_fields__"], dict)  # the base made one on the way
    assert dataclasses.replace(Sub(a=5), c=4) == Sub(a=5, c=4)
    assert Base(a=1).model_dump() == {"a": 1, "b": []}


_NONE_MADE = """
import contextlib, io, sys
import cli
from fitter.record import Record
for argv in (["fit", sys.argv[1], "--budget", "8GiB", "--backend", "metal"], ["quants", sys.argv[1], "--budget", "8GiB"]):
    sys.argv = ["ggfit", *argv]
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main()
        except SystemExit as e:
            assert not e.code, e.code
made, todo = [], list(Record.__subclasses__())
while todo:
    cls = todo.pop()
    todo += cls.__subclasses__()
    if isinstance(cls.__dict__.get("__dataclass_fields__"), dict):
        made.append(cls.__qualname__)
print(sorted(made))
"""


def test_the_commands_make_no_record_a_dataclass(moe):
    # making each Record a dataclass costs about 1% of a command (fitter.record's docstring): `fit` and `quants` ask none
    out = subprocess.run([sys.executable, "-c", _NONE_MADE, moe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
