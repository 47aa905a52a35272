"""The memory budget (`--budget`) and the margin kept free under it (`--margin`).

Sizes: a number with a unit (`25559MiB`, `26800000000B`); a bare number other than 0 is refused, since
`--budget 25559` is more likely MiB than bytes.

* Binary units: KiB, MiB, GiB, TiB (powers of 1024). Decimal units: KB, MB, GB, TB (powers of 1000),
  so `26800MB` is 26,800,000,000 bytes and `25559MiB` is 26,800,553,984. `B` is bytes.
* Units are case-insensitive (`mib`, `GB`); a space between number and unit is allowed.
* A unit may take a decimal fraction (`26.8GB`, `1.5GiB`); the result is rounded down to whole
  bytes. Bytes (`B`) must be a whole number. Single-letter units (`24G`) are refused as ambiguous.

`auto` asks the device (fitter.fit.device_memory.auto_budget, imported only then: its probes' ctypes costs
every other command 7M instructions).

The margin defaults to 1024 MiB per device, like llama.cpp's `--fit-target` / `-fitt`
(`common_params::fit_params_target`, common/common.h: "margin per device in bytes for fitting
parameters to free memory", default 1024*1024*1024).
"""

from __future__ import annotations

import re

from fitter.errors import GGFitError
from fitter.fit.margin import default_margin
from fitter.record import Record

MiB = 1024**2
GiB = 1024**3

# common/common.h common_params::fit_params_target: 1024 MiB per device
DEFAULT_MARGIN_BYTES = 1024 * MiB
FIT_TARGET_NAME = "--fit-target"

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


# --- parsing ---------------------------------------------------------------------------------------


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


def parse_margin(text: str | None, backend: str | None = None) -> int:
    """--margin: a size (zero allowed); None gives the backend's default (fitter.fit.margin: what the buffers leave
    out, plus a safety share), or without a backend DEFAULT_MARGIN_BYTES (llama.cpp's --fit-target default)."""
    if text is None:
        return default_margin(backend) if backend else DEFAULT_MARGIN_BYTES
    if str(text).strip().lower() == "auto":
        raise BudgetError(f"--margin 'auto': the margin is a size; use {ACCEPTED} (by default the backend's modelled "
                          f"overhead plus a safety share; llama.cpp's {FIT_TARGET_NAME} is 1024MiB)")
    return parse_size(text, what="--margin")


def parse_budget(text: str, backend: str = "cpu", **probes) -> Budget:
    """--budget: a positive size, or `auto` for the device's own limit (see auto_budget)."""
    raw = str(text)
    if raw.strip().lower() == "auto":
        from fitter.fit.device_memory import auto_budget

        return auto_budget(backend, **probes)
    value = parse_size(raw, what="--budget")
    if value == 0:
        raise BudgetError(f"--budget {raw!r}: must be more than zero; use {ACCEPTED} or auto")
    return Budget(bytes=value, source=f"--budget {raw.strip()}")


def parse_budgets(text: str, backend: str = "cpu", **probes) -> list[Budget]:
    """--budget for one GPU or several: one value, or one per GPU separated by commas (`24GiB,24GiB`); the number of
    values is the number of GPUs llama.cpp spreads the layers over (CUDA0, CUDA1, ... in order)."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) == 1:
        return [parse_budget(text, backend, **probes)]
    if backend == "metal" or backend == "cpu":
        raise BudgetError(f"--budget {text}: one value per GPU is for CUDA; {backend} has one device")
    if any(p.lower() == "auto" for p in parts):
        raise BudgetError(f"--budget {text}: auto reads one GPU; give a size per GPU ({ACCEPTED})")
    out = []
    for i, p in enumerate(parts):
        b = parse_budget(p, backend)
        out.append(b.model_copy(update={"source": f"--budget {p} (GPU {i})"}))
    return out


LLAMA_MAX_DEVICES = 16  # llama.cpp's llama_max_devices()


def check_devices(budgets: list[Budget], backend: str, *, split_mode: str, main_gpu: int,
                  tensor_split: tuple[float, ...] | None, ts_text: str | None = None) -> None:
    """Every GPU the flags use has a --budget value: -ts proportions and -mg name GPUs by index, and ggfit knows
    as many GPUs as --budget has values. What llama.cpp itself refuses, in its words: -ts with llama_max_devices()
    values or more (common/arg.cpp), and -sm none with -mg past the devices (llama.cpp llama_model_load: "invalid
    value for main_gpu"). (llama.cpp ignores proportions past its devices, and -mg without -sm none; ggfit refuses
    them too: a GPU that is not there, or not budgeted, is a mistake in the command.) The CPU backend has no GPUs
    (llama.cpp ignores -ts and -mg there)."""
    n = len(budgets)
    ts = ts_text or ",".join(f"{x:g}" for x in tensor_split or ())
    named = ("Metal has one device (MTL0)" if backend == "metal" else f"--budget names {n} GPU{'s' if n != 1 else ''}"
             + (" (one value per GPU: --budget 24GiB,24GiB)" if n == 1 else ""))
    if tensor_split is not None and len(tensor_split) >= LLAMA_MAX_DEVICES:
        raise BudgetError(f"-ts {ts}: got {len(tensor_split)} input configs, but system only has "
                          f"{LLAMA_MAX_DEVICES} devices")
    if backend == "cpu":
        return
    if split_mode == "none" and main_gpu >= n:
        raise BudgetError(f"-mg {main_gpu}: invalid value for main_gpu: {main_gpu} (available devices: {n}); {named}")
    if main_gpu >= n:
        raise BudgetError(f"-mg {main_gpu}: GPU {main_gpu} has no budget; {named}")
    if tensor_split is not None and len(tensor_split) > n:
        raise BudgetError(f"-ts {ts}: {len(tensor_split)} proportions, one for a GPU without a budget; {named}")


def parse_host_budget(text: str | None, **probes) -> Budget:
    """--host-budget: what may land in system RAM (weights left on the CPU, mapped or not, KV on the host, host
    compute and output buffers). Default (None or auto): the RAM available now (MemAvailable)."""
    if text is None or str(text).strip().lower() == "auto":
        from fitter.fit.device_memory import auto_budget

        b = auto_budget("cpu", **probes)
        return b.model_copy(update={"source": f"available RAM ({b.source})"})
    value = parse_size(text, what="--host-budget")
    if value == 0:
        raise BudgetError(f"--host-budget {text!r}: must be more than zero; use {ACCEPTED} or auto")
    return Budget(bytes=value, source=f"--host-budget {str(text).strip()}")


def available_bytes(budget: Budget | int, margin: int) -> int:
    """What the prediction may use: the budget minus the margin (which must leave something)."""
    total = budget.bytes if isinstance(budget, Budget) else int(budget)
    if margin >= total:
        raise BudgetError(f"--margin {margin / MiB:,.0f} MiB leaves nothing of the {total / MiB:,.0f} MiB budget")
    return total - margin
