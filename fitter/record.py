"""Records: fitter's data types are dataclasses with the few pydantic model methods ggfit uses.

ModelSpec, RunConfig, Prediction and the rest are built by ggfit's own code from values it has already read and
checked (the GGUF reader, the CLI's typed flags, RunConfig's own checks), so nothing validates them again at
construction. pydantic is imported, and a record's schema built, only where a record crosses into or out of the
program: `--json`, the calibration store, a study file, a stored probe result. Importing fitter's solver costs
545M instructions this way, 905M with pydantic models (its import and 21 schemas). The CLI pays pydantic's
import anyway (typer >= 0.28 coerces every parameter through a pydantic TypeAdapter); it still saves the
schemas, about 50M of `ggfit fit -c` (issue 14).

A subclass of `Record` behaves as a dataclass, keyword-only and frozen unless declared `class X(Record, frozen=False)`;
`kw_only=False` lets its fields be given in order too, as the decorator's dataclass takes them.
Record reads a subclass's fields from its annotations and class attributes, as the decorator does, and takes
`__init__`, `__repr__`, `__eq__` and `__hash__` from Record, written once here. The decorator would compile those four
(and the frozen `__setattr__` and `__delattr__`) again for every class: about 5M instructions a class, 100M of every
command's imports. The class is made a dataclass (`dataclasses.dataclass(init=False, repr=False, eq=False)`, for
`dataclasses.fields`, `replace`, `is_dataclass` and pydantic's support of dataclasses) the first time one of those
asks (`_Lazy`): on the commands' paths none is, and making each one at import cost about 1% of a command (14M
instructions of `ggfit fit`'s, 37 classes; 18M of `ggfit quants`', 43).

The methods keep pydantic's names and behaviour, so search, the CLI and scripts that called them on pydantic models
are unchanged: `model_copy(update=...)` sets fields without checking them, as pydantic's does; `model_dump`,
`model_dump_json` and `model_validate` go through a `pydantic.TypeAdapter` of the dataclass, which dumps and
validates a dataclass as it does a model with the same fields (a pydantic model can hold a Record as a field).
"""

from __future__ import annotations

import dataclasses
from operator import itemgetter
from typing import Any, Callable, ClassVar, TypeVar, dataclass_transform

R = TypeVar("R", bound="Record")

def _adapter(cls: type) -> Any:
    """The class's pydantic TypeAdapter, made on first use and kept on the class (its own, not a base's)."""
    adapter = cls.__dict__.get("_type_adapter")
    if adapter is None:
        from pydantic import TypeAdapter  # pydantic only where a record is dumped or validated (see the module doc)

        adapter = TypeAdapter(cls)
        type.__setattr__(cls, "_type_adapter", adapter)
    return adapter


class _Fields:
    """`Record.model_fields`: field name -> dataclasses.Field (`.default` as pydantic's FieldInfo has it)."""

    def __get__(self, obj: object, owner: type) -> dict[str, dataclasses.Field]:
        out = {}
        for name, (default, factory) in owner._specs.items():  # type: ignore[attr-defined]
            f = out[name] = dataclasses.field(default=default, default_factory=factory)
            f.name = name
        return out


class _Lazy:
    """A Record subclass's `__dataclass_fields__` and `__dataclass_params__` until it is made a dataclass: the first
    read (dataclasses.fields, replace, is_dataclass, pydantic) makes it one, which replaces both in the class. Record
    itself is not a dataclass (AttributeError, as dataclasses expects of a class that is not)."""

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj: object, owner: type) -> Any:
        if owner is Record or self.attr not in owner.__dict__ or owner.__dict__[self.attr] is not self:
            raise AttributeError(self.attr)
        dataclasses.dataclass(init=False, repr=False, eq=False)(owner)
        return owner.__dict__[self.attr]


_LAZY_FIELDS = _Lazy("__dataclass_fields__")
_LAZY_PARAMS = _Lazy("__dataclass_params__")


def _is_classvar(ann: Any) -> bool:
    """dataclasses' test for a ClassVar pseudo-field, of an annotation as a string (`from __future__ import
    annotations`) or as the object."""
    if isinstance(ann, str):
        return ann.startswith(("ClassVar", "typing.ClassVar"))
    return ann is ClassVar or getattr(ann, "__origin__", None) is ClassVar


def _specs(cls: type) -> dict[str, tuple[Any, Any]]:
    """The fields as dataclasses._process_class collects them: name -> (default, default_factory), the bases' first
    (in reverse MRO order; a field declared again keeps its place), then the class's own annotations, their defaults
    from the class attributes (a `dataclasses.field(...)`'s default and default_factory)."""
    specs: dict[str, tuple[Any, Any]] = {}
    for b in cls.__mro__[-1:0:-1]:
        specs.update(b.__dict__.get("_specs", {}))
    for name, ann in cls.__dict__.get("__annotations__", {}).items():
        if _is_classvar(ann):
            continue
        if isinstance(ann, str) and ann.startswith(("InitVar", "dataclasses.InitVar", "KW_ONLY", "dataclasses.KW_ONLY")):
            raise TypeError(f"{cls.__qualname__}.{name}: a Record takes no InitVar or KW_ONLY")
        v = getattr(cls, name, dataclasses.MISSING)
        if isinstance(v, dataclasses.Field):
            if not (v.init and v.repr and v.compare) or v.hash is not None:
                raise TypeError(f"{cls.__qualname__}: Record's __init__, __repr__, __eq__ and __hash__ take every field")
            specs[name] = (v.default, v.default_factory)
        else:
            specs[name] = (v, dataclasses.MISSING)
    return specs


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(dataclasses.field,))
class Record:
    __slots__ = ()
    model_fields = _Fields()
    # per class, from its fields (__init_subclass__)
    _names: ClassVar[tuple[str, ...]]
    _defaults: ClassVar[dict[str, Any]]  # name -> default (fields with a default value)
    _factories: ClassVar[tuple[tuple[str, Callable[[], Any]], ...]]  # (name, default_factory)
    _required: ClassVar[frozenset[str]]
    _values: ClassVar[Callable[[dict[str, Any]], Any]]  # a __dict__ -> its fields' values, in field order
    _post_init: ClassVar[Callable[[Any], None] | None]
    _kw_only: ClassVar[bool]
    _specs: ClassVar[dict[str, tuple[Any, Any]]]  # name -> (default, default_factory), as dataclasses reads them

    def __init_subclass__(cls, *, frozen: bool = True, kw_only: bool = True, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._kw_only = kw_only
        cls._specs = specs = _specs(cls)
        cls.__dataclass_fields__ = _LAZY_FIELDS  # type: ignore[attr-defined]  # a dataclass when first asked (_Lazy)
        cls.__dataclass_params__ = _LAZY_PARAMS  # type: ignore[attr-defined]
        cls._names = tuple(specs)
        cls._defaults = {n: d for n, (d, _) in specs.items() if d is not dataclasses.MISSING}
        cls._factories = tuple((n, f) for n, (_, f) in specs.items() if f is not dataclasses.MISSING)
        cls._required = frozenset(cls._names) - cls._defaults.keys() - {n for n, _ in cls._factories}
        cls._values = itemgetter(*cls._names) if len(cls._names) > 1 else (lambda d: (d[cls._names[0]],))
        cls._post_init = getattr(cls, "__post_init__", None)
        if frozen:
            cls.__setattr__ = _frozen_setattr  # type: ignore[method-assign]
            cls.__delattr__ = _frozen_delattr  # type: ignore[method-assign]
            cls.__hash__ = Record._hash  # type: ignore[method-assign, assignment]
        else:
            cls.__hash__ = None  # type: ignore[method-assign, assignment]  # as a dataclass with eq and not frozen

    def __init__(self, *args: Any, **kw: Any) -> None:
        cls = type(self)
        if args:  # the fields in order (kw_only=False), then by name
            if cls._kw_only or len(args) > len(cls._names):
                raise TypeError(f"{cls.__qualname__}: takes " + ("keyword arguments only" if cls._kw_only else
                                                                 f"at most {len(cls._names)} positional arguments"))
            given = dict(zip(cls._names, args))
            twice = given.keys() & kw.keys()
            if twice:
                raise TypeError(f"{cls.__qualname__}: {', '.join(sorted(twice))} given twice")
            kw = given | kw
        d = cls._defaults.copy()
        d.update(kw)
        for name, factory in cls._factories:
            if name not in kw:
                d[name] = factory()
        if len(d) != len(cls._names) or not cls._required <= kw.keys():
            unknown = kw.keys() - set(cls._names)
            missing = cls._required - kw.keys()
            raise TypeError(f"{cls.__qualname__}: " + (f"no field {', '.join(sorted(unknown))}" if unknown else
                                                       f"missing {', '.join(sorted(missing))}"))
        object.__setattr__(self, "__dict__", d)
        if cls._post_init is not None:
            cls._post_init(self)

    def __repr__(self) -> str:
        d = self.__dict__
        return f"{type(self).__qualname__}({', '.join(f'{n}={d[n]!r}' for n in self._names)})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        values = type(self)._values  # the fields' values in order, as a dataclass compares them
        return values(self.__dict__) == values(other.__dict__)

    def _hash(self) -> int:
        return hash(type(self)._values(self.__dict__))

    def model_copy(self: R, *, update: dict[str, Any] | None = None) -> R:
        """A copy with `update`'s fields set as given (pydantic's model_copy: not validated)."""
        new = object.__new__(type(self))
        d = self.__dict__.copy()
        if update:
            unknown = update.keys() - d.keys()
            if unknown:
                raise TypeError(f"{type(self).__name__} has no field {', '.join(sorted(unknown))}")
            d.update(update)
        object.__setattr__(new, "__dict__", d)
        return new

    def model_dump(self, **kw: Any) -> Any:
        return _adapter(type(self)).dump_python(self, **kw)

    def model_dump_json(self, *, indent: int | None = None, **kw: Any) -> str:
        return _adapter(type(self)).dump_json(self, indent=indent, **kw).decode()

    @classmethod
    def model_validate(cls: type[R], obj: Any) -> R:
        return _adapter(cls).validate_python(obj)
