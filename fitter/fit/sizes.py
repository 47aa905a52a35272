"""Sizes in bytes as ggfit's flags take them, and the Budget record (bytes and where they came from).

Sizes: a number with a unit (`25559MiB`, `26800000000B`); a bare number other than 0 is refused, since
`--budget 25559` is more likely MiB than bytes.

* Binary units: KiB, MiB, GiB, TiB (powers of 1024). Decimal units: KB, MB, GB, TB (powers of 1000),
  so `26800MB` is 26,800,000,000 bytes and `25559MiB` is 26,800,553,984. `B` is bytes.
* Units are case-insensitive (`mib`, `GB`); a space between number and unit is allowed.
* A unit may take a decimal fraction (`26.8GB`, `1.5GiB`); the result is rounded down to whole
  bytes. Bytes (`B`) must be a whole number. Single-letter units (`24G`) are refused as ambiguous.

fitter.fit.budget reads the flags (--budget, --margin, --host-budget) with these; fitter.fit.device_memory makes the
Budget of `auto` from what a device reports.
"""

from __future__ import annotations

import re

from fitter.errors import GGFitError
from fitter.record import Record

MiB = 1024**2
GiB = 1024**3

UNITS: dict[str, int] = {
    "b": 1,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
ACCEPTED = "a number with a unit (25559MiB, 24GiB, 26800MB, 26.8GB; units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
# the unit in ASCII letters, either case (IGNORECASE would also take the Kelvin sign for a k, and cost its case
# tables: ~0.4 ms a command)
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)(?:[eE]([+-]?\d{1,9}))?\s*([a-zA-Z]*)$")  # 25559MiB, 26.8GB, 1e3MiB
_MAX_BYTES = 2**63
_MAX_FRACTION = 100  # digits after the point


class BudgetError(GGFitError):
    """A --budget or --margin value ggfit cannot read, or an `auto` it cannot resolve here."""


class Budget(Record):
    """Bytes the prediction must fit into, and where the number came from."""

    bytes: int
    source: str  # e.g. "--budget 24GiB", "Metal recommendedMaxWorkingSetSize", "nvidia-smi memory.free (GPU 0)"
    note: str | None = None  # a caveat worth printing next to the number

    @property
    def mib(self) -> float:
        return self.bytes / MiB


def parse_size(text: str, *, what: str = "--margin") -> int:
    """Bytes from `25559MiB`, `24GiB`, `26800MB`, `26.8GB`, `100B`; zero (`0`, `0MiB`) is allowed."""
    raw = str(text)
    s = raw.strip()
    if s.startswith("-"):
        raise BudgetError(f"{what} {raw!r}: must not be negative; use {ACCEPTED}")
    m = _SIZE.match(s)
    if not m:
        raise BudgetError(f"{what} {raw!r}: not a size; use {ACCEPTED}")
    number, unit = m.group(1), m.group(3).lower()
    if unit and unit not in UNITS:
        raise BudgetError(f"{what} {raw!r}: unknown unit '{m.group(3)}'; use {ACCEPTED}")
    whole, _, frac = number.partition(".")
    whole = whole.lstrip("0")
    if not unit and (whole or frac.strip("0")):  # zero is zero in every unit
        also = " or auto" if what == "--budget" else ""
        shown = s[: len(s) - len(m.group(3))].strip()
        raise BudgetError(f"{what} {s}: a size needs a unit (did you mean {shown}MiB?); use {ACCEPTED}{also}")
    if len(frac) > _MAX_FRACTION:
        raise BudgetError(f"{what} {raw!r}: more than {_MAX_FRACTION} digits after the point; use {ACCEPTED}")
    if len(whole) > 20:  # 10**20 bytes and more: past _MAX_BYTES in every unit, however long the number
        raise BudgetError(f"{what} {raw!r}: too large (at most {(_MAX_BYTES - 1) / 2**40:,.0f} TiB)")
    digits = int(whole + frac or "0")
    shift = int(m.group(2) or 0) - len(frac)  # the value is digits x 10**shift units
    if digits and len(str(digits)) + shift > 40:  # past _MAX_BYTES in every unit
        raise BudgetError(f"{what} {raw!r}: too large (at most {(_MAX_BYTES - 1) / 2**40:,.0f} TiB)")
    scale = 10 ** abs(max(shift, -_MAX_FRACTION - 40))
    if unit == "b" and shift < 0 and digits % scale:
        raise BudgetError(f"{what} {raw!r}: bytes must be a whole number; use {ACCEPTED}")
    # whole bytes, rounded down, in integers: exact for every fraction
    value = digits * UNITS[unit or "b"] * scale if shift >= 0 else digits * UNITS[unit or "b"] // scale
    if value >= _MAX_BYTES:
        raise BudgetError(f"{what} {raw!r}: too large (at most {(_MAX_BYTES - 1) / 2**40:,.0f} TiB)")
    return value
