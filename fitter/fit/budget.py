"""The memory budget (`--budget`) and the margin kept free under it (`--margin`).

Sizes (`25559MiB`, `26.8GB`; a bare number other than 0 is refused): fitter.fit.sizes.

`auto` asks the device (fitter.fit.device_memory.auto_budget, imported only then: its probes' ctypes costs
every other command 7M instructions).

The margin defaults to 1024 MiB per device, like llama.cpp's `--fit-target` / `-fitt`
(`common_params::fit_params_target`, common/common.h: "margin per device in bytes for fitting
parameters to free memory", default 1024*1024*1024).
"""

from __future__ import annotations

from fitter.fit.margin import default_margin
from fitter.fit.sizes import ACCEPTED, Budget, BudgetError, MiB, parse_size
from fitter.ggml import backends

__all__ = ["ACCEPTED", "DEFAULT_MARGIN_BYTES", "MiB", "Budget", "BudgetError", "available_bytes", "check_devices",
           "parse_budget", "parse_budgets", "parse_host_budget", "parse_margin", "parse_size"]

# common/common.h common_params::fit_params_target: 1024 MiB per device
DEFAULT_MARGIN_BYTES = 1024 * MiB
FIT_TARGET_NAME = "--fit-target"


# --- parsing ---------------------------------------------------------------------------------------


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
    if not backends.get(backend).is_gpu or backends.get(backend).single_device:
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
    impl = backends.get(backend)
    ts = ts_text or ",".join(f"{x:g}" for x in tensor_split or ())
    named = (f"{impl.label} has one device ({impl.name})" if impl.single_device
             else f"--budget names {n} GPU{'s' if n != 1 else ''}" + (" (one value per GPU: --budget 24GiB,24GiB)" if n == 1 else ""))
    if tensor_split is not None and len(tensor_split) >= LLAMA_MAX_DEVICES:
        raise BudgetError(f"-ts {ts}: got {len(tensor_split)} input configs, but system only has "
                          f"{LLAMA_MAX_DEVICES} devices")
    if not impl.is_gpu:
        return
    if split_mode == "none" and main_gpu >= n:
        raise BudgetError(f"-mg {main_gpu}: invalid value for main_gpu: {main_gpu} (available devices: {n}); {named}")
    if main_gpu >= n:
        raise BudgetError(f"-mg {main_gpu}: GPU {main_gpu} has no budget; {named}")
    if tensor_split is not None and len(tensor_split) > n:
        raise BudgetError(f"-ts {ts}: {len(tensor_split)} proportions, one for a GPU without a budget; {named}")


def budget_split(budgets: list[Budget]) -> tuple[float, ...] | None:
    """-ts for several budgets and no -ts given: the budgets' proportions in GiB (llama_model::load_tensors splits by
    each device's free memory; the budget stands for it). One budget: None (no split)."""
    return tuple(round(b.bytes / 2**30, 3) for b in budgets) if len(budgets) > 1 else None


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
