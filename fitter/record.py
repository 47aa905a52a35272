"""Records: fitter's data types are frozen dataclasses with the few pydantic model methods ggfit uses.

ModelSpec, RunConfig, Prediction and the rest are built by ggfit's own code from values it has already read and
checked (the GGUF reader, the CLI's typed flags, RunConfig's own checks), so nothing validates them again at
construction. pydantic is imported, and a record's schema built, only where a record crosses into or out of the
program: `--json`, the calibration store, a study file, a stored probe result. Importing fitter's solver costs
545M instructions this way, 905M with pydantic models (its import and 21 schemas). The CLI pays pydantic's
import anyway (typer >= 0.28 coerces every parameter through a pydantic TypeAdapter); it still saves the
schemas, about 50M of `ggfit fit -c` (issue 14).

A `Record` subclass is a `@dataclass(frozen=True, kw_only=True)` (Prediction: not frozen). The methods keep
pydantic's names and behaviour, so search, the CLI and scripts that called them on pydantic models are unchanged:
`model_copy(update=...)` sets fields without checking them, as pydantic's does; `model_dump`,
`model_dump_json` and `model_validate` go through a `pydantic.TypeAdapter` of the dataclass, which dumps and
validates a dataclass as it does a model with the same fields (a pydantic model can hold a Record as a field).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

R = TypeVar("R", bound="Record")


_ADAPTERS: dict[type, Any] = {}


def _adapter(cls: type) -> Any:
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        from pydantic import TypeAdapter  # pydantic only where a record is dumped or validated (see the module doc)

        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


class _Fields:
    """`Record.model_fields`: field name -> dataclasses.Field (`.default` as pydantic's FieldInfo has it)."""

    def __get__(self, obj: object, owner: type) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(owner)}


class Record:
    __slots__ = ()
    model_fields = _Fields()

    def model_copy(self: R, *, update: dict[str, Any] | None = None) -> R:
        """A copy with `update`'s fields set as given (pydantic's model_copy: not validated)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        if update:
            unknown = update.keys() - self.__dict__.keys()
            if unknown:
                raise TypeError(f"{type(self).__name__} has no field {', '.join(sorted(unknown))}")
            new.__dict__.update(update)
        return new

    def model_dump(self, **kw: Any) -> Any:
        return _adapter(type(self)).dump_python(self, **kw)

    def model_dump_json(self, *, indent: int | None = None, **kw: Any) -> str:
        return _adapter(type(self)).dump_json(self, indent=indent, **kw).decode()

    @classmethod
    def model_validate(cls: type[R], obj: Any) -> R:
        return _adapter(cls).validate_python(obj)
