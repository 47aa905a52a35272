"""ggfit's flags into fitter's values (a RunConfig, a build) and request records (fitter.fit.request, issue 45): `fit`
and `quants` parse their option groups (cli_options) into a FitRequest here, and nothing else; fitter.fit.plan
decides. (fitter's modules are imported when a request is made, not when ggfit starts: the types are for checkers.)"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from fitter.fit.request import FitRequest, QuantsRequest, Speed
    from fitter.ggml.backends.base import Backend
    from fitter.llama_builds import LlamaBuild

from cli_options import (
    AdapterOptions,
    BackendName,
    BudgetOptions,
    BuildOptions,
    ContextOptions,
    DraftOptions,
    FrontendName,
    PlacementOptions,
    ServerOptions,
    SessionOptions,
    SpeedOptions,
    backend_of,
    backend_of_hardware,
    frontend_of,
)
from cli_rpc import rpc_backend, rpc_backends, rpc_budgets
from cli_session import session_ask


def run_config(**fields):
    """A RunConfig from CLI flags; a value llama.cpp would refuse is one line (a ConfigError), not a traceback."""
    from fitter.llama.cparams import RunConfig

    return RunConfig(**fields)


def llama_build_of(value: str | None, llama_server: str | None = None):
    """--llama-build: the pinned build, a named build, a log's build line, or (auto) what a binary says it is."""
    from fitter.llama.flags import ConfigError
    from fitter.llama_builds import PINNED, resolve_build

    if value is None:
        if llama_server:
            raise ConfigError("--llama-server PATH here only tells --llama-build auto which binary to ask; "
                              "add --llama-build auto")
        return PINNED
    if value == "auto":
        from fitter.llama_builds.identify import build_of_binary

        binary = llama_server or shutil.which("llama-server")
        if binary is None:
            raise ConfigError("--llama-build auto: no llama-server on PATH; give --llama-server PATH, "
                              "or the build itself (llama-server --version prints it: --llama-build b9430)")
        return build_of_binary(binary)
    if os.path.isfile(value):  # a log of the user's llama.cpp
        from fitter.llama_builds.identify import build_from_text

        with open(value, "rb") as f:
            text = f.read(64 * 2**20).decode("utf-8", "replace")
        return build_from_text(text, os.path.basename(value))
    return resolve_build(value)


def lora_fields(lora: list[str] | None, lora_scaled: list[str] | None) -> tuple[tuple[str, float], ...]:
    """RunConfig.lora from --lora FILE (scale 1) and --lora-scaled FILE:SCALE, as common/arg.cpp reads them."""
    from fitter.llama.cparams import lora_scaled as parse_scaled

    out = [(p, 1.0) for v in lora or () for p in v.split(",") if p]
    for v in lora_scaled or ():
        out += parse_scaled(v)
    return tuple(out)


def placement_fields(n_cpu_moe: int, cpu_moe: bool, override_tensor: list[str] | None, no_kv_offload: bool,
                      no_op_offload: bool, split_mode: str, main_gpu: int, tensor_split: str | None,
                      budgets: list, backend: str = "cuda") -> dict[str, Any]:
    """RunConfig's placement fields from the CLI flags; several --budget values and no -ts split the layers by the
    budgets (llama.cpp splits by free memory). A GPU the flags name without a budget is an error."""
    from fitter.fit.budget import budget_split, check_devices
    from fitter.llama.flags import ConfigError

    ts: tuple[float, ...] | None = None
    if tensor_split is not None:
        try:
            ts = tuple(float(x) for x in tensor_split.replace("/", ",").split(",") if x)
        except ValueError:
            raise ConfigError(f"-ts {tensor_split}: use proportions, e.g. 3,1") from None
        check_devices(budgets, backend, split_mode=split_mode, main_gpu=main_gpu, tensor_split=ts, ts_text=tensor_split)
    else:
        check_devices(budgets, backend, split_mode=split_mode, main_gpu=main_gpu, tensor_split=None)
        ts = budget_split(budgets)
    return dict(n_cpu_moe=n_cpu_moe, cpu_moe=cpu_moe, override_tensor=tuple(override_tensor or ()),
                no_kv_offload=no_kv_offload, no_op_offload=no_op_offload, split_mode=split_mode, main_gpu=main_gpu,
                tensor_split=ts)


def speed_of(s: SpeedOptions, build: LlamaBuild, rpc: str | None = None) -> Speed:
    """The speed settings (fitter.fit.request.Speed): --hardware, --host-bandwidth, -t, --speed-prompt,
    --speed-depth, --no-speed, and with --rpc the network's --rpc-bandwidth and --rpc-latency."""
    from fitter.fit.request import Speed
    from fitter.llama.flags import ConfigError

    if rpc is None and (s.rpc_bandwidth is not None or s.rpc_latency is not None):
        given = "--rpc-bandwidth" if s.rpc_bandwidth is not None else "--rpc-latency"
        raise ConfigError(f"{given}: the network to the rpc-servers goes with --rpc HOST:PORT,...")

    return Speed(s.hardware, s.host_bandwidth, s.threads, s.speed_prompt, s.speed_depth, off=s.no_speed, build=build,
                 rpc_bandwidth=s.rpc_bandwidth, rpc_latency=s.rpc_latency)


def backend_for(given: BackendName | None, speed: Speed) -> Backend:
    """--backend, else the --hardware profile's (--hardware sets the backend), else this machine's."""
    return backend_of(given) if speed.profile is None else backend_of_hardware(given, speed.profile)


def context_fields(c: ContextOptions) -> dict[str, Any]:
    """RunConfig's context fields from the context flags (K/V f16 unless given)."""
    return dict(n_ctx=c.n_ctx, n_batch=c.n_batch, n_ubatch=c.n_ubatch, type_k=c.type_k or "f16",
                type_v=c.type_v or "f16", flash_attn=c.flash_attn.value, n_parallel=c.n_parallel)


def adapter_fields(a: AdapterOptions) -> dict[str, Any]:
    return dict(lora=lora_fields(a.lora, a.lora_scaled), mmproj=a.mmproj, no_mmproj_offload=a.no_mmproj_offload)


def fit_request(model: str, b: BudgetOptions, frontend: FrontendName, c: ContextOptions, p: PlacementOptions,
                a: AdapterOptions, s: ServerOptions, d: DraftOptions, bo: BuildOptions, sp: SpeedOptions, *,
                check: bool, llama_bin: Optional[str], session: SessionOptions | None = None) -> FitRequest:
    """`ggfit fit`'s flags as a FitRequest; a value llama.cpp would refuse is one line (ConfigError, BudgetError)."""
    from fitter.fit.request import Budgets, FitRequest
    from fitter.llama.flags import ConfigError

    fit_params = None
    if llama_bin:
        from fitter.oracle.fit_params import fit_params_binary

        fit_params = fit_params_binary(llama_bin)
    if fit_params is not None and bo.llama_build is None:
        from fitter.llama_builds.identify import build_of_binary

        build = build_of_binary(fit_params)
    else:
        build = llama_build_of(bo.llama_build, bo.llama_server)
    speed = speed_of(sp, build, s.rpc)
    be, fe = rpc_backend(s.rpc, backend_for(b.backend, speed)), frontend_of(frontend)
    if d.spec_type not in (None, "draft-simple", "draft-mtp"):
        raise ConfigError(f"--spec-type {d.spec_type}: ggfit models draft-simple and draft-mtp")
    kinds = rpc_backends(s.rpc, b.budget, s.rpc_backend) if s.rpc else ()
    budgets = Budgets.parse(b.budget, b.margin, be, host_budget=s.host_budget, split_mode=s.split_mode,
                            main_gpu=s.main_gpu, devices=rpc_budgets(s.rpc, b.budget, be) if s.rpc else None,
                            remote=kinds)
    cfg = run_config(
        **context_fields(c), kv_unified=s.kv_unified, swa_full=s.swa_full, n_gpu_layers=p.n_gpu_layers,
        no_mmap=s.no_mmap, no_repack=not s.repack,
        spec_type=d.spec_type or ("draft-simple" if d.model_draft else "none"), draft_model=d.model_draft,
        draft_type_k=d.draft_type_k, draft_type_v=d.draft_type_v, draft_n_max=d.draft_n_max,
        **placement_fields(p.n_cpu_moe, p.cpu_moe, p.override_tensor, p.no_kv_offload, s.no_op_offload, s.split_mode,
                           s.main_gpu, s.tensor_split, list(budgets.devices), be.value),
        **adapter_fields(a), rpc=s.rpc, rpc_backends=kinds,
    )
    return FitRequest(model=model, config=cfg, backend=be, frontend=fe, build=build, budgets=budgets, speed=speed,
                      model_draft=d.model_draft, solve_ctx=c.n_ctx is None, asked_batch=c.n_batch,
                      asked_ubatch=c.n_ubatch, kv_given=bool(c.type_k or c.type_v), check=check,
                      fit_params=fit_params, session=session_ask(session) if session else None)


def quants_request(model: str, b: BudgetOptions, frontend: FrontendName, c: ContextOptions, p: PlacementOptions,
                   a: AdapterOptions, model_draft: Optional[str], bo: BuildOptions, sp: SpeedOptions, *,
                   candidates: Optional[list[str]], no_imatrix: bool, rpc: Optional[str] = None,
                   rpc_kinds: Optional[str] = None) -> QuantsRequest:
    """`ggfit quants`' flags as a QuantsRequest: one device budget (with --rpc one per device), the flags every
    quant is predicted at."""
    from fitter.fit.request import Budgets, FitRequest, QuantsRequest

    build = llama_build_of(bo.llama_build, bo.llama_server)
    speed = speed_of(sp, build)
    be, fe = rpc_backend(rpc, backend_for(b.backend, speed)), frontend_of(frontend)
    devices = rpc_budgets(rpc, b.budget, be) if rpc else None
    ts = tuple(round(d.bytes / 2**30, 3) for d in devices) if devices else None  # llama.cpp: by free memory
    cfg = run_config(**context_fields(c), draft_model=model_draft,
                     spec_type="draft-simple" if model_draft else "none", n_gpu_layers=p.n_gpu_layers,
                     n_cpu_moe=p.n_cpu_moe, cpu_moe=p.cpu_moe, override_tensor=tuple(p.override_tensor or ()),
                     no_kv_offload=p.no_kv_offload, **adapter_fields(a), rpc=rpc, tensor_split=ts,
                     rpc_backends=rpc_backends(rpc, b.budget, rpc_kinds) if rpc else ())
    budgets = Budgets.parse(b.budget, b.margin, be, several=False, devices=devices, remote=cfg.rpc_backends)
    fit = FitRequest(model=model, config=cfg, backend=be, frontend=fe, build=build, budgets=budgets, speed=speed,
                     model_draft=model_draft)
    return QuantsRequest(fit=fit, candidates=tuple(candidates or ()), include_imatrix=not no_imatrix)
