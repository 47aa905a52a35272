"""ggfit's flags into fitter's request records (fitter.fit.request, issue 45): `fit` and `quants` parse their option
groups (cli_options) into a FitRequest here, and nothing else; fitter.fit.plan decides.

No `from __future__ import annotations`: cli.py's typer reads nothing here, but the groups' types are objects."""

from typing import Any, Optional

import fitter
from cli_options import (
    AdapterOptions,
    BudgetOptions,
    BuildOptions,
    ContextOptions,
    DraftOptions,
    FrontendName,
    PlacementOptions,
    ServerOptions,
    SpeedOptions,
    backend_of,
    backend_of_hardware,
    frontend_of,
    llama_build_of,
    lora_fields,
    placement_fields,
    run_config,
)


def speed_of(s: SpeedOptions, build: Any) -> Any:
    """The speed settings (fitter.speed.settings.Speed): --hardware, --host-bandwidth, -t, --speed-prompt,
    --speed-depth, --no-speed."""
    from fitter.speed.settings import Speed

    return Speed(s.hardware, s.host_bandwidth, s.threads, s.speed_prompt, s.speed_depth, off=s.no_speed, build=build)


def backend_for(given: Any, speed: Any) -> Any:
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
                check: bool, llama_bin: Optional[str]) -> Any:
    """`ggfit fit`'s flags as a FitRequest; a value llama.cpp would refuse is one line (ConfigError, BudgetError)."""
    from fitter.fit.request import Budgets, FitRequest

    fit_params = fitter.fit_params_binary(llama_bin) if llama_bin else None
    if fit_params is not None and bo.llama_build is None:
        build = fitter.build_of_binary(fit_params)
    else:
        build = llama_build_of(bo.llama_build, bo.llama_server)
    speed = speed_of(sp, build)
    be, fe = backend_for(b.backend, speed), frontend_of(frontend)
    if d.spec_type not in (None, "draft-simple", "draft-mtp"):
        raise fitter.ConfigError(f"--spec-type {d.spec_type}: ggfit models draft-simple and draft-mtp")
    budgets = Budgets.parse(b.budget, b.margin, be, host_budget=s.host_budget, split_mode=s.split_mode,
                            main_gpu=s.main_gpu)
    cfg = run_config(
        **context_fields(c), kv_unified=s.kv_unified, swa_full=s.swa_full, n_gpu_layers=p.n_gpu_layers,
        no_mmap=s.no_mmap, no_repack=not s.repack,
        spec_type=d.spec_type or ("draft-simple" if d.model_draft else "none"), draft_model=d.model_draft,
        draft_type_k=d.draft_type_k, draft_type_v=d.draft_type_v, draft_n_max=d.draft_n_max,
        **placement_fields(p.n_cpu_moe, p.cpu_moe, p.override_tensor, p.no_kv_offload, s.no_op_offload, s.split_mode,
                           s.main_gpu, s.tensor_split, list(budgets.devices), be.value),
        **adapter_fields(a),
    )
    return FitRequest(model=model, config=cfg, backend=be, frontend=fe, build=build, budgets=budgets, speed=speed,
                      model_draft=d.model_draft, solve_ctx=c.n_ctx is None, asked_batch=c.n_batch,
                      asked_ubatch=c.n_ubatch, kv_given=bool(c.type_k or c.type_v), check=check,
                      fit_params=fit_params)


def quants_request(model: str, b: BudgetOptions, frontend: FrontendName, c: ContextOptions, p: PlacementOptions,
                   a: AdapterOptions, model_draft: Optional[str], bo: BuildOptions, sp: SpeedOptions, *,
                   candidates: Optional[list[str]], no_imatrix: bool) -> Any:
    """`ggfit quants`' flags as a QuantsRequest: one device budget, the flags every quant is predicted at."""
    from fitter.fit.request import Budgets, FitRequest, QuantsRequest

    build = llama_build_of(bo.llama_build, bo.llama_server)
    speed = speed_of(sp, build)
    be, fe = backend_for(b.backend, speed), frontend_of(frontend)
    cfg = run_config(**context_fields(c), draft_model=model_draft,
                     spec_type="draft-simple" if model_draft else "none", n_gpu_layers=p.n_gpu_layers,
                     n_cpu_moe=p.n_cpu_moe, cpu_moe=p.cpu_moe, override_tensor=tuple(p.override_tensor or ()),
                     no_kv_offload=p.no_kv_offload, **adapter_fields(a))
    budgets = Budgets.parse(b.budget, b.margin, be, several=False)
    fit = FitRequest(model=model, config=cfg, backend=be, frontend=fe, build=build, budgets=budgets, speed=speed,
                     model_draft=model_draft)
    return QuantsRequest(fit=fit, candidates=tuple(candidates or ()), include_imatrix=not no_imatrix)
