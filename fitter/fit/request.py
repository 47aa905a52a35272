"""What a command asks of the fitter (issue 45): the model, llama.cpp's flags (a RunConfig), the engine's build, the
budgets and the speed settings, in one record. `ggfit fit` parses its flags into a FitRequest and hands it to
fitter.fit.plan.plan; `ggfit quants` hands the same record to fitter.fit.plan.plan_quants (fitter/README.md has the
flow).

The budget arithmetic every command shares (--budget per GPU, less --margin; --host-budget less the host margin) is
`Budgets`' alone."""

from __future__ import annotations

from dataclasses import field
from typing import TYPE_CHECKING

from fitter.fit import budget as budget_
from fitter.fit.margin import default_host_margin
from fitter.ggml import backends
from fitter.record import Record

if TYPE_CHECKING:
    from pathlib import Path

    from fitter.build import LlamaBuild
    from fitter.fit.sizes import Budget
    from fitter.ggml.backends.base import Backend
    from fitter.llama.cparams import Frontend, RunConfig
    from fitter.speed.settings import Speed


class Budgets(Record):
    """--budget (one value per GPU), --margin and --host-budget, parsed once.

    `main` is the budget of the device view (-sm none: -mg's GPU, else the first), `available` it less the margin;
    `per_device` holds each GPU's budget by llama.cpp's device name where there are several (None: one budget)."""

    devices: tuple[Budget, ...]
    main: Budget
    margin_bytes: int
    margin_default: bool  # --margin not given: the backend's own
    available: int
    per_device: dict[str, int] | None = None
    host: Budget | None = None  # system RAM beside a GPU (None: the CPU backend, or unified memory without one given)
    host_margin: int = 0

    @classmethod
    def parse(cls, budget: str, margin: str | None, backend: Backend, *, host_budget: str | None = None,
              split_mode: str = "layer", main_gpu: int = 0, several: bool = True) -> Budgets:
        """The budgets of `fit` (several: one per GPU, and a host budget) or of `quants` (several=False: one device
        budget). A margin that leaves nothing is the user's error (BudgetError)."""
        impl = backends.get(backend)
        devices = (budget_.parse_budgets(budget, backend.value) if several
                   else [budget_.parse_budget(budget, backend.value)])
        main = devices[main_gpu] if split_mode == "none" and main_gpu < len(devices) else devices[0]
        margin_bytes = budget_.parse_margin(margin, backend.value)
        available = budget_.available_bytes(main, margin_bytes)
        # one budget per GPU: each device within its own (the layers split by the budgets unless -ts says otherwise)
        per_device = ({impl.device_name(i): b.bytes for i, b in enumerate(devices)}
                      if len(devices) > 1 and split_mode != "none" else None)
        for b in devices[1:]:
            budget_.available_bytes(b, margin_bytes)
        # system RAM next to the GPU (default: what is available now); on the CPU everything is the one budget, and a
        # Mac's unified memory is the device budget already (a host budget there only when given)
        host = None
        if several and impl.is_gpu and (host_budget or not impl.unified_memory):
            host = budget_.parse_host_budget(host_budget)
        return cls(devices=tuple(devices), main=main, margin_bytes=margin_bytes, margin_default=margin is None,
                   available=available, per_device=per_device, host=host,
                   host_margin=default_host_margin(backend.value))

    @property
    def avail(self) -> int | dict[str, int]:
        """What the prediction may use: the available bytes, or per GPU (each budget less the margin)."""
        if self.per_device:
            return {name: b - self.margin_bytes for name, b in self.per_device.items()}
        return self.available

    @property
    def host_avail(self) -> int | None:
        """What the predicted host bytes may use: the host budget less the host margin (None: no host budget)."""
        return None if self.host is None else self.host.bytes - self.host_margin


class FitRequest(Record):
    """One request: a model and llama.cpp's flags for it (`config`, as llama.cpp reads them), on a backend, under
    budgets, with a build's rules and the speed settings. `solve_ctx`: -c not given, solve for the largest context."""

    model: str  # as given: a path, a URL or a bundled name (resolved by plan)
    config: RunConfig
    backend: Backend
    frontend: Frontend
    build: LlamaBuild
    budgets: Budgets
    speed: Speed | None = None  # None: no rates asked for at all
    model_draft: str | None = None
    solve_ctx: bool = False
    asked_batch: int | None = None  # -b as given (None: not given)
    asked_ubatch: int | None = None  # -ub as given
    kv_given: bool = False  # -ctk or -ctv given: the table keeps that pair
    check: bool = False  # --check: llama.cpp's own dry run (or llama-fit-params) beside the prediction
    fit_params: Path | None = None  # --llama-bin's llama-fit-params, for --check
    # issue 47: llama.cpp's --rpc HOST:PORT,... servers, each a device of its own; plan() will give each one its
    # buffers and budget (Plan.rpc_devices). Empty until the RPC devices are modelled.
    rpc: tuple[str, ...] = ()
    # issue 48: llama-server's session memory (--cache-ram, slot checkpoints), host bytes beside the buffers; plan()
    # will add them to the host side (Plan.session_bytes). Empty until modelled.
    session: dict[str, int] = field(default_factory=dict)

    @property
    def n_gpus(self) -> int:
        return len(self.budgets.devices)


class QuantsRequest(Record):
    """`ggfit quants`: a FitRequest's model, flags, budgets and speed, every quant of the model evaluated with them
    (fitter.fit.plan.plan_quants: one answer per ftype)."""

    fit: FitRequest
    candidates: tuple[str, ...] = ()  # --candidate NAME=PATH_OR_URL or NAME=SIZE
    include_imatrix: bool = True
