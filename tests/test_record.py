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
