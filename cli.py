"""ggfit's command line: a thin typer app over `fitter` and `search`.

No `from __future__ import annotations` here: typer reads every command's annotations when it builds the app, and
strings would be compiled and evaluated one by one (~10 ms of each run)."""

import contextlib
import copy
import functools
import gc
import json
import re
import sys
from typing import Annotated, Any, Optional

import typer

import fitter
from cli_options import (
    MODEL_HELP,
    SIZE_HELP,
    AsJson,
    BackendName,
    BackendOpt,
    Batch,
    BudgetOpt,
    CacheK,
    CacheV,
    CpuMoe,
    Ctx,
    DraftNMax,
    DraftTypeK,
    DraftTypeV,
    EngineName,
    EngineOpt,
    EnginesOpt,
    FlashAttn,
    FlashAttnMode,
    FrontendName,
    FrontendOpt,
    GenTokensOpt,
    GpuLayers,
    HardwareOpt,
    HostBandwidthOpt,
    HostBudgetOpt,
    KvBits,
    KvGroupSize,
    KVUnified,
    LlamaBuildOpt,
    LlamaServerOpt,
    Lora,
    LoraScaled,
    MainGpu,
    MarginOpt,
    MaxKvSize,
    MaxTokens,
    Mmproj,
    ModelDraft,
    NCpuMoe,
    NoKvOffload,
    NoMmap,
    NoMmprojOffload,
    NoOpOffload,
    NoSpeedOpt,
    OverrideTensor,
    Parallel,
    PrefillStep,
    PromptCacheBytes,
    PromptCacheSize,
    PromptKind,
    PromptTokensOpt,
    QuantizedKvStart,
    Repack,
    RunnerName,
    RunnerOpt,
    SeedOpt,
    SessionRequests,
    SpecType,
    SpeedDepthOpt,
    SpeedPromptOpt,
    SplitModeOpt,
    StorageOpt,
    SwaFull,
    TensorSplit,
    Threads,
    TrialsOpt,
    UBatch,
    backend_of,
    check_engine_flags,
    detect_backend,
    frontend_of,
    llama_build_of,
    lora_fields,
    placement_fields,
    run_config,
    split_server_flags,
)
from cli_output import (
    FitRun,
    calibrate_clear,
    calibrate_list,
    calibration_lines,
    fit_mlx,
    mib,
    print_fit,
    print_log_extras,
    print_log_side,
    warn_ctx_train,
)
from cli_speed import Speed, calibrate_bench, choose_fastest, list_speed_calibrations, print_quants
from fitter import GGFitError

# typer >= 0.20 vendors its own click (typer._click); older releases use click itself: take the classes from typer
_UsageError: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_NoArgsIsHelp: Any = getattr(sys.modules[_UsageError.__module__], "NoArgsIsHelpError", ())

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fit llama.cpp models to a memory budget, from GGUF metadata alone.",
    pretty_exceptions_enable=False,
    # plain click help: rich's option table cuts long option names ("--spec-draft-type-k") at 80 columns
    rich_markup_mode=None,
    context_settings={"max_content_width": 100},
)


@app.callback()
def _root() -> None:
    """Fit llama.cpp models to a memory budget, from GGUF metadata alone."""


@app.command()
def inspect(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    as_json: AsJson = False,
) -> None:
    """Describe a model from its header: architecture, size, layer kinds, attention, vocab."""

    header, spec = fitter.load_model_spec(fitter.resolve_model(model), allow_unknown=True)
    if as_json:
        out = spec.model_dump(mode="json")
        out["layer_kinds"] = spec.layer_kind_counts()
        out["has_mtp"] = spec.has_mtp
        out["bytes_fetched"] = header.bytes_fetched
        out["shards"] = [s.location for s in header.shards]
        print(json.dumps(out, indent=2))
        return
    rows: list[tuple[str, str]] = []
    rows.append(("model", ", ".join(s.location for s in header.shards)))
    arch = spec.architecture + (f" ({spec.name})" if spec.name else "")
    if not spec.known:
        arch += "  [not modelled by ggfit: layer kinds below are generic guesses]"
    rows.append(("architecture", arch))
    rows.append(("parameters", f"{spec.n_params:,} ({spec.n_params / 1e9:.3f} B)"))
    rows.append(("file size", f"{mib(spec.file_size)} ({spec.file_size:,} bytes; header {mib(spec.header_size)})"))
    rows.append(("file type", spec.file_type_name or "not set"))
    rows.append(("bytes by type", ", ".join(f"{t} {mib(b)}" for t, b in spec.bytes_by_type.items())))
    trunk = [layer for layer in spec.layers if not layer.nextn]
    kinds = spec.layer_kind_counts()
    parts = []
    if kinds.get("full"):
        parts.append(f"{kinds['full']} full attention")
    if kinds.get("swa"):
        parts.append(f"{kinds['swa']} sliding window ({spec.n_swa} tokens)")
    if kinds.get("recurrent"):
        parts.append(f"{kinds['recurrent']} recurrent")
    no_kv = sum(1 for layer in trunk if not layer.has_kv and layer.kind != fitter.LayerKind.RECURRENT)
    if no_kv:
        parts.append(f"{no_kv} reuse another layer's KV")
    rows.append(("layers", f"{spec.n_layer}: " + ", ".join(parts)))
    pattern = "".join({"full": "F", "swa": "S", "recurrent": "R"}[layer.kind.value] for layer in trunk)
    rows.append(("layer pattern", pattern + "  (F full, S sliding window, R recurrent)"))
    attn = [layer for layer in trunk if layer.kind != fitter.LayerKind.RECURRENT]
    if attn:
        def _span(values: list[int]) -> str:
            lo, hi = min(values), max(values)
            return str(lo) if lo == hi else f"{lo}-{hi}"

        rows.append(
            (
                "attention",
                f"{_span([a.n_head for a in attn])} heads, {_span([a.n_head_kv for a in attn])} KV heads, "
                f"head size K {_span([a.n_embd_head_k for a in attn])} / V {_span([a.n_embd_head_v for a in attn])}"
                + (f"; MLA (kv_lora_rank {spec.n_lora_kv}, no V cache)" if spec.is_mla else ""),
            )
        )
    if spec.ssm:
        s = spec.ssm
        rows.append(("recurrent", f"conv kernel {s.d_conv}, inner {s.d_inner}, state {s.d_state}, groups {s.n_group}, dt rank {s.dt_rank}"))
    if spec.n_expert:
        shared = f", {spec.n_expert_shared} shared" if spec.n_expert_shared else ""
        shexp = f", shared expert FFN {spec.n_ff_shexp}" if spec.n_ff_shexp else ""
        rows.append(("experts", f"{spec.n_expert} ({spec.n_expert_used} used{shared}{shexp})"))
    rows.append(("embedding", str(spec.n_embd)))
    rows.append(("vocab", f"{spec.n_vocab:,}"))
    rows.append(("training context", f"{spec.n_ctx_train:,}"))
    rows.append(("MTP head", f"yes ({spec.n_layer_nextn} NextN layer{'s' if spec.n_layer_nextn > 1 else ''})" if spec.has_mtp else "no"))
    if header.bytes_fetched < spec.file_size:
        rows.append(("read", f"{mib(header.bytes_fetched)} of the file"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


@app.command()
def fit(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    budget: BudgetOpt = "auto",
    margin: MarginOpt = None,
    backend: BackendOpt = None,
    frontend: FrontendOpt = FrontendName.server,
    n_ctx: Ctx = None,
    n_batch: Batch = None,
    n_ubatch: UBatch = None,
    type_k: CacheK = None,
    type_v: CacheV = None,
    flash_attn: FlashAttn = FlashAttnMode.auto,
    n_parallel: Parallel = None,
    kv_unified: KVUnified = None,
    swa_full: SwaFull = None,
    n_gpu_layers: GpuLayers = -1,
    n_cpu_moe: NCpuMoe = 0,
    cpu_moe: CpuMoe = False,
    override_tensor: OverrideTensor = None,
    no_kv_offload: NoKvOffload = False,
    no_op_offload: NoOpOffload = False,
    split_mode: SplitModeOpt = "layer",
    main_gpu: MainGpu = 0,
    tensor_split: TensorSplit = None,
    lora: Lora = None,
    lora_scaled: LoraScaled = None,
    host_budget: HostBudgetOpt = None,
    mmproj: Mmproj = None,
    no_mmproj_offload: NoMmprojOffload = False,
    no_mmap: NoMmap = False,
    repack: Repack = False,
    model_draft: ModelDraft = None,
    spec_type: SpecType = None,
    draft_type_k: DraftTypeK = "f16",
    draft_type_v: DraftTypeV = "f16",
    draft_n_max: DraftNMax = 3,
    check: Annotated[bool, typer.Option("--check", help="Also run llama.cpp's own dry run on this config and compare.")] = False,
    llama_build: LlamaBuildOpt = None,
    llama_server: LlamaServerOpt = None,
    llama_bin: Annotated[Optional[str], typer.Option("--llama-bin", metavar="DIR", help="Your llama.cpp's binaries: its build's rules apply (unless --llama-build says otherwise), and --check runs its llama-fit-params.")] = None,
    hardware: HardwareOpt = "auto",
    host_bandwidth: HostBandwidthOpt = None,
    threads: Threads = None,
    speed_prompt: SpeedPromptOpt = 512,
    speed_depth: SpeedDepthOpt = 0,
    no_speed: NoSpeedOpt = False,
    as_json: AsJson = False,
    engine: EngineOpt = EngineName.llama,
    max_kv_size: MaxKvSize = None,
    kv_bits: KvBits = None,
    kv_group_size: KvGroupSize = 64,
    quantized_kv_start: QuantizedKvStart = 5000,
    prefill_step_size: PrefillStep = 2048,
    max_tokens: MaxTokens = 512,
    prompt_cache_bytes: PromptCacheBytes = None,
    prompt_cache_size: PromptCacheSize = 10,
    session_requests: SessionRequests = None,
) -> None:
    """Predict what llama.cpp (or mlx-lm, --engine mlx) allocates and solve for the largest context that fits a budget."""
    check_engine_flags(ctx, engine.value)
    if engine == EngineName.mlx:
        fit_mlx(model, budget=budget, margin=margin, n_ctx=n_ctx, model_draft=model_draft, max_kv_size=max_kv_size,
                kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                prefill_step_size=prefill_step_size, max_tokens=max_tokens, prompt_cache_bytes=prompt_cache_bytes,
                draft_n_max=draft_n_max, as_json=as_json, prompt_cache_size=prompt_cache_size,
                session_requests=session_requests)
        return
    fit_params = fitter.fit_params_binary(llama_bin) if llama_bin else None
    if fit_params is not None and llama_build is None:
        build = fitter.build_of_binary(fit_params)
    else:
        build = llama_build_of(llama_build, llama_server)
    speed = Speed(hardware, host_bandwidth, threads, speed_prompt, speed_depth, off=no_speed, build=build)
    be, fe = speed.backend(backend), frontend_of(frontend)
    if spec_type not in (None, "draft-simple", "draft-mtp"):
        raise fitter.ConfigError(f"--spec-type {spec_type}: ggfit models draft-simple and draft-mtp")
    buds = fitter.parse_budgets(budget, be.value)
    bud = buds[main_gpu] if split_mode == "none" and main_gpu < len(buds) else buds[0]
    margin_bytes = fitter.parse_margin(margin, be.value)
    available = fitter.available_bytes(bud, margin_bytes)  # a margin that leaves nothing is the user's error
    # one budget per GPU: each device within its own (the layers split by the budgets unless -ts says otherwise)
    per_device = ({f"CUDA{i}": b.bytes for i, b in enumerate(buds)} if len(buds) > 1 and split_mode != "none"
                  else None)
    for b in buds[1:]:
        fitter.available_bytes(b, margin_bytes)
    # system RAM next to the GPU (default: what is available now); on the CPU everything is the one budget, and a
    # Mac's unified memory is the Metal budget already (a host budget there only when given)
    host = (fitter.parse_host_budget(host_budget) if be.value == "cuda" or (host_budget and be.value != "cpu")
            else None)
    cfg = run_config(
        n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k or "f16", type_v=type_v or "f16",
        flash_attn=flash_attn.value, n_parallel=n_parallel, kv_unified=kv_unified, swa_full=swa_full,
        n_gpu_layers=n_gpu_layers, no_mmap=no_mmap, no_repack=not repack,
        spec_type=spec_type or ("draft-simple" if model_draft else "none"), draft_model=model_draft,
        draft_type_k=draft_type_k, draft_type_v=draft_type_v, draft_n_max=draft_n_max,
        mmproj=mmproj, no_mmproj_offload=no_mmproj_offload,
        **placement_fields(n_cpu_moe, cpu_moe, override_tensor, no_kv_offload, no_op_offload, split_mode, main_gpu,
                            tensor_split, buds, be.value),
        lora=lora_fields(lora, lora_scaled),
    )
    path = fitter.resolve_model(model)
    header, spec = fitter.load_model_spec(path)
    draft = fitter.load_model_spec(fitter.resolve_model(model_draft)) if model_draft else None
    r = FitRun(path=path, header=header, spec=spec, cfg=cfg, be=be, fe=fe, bud=bud, margin_bytes=margin_bytes,
                available=available, draft=draft, model_draft=model_draft, build=build, margin_default=margin is None,
                host=host, n_gpus=len(buds), per_device=per_device, asked={"-b": n_batch, "-ub": n_ubatch},
                speed=speed)
    # -c given: one config, each of its graphs (and each placement's, where it does not fit) predicted once
    with contextlib.nullcontext() if n_ctx is None else fitter.predict_once():
        r.solve(solve_ctx=n_ctx is None, n_batch=n_batch, n_ubatch=n_ubatch, kv_given=bool(type_k or type_v))
        r.solve_placement()
        choose_fastest(r)
        r.conclude()
        if not build.is_pinned:
            r.differences = fitter.build_differences(header, spec, r.pred_config, be, fe, r.pred_draft, r.pred,
                                                     n_gpus=r.n_gpus)
    warn_ctx_train(r.pred.context, spec)
    if check and fit_params is not None:
        ccfg = fitter.fit_params_check_config(r.pred, r.pred_config)
        cpred = fitter.predict(header, spec, ccfg, be, fitter.FIT_PARAMS_FRONTEND, build=build)
        r.fit_params = fitter.fit_params_check(fit_params, path, ccfg, cpred)
    elif check:
        r.measured = fitter.dry_run_check(path, r.pred, cfg)
    if as_json:
        print(json.dumps(r.as_json(), indent=2))
        raise typer.Exit(r.exit_code)  # the text's exit code: 1 when nothing fits (FitRun.verdict)
    print_fit(r)


@app.command()
def quants(
    model: Annotated[str, typer.Argument(help=MODEL_HELP + " Any quant of the model: only its header is read.")],
    budget: BudgetOpt = "auto",
    margin: MarginOpt = None,
    backend: BackendOpt = None,
    frontend: FrontendOpt = FrontendName.server,
    n_ctx: Ctx = None,
    n_batch: Batch = None,
    n_ubatch: UBatch = None,
    type_k: CacheK = None,
    type_v: CacheV = None,
    flash_attn: FlashAttn = FlashAttnMode.auto,
    n_parallel: Parallel = None,
    n_gpu_layers: GpuLayers = -1,
    n_cpu_moe: NCpuMoe = 0,
    cpu_moe: CpuMoe = False,
    override_tensor: OverrideTensor = None,
    no_kv_offload: NoKvOffload = False,
    lora: Lora = None,
    lora_scaled: LoraScaled = None,
    mmproj: Mmproj = None,
    no_mmproj_offload: NoMmprojOffload = False,
    model_draft: ModelDraft = None,
    candidate: Annotated[Optional[list[str]], typer.Option("--candidate", help="NAME=PATH_OR_URL or NAME=21109MiB (repeatable).")] = None,
    no_imatrix: Annotated[bool, typer.Option("--no-imatrix", help="Leave out quants that need an importance matrix.")] = False,
    llama_build: LlamaBuildOpt = None,
    llama_server: LlamaServerOpt = None,
    hardware: HardwareOpt = "auto",
    host_bandwidth: HostBandwidthOpt = None,
    threads: Threads = None,
    speed_prompt: SpeedPromptOpt = 512,
    speed_depth: SpeedDepthOpt = 0,
    no_speed: NoSpeedOpt = False,
    as_json: AsJson = False,
) -> None:
    """Every quant's file size, device total and predicted prefill and decode rates at these settings, from one
    header, before downloading."""

    build = llama_build_of(llama_build, llama_server)
    speed = Speed(hardware, host_bandwidth, threads, speed_prompt, speed_depth, off=no_speed, build=build)
    be, fe = speed.backend(backend), frontend_of(frontend)
    cfg = run_config(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k or "f16", type_v=type_v or "f16",
                      flash_attn=flash_attn.value, n_parallel=n_parallel, draft_model=model_draft,
                      spec_type="draft-simple" if model_draft else "none", n_gpu_layers=n_gpu_layers,
                      n_cpu_moe=n_cpu_moe, cpu_moe=cpu_moe, override_tensor=tuple(override_tensor or ()),
                      no_kv_offload=no_kv_offload, lora=lora_fields(lora, lora_scaled), mmproj=mmproj,
                      no_mmproj_offload=no_mmproj_offload)
    bud = fitter.parse_budget(budget, be.value)
    margin_bytes = fitter.parse_margin(margin, be.value)
    available = fitter.available_bytes(bud, margin_bytes)  # a margin that leaves nothing is the user's error
    header, spec = fitter.load_model_spec(fitter.resolve_model(model))
    draft = fitter.load_model_spec(fitter.resolve_model(model_draft)) if model_draft else None
    if n_ctx:

        warn_ctx_train(fitter.resolve_context(spec, cfg, fe), spec)
    cands = fitter.evaluate(header, spec, cfg, be, fe, bud.bytes, margin_bytes, candidates=candidate or [], draft=draft,
                            include_imatrix=not no_imatrix, build=build, rate=speed.rates(be))
    best = fitter.best_fit(cands)
    if as_json:
        none = fitter.why_none_fits(cands, cands[0].n_ctx, be.value, spec.n_expert > 0) if cands and not best else None
        print(json.dumps({"backend": be.value, "llama_cpp": fitter.build_label() if build.is_pinned else build.label(),
                          "budget_bytes": bud.bytes, "margin_bytes": margin_bytes,
                          "header_bytes_fetched": header.bytes_fetched,
                          "candidates": [speed.candidate_json(c) for c in cands],
                          "best": best.name if best else None, "best_rule": fitter.BEST_RULE, "none_fits": none,
                          "speed": speed.settings_json()},
                         indent=2))
        raise typer.Exit(1 if none else 0)  # as the text: 1 when nothing fits
    ctx = cands[0].n_ctx if cands else 0
    if not build.is_pinned:
        print(f"rules of {build.label()} ({build.how})")
    print(f"{spec.architecture}, {spec.n_params / 1e9:.2f} B parameters; backend {be.value}, -c {ctx}, "
          f"-ctk {cfg.type_k} -ctv {cfg.type_v}; budget {mib(bud.bytes)} - margin {mib(margin_bytes)} = {mib(available)}")
    print_quants(cands, best, speed)
    if best:
        print(f"best fit: {best.name} ({best.file_bytes / 2**20:,.0f} MiB), headroom {best.headroom_bytes / 2**20:,.0f} MiB "
              f"({fitter.BEST_RULE})")
    elif cands:
        print(fitter.why_none_fits(cands, ctx, be.value, spec.n_expert > 0))
        raise typer.Exit(1)


def _signals(then: str = ""):
    """A command that runs probes: Ctrl-C and SIGTERM (search.signals) clean up as Ctrl-C does, then say one line
    (`ggfit: interrupted; THEN`, or a study's own hint) and exit 130, or die of SIGTERM (143 in a shell)."""
    def deco(f):
        @functools.wraps(f)
        def run(*args, **kwargs):
            from search.signals import Terminated, die_of_sigterm, sigterm_as_interrupt

            try:
                with sigterm_as_interrupt():
                    return f(*args, **kwargs)
            except KeyboardInterrupt as e:  # typer would turn it into a silent exit 130
                term = isinstance(e, Terminated) or bool(getattr(e, "terminated", False))
                hint = e.hint() if hasattr(e, "hint") else ("terminated (SIGTERM)" if term else "interrupted") + (
                    f"; {then}" if then else "")
                print(f"ggfit: {hint}", file=sys.stderr, flush=True)
                if term:
                    die_of_sigterm()
                raise typer.Exit(130) from None
        return run
    return deco


@app.command()
@_signals("run the same command to resume")
def optimise(
    models: Annotated[list[str], typer.Argument(help="One model, or several quants of one model (searched as a parameter).")],
    study: Annotated[str, typer.Option("--study", help="prefill, decode, balanced, long-context, speculative, or a .toml path.")] = "prefill",
    budget: BudgetOpt = "auto",
    margin: MarginOpt = None,
    backend: BackendOpt = None,
    storage: StorageOpt = None,
    trials: TrialsOpt = None,
    runner: RunnerOpt = RunnerName.python,
    llama_server: LlamaServerOpt = None,
    draft: Annotated[Optional[list[str]], typer.Option("--draft", help="A draft model to consider (repeatable).")] = None,
    seed: SeedOpt = None,
    no_compare: Annotated[bool, typer.Option("--no-compare", help="Skip measuring llama.cpp's default flags.")] = False,
    n_gpu_layers: GpuLayers = -1,
    n_cpu_moe: NCpuMoe = 0,
    cpu_moe: CpuMoe = False,
    override_tensor: OverrideTensor = None,
    no_kv_offload: NoKvOffload = False,
    no_op_offload: NoOpOffload = False,
    lora: Lora = None,
    lora_scaled: LoraScaled = None,
    mmproj: Mmproj = None,
    no_mmproj_offload: NoMmprojOffload = False,
    llama_build: LlamaBuildOpt = None,
    engine: EnginesOpt = None,
    speed_cut: Annotated[Optional[float], typer.Option("--speed-cut", help="Skip configs the speed model predicts below this share of the best predicted (0: off; default: the study file's speed_cut, 0.5).")] = None,
) -> None:
    """Search for the fastest config that fits: an Optuna study whose trials are real probes, and
    which never probes a config the memory model says will not fit. Killed, it resumes where it stopped."""
    from search.study import NothingFits, run_study  # optuna: only for this command
    from search.study.prior import study_hardware

    if runner in (RunnerName.openai, RunnerName.mlx):
        raise fitter.ConfigError(f"--runner {runner.value}: optimise takes python or server (engines: ggfit compare-engines)")
    if mmproj and runner == RunnerName.python:  # llama-cpp-python's Llama loads no projector
        raise fitter.ConfigError("--mmproj: the python runner loads no multimodal projector; use --runner server")
    if mmproj:  # a bad file, or one of another width than the model: one line now, not a failed trial
        fitter.check_mmproj_models(mmproj, backend_of(backend), [fitter.resolve_model(m) for m in models])
    build = llama_build_of(llama_build, llama_server if llama_build == "auto" else None)
    if trials is not None and trials < 1:
        raise fitter.ConfigError(f"--trials {trials}: use 1 or more")
    if seed is not None and not 0 <= seed < 2**32:
        raise fitter.ConfigError(f"--seed {seed}: use a number from 0 to {2**32 - 1}")
    if _engine_study(engine, models, {
            "--study": study != "prefill", "--draft": bool(draft), "--storage": bool(storage),
            "--runner": runner != RunnerName.python, "--backend": bool(backend), "--no-compare": no_compare,
            "--llama-build": bool(llama_build), "-ngl": n_gpu_layers != -1, "--n-cpu-moe": bool(n_cpu_moe),
            "--cpu-moe": cpu_moe, "-ot": bool(override_tensor), "--no-kv-offload": no_kv_offload,
            "--no-op-offload": no_op_offload}):
        _compare_engines(models[0], models[1], budget=budget, margin=margin, trials=trials, prompt_tokens=64,
                         gen_tokens=16, llama_server=llama_server, seed=seed, as_json=False)
        return
    # placement flags every trial shares: the study's [fixed] settings (the study file's [space] may search
    # n_cpu_moe / n_gpu_layers instead)
    given = {k: v for k, v, dflt in (("n_gpu_layers", n_gpu_layers, -1), ("n_cpu_moe", n_cpu_moe, 0),
                                     ("cpu_moe", cpu_moe, False), ("override_tensor", tuple(override_tensor or ()), ()),
                                     ("no_kv_offload", no_kv_offload, False), ("no_op_offload", no_op_offload, False),
                                     ("lora", lora_fields(lora, lora_scaled), ()), ("mmproj", mmproj, None),
                                     ("no_mmproj_offload", no_mmproj_offload, False))
             if v != dflt}
    study_def: Any = study
    if given:
        from search.study.define import StudyDef, load_study

        run_config(**given)  # one line for a value llama.cpp refuses
        d = load_study(study)
        study_def = StudyDef(**{**d.model_dump(), "fixed": {**d.fixed, **given}})
    try:
        # each trial's outcome as a lasting line, the probe in flight on the live line, both on stderr
        with fitter.Progress("optimise") as live:
            result = run_study([fitter.resolve_model(m) for m in models], study_def, budget=budget, margin=margin,
                               backend=backend_of(backend).value, storage=storage, n_trials=trials, runner=runner.value,
                               drafts=draft or (), llama_server=llama_server, seed=seed, compare_defaults=not no_compare,
                               progress=lambda line: print(line, file=sys.stderr, flush=True), live=live,
                               llama_build=build, hardware=study_hardware(), speed_cut=speed_cut)
    except NothingFits as e:  # does not fit: exit 1, as fit says it
        print(f"ggfit: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    print(result.text())


@app.command("compare-engines")
@_signals()
def compare_engines_cmd(
    gguf: Annotated[str, typer.Argument(help="The model as a GGUF (path, URL or bundled name).")],
    mlx_model: Annotated[str, typer.Argument(help="The same model as an MLX directory (config.json + safetensors).")],
    budget: BudgetOpt = "auto",
    margin: MarginOpt = None,
    trials: TrialsOpt = None,
    prompt_tokens: PromptTokensOpt = 64,
    gen_tokens: GenTokensOpt = 16,
    llama_server: LlamaServerOpt = None,
    seed: SeedOpt = None,
    as_json: AsJson = False,
) -> None:
    """Which engine is faster for this model and workload under the budget: an Optuna study over `engine`
    (llama.cpp or MLX) and each engine's settings, every trial a real server measured the same way."""
    _compare_engines(gguf, mlx_model, budget=budget, margin=margin, trials=trials, prompt_tokens=prompt_tokens,
                     gen_tokens=gen_tokens, llama_server=llama_server, seed=seed, as_json=as_json)


def _engine_study(engine: str | None, models: list[str], given: dict[str, bool]) -> bool:
    """optimise --engine: False for llama.cpp alone; True for llama,mlx (the engine study) once its two models are
    there and no llama.cpp-only flag (`given`: flag -> set) is."""
    engines = {e.strip() for e in (engine or "llama").split(",")}
    if not engines <= {"llama", "mlx"}:
        raise fitter.ConfigError(f"--engine {engine}: use llama, or llama,mlx (engine searched as a parameter)")
    if engines == {"mlx"}:
        raise fitter.ConfigError("--engine mlx: optimise searches MLX beside llama.cpp (--engine llama,mlx MODEL.gguf "
                                 "MLX_DIR); fit --engine mlx sizes an MLX model alone")
    if "mlx" not in engines:
        return False
    if len(models) != 2:
        raise fitter.ConfigError(f"--engine {engine}: give a GGUF and the same model's MLX directory "
                                 f"({len(models)} model{'s' if len(models) != 1 else ''} given)")
    unused = [flag for flag, on in given.items() if on]
    if unused:
        verb = "does" if len(unused) == 1 else "do"
        raise fitter.ConfigError(f"--engine {engine}: {', '.join(unused)} {verb} not apply to the engine study "
                                 "(its trials search -ub for llama.cpp, --prefill-step-size and --kv-bits for MLX)")
    return True


def _compare_engines(gguf: str, mlx_model: str, *, budget: str, margin: str | None, trials: int | None,
                     prompt_tokens: int, gen_tokens: int, llama_server: str | None, seed: int | None,
                     as_json: bool) -> None:
    """compare-engines, and optimise --engine llama,mlx: the engine study; exit 1 when no engine ran."""
    fitter.require_mlx_lm()
    trials = 8 if trials is None else trials
    if trials < 2:
        raise fitter.ConfigError(f"--trials {trials}: use 2 or more (each engine's defaults come first)")
    from search.study.engines import compare_engines  # optuna: only for this command

    backend = detect_backend()
    bud = fitter.parse_budget(budget, backend)
    available = fitter.available_bytes(bud, fitter.parse_margin(margin, backend))
    r = compare_engines(fitter.resolve_model(gguf), mlx_model, available_bytes=available, n_trials=trials,
                        prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, seed=seed or 0, llama_server=llama_server)
    print(r.model_dump_json(indent=2) if as_json else r.text())
    raise typer.Exit(0 if r.winner else 1)


@app.command()
def report(
    study: Annotated[str, typer.Argument(help="The study's name (printed by ggfit optimise).")],
    storage: StorageOpt = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Write trials.csv, summary.json and plots (HTML, PNG) here.")] = None,
) -> None:
    """The trial table of a study (status, reason, metrics) and, with --out, its plots."""
    from search.report import report as study_report  # optuna, plots: only for this command

    study_report(study, storage=storage, out=out)


@app.command()
def calibrate(
    model: Annotated[Optional[str], typer.Argument(help=MODEL_HELP + " With --clear: an architecture (gemma3) or a model.")] = None,
    backend: BackendOpt = None,
    list_: Annotated[bool, typer.Option("--list", help="List the stored calibrations.")] = False,
    clear: Annotated[bool, typer.Option("--clear", help="Remove the stored calibrations (all, or MODEL's architecture's).")] = False,
    log: Annotated[Optional[str], typer.Option("--log", metavar="FILE", help="A llama-server, llama-cli or llama-fit-params log of your own llama.cpp: compare every buffer it printed with the prediction for its build and settings, and store the compute residual for that build and backend. MODEL is then optional (default: the model the log names, if it is on this machine); --backend defaults to the log's.")] = None,
    llama_build: LlamaBuildOpt = None,
    no_store: Annotated[bool, typer.Option("--no-store", help="With --log or --bench: compare only, store nothing.")] = False,
    bench: Annotated[Optional[str], typer.Option("--bench", metavar="FILE", help="llama-bench's output (-o md, csv, json, jsonl, sql) or a ggfit probe --json result, run on this machine: each row's rate against the speed model's, and this machine's scale of the prefill and decode rates stored for --hardware and the rows' llama.cpp build (fit and quants then use it). MODEL: the model the rows ran (default: each row's model_filename, where it is on this machine).")] = None,
    hardware: HardwareOpt = "auto",
    host_bandwidth: HostBandwidthOpt = None,
    as_json: AsJson = False,
) -> None:
    """Run llama.cpp's dry run over a small grid here and store compute-buffer corrections for this
    architecture, backend and llama.cpp build; later predictions use them. With --log, learn them from
    a log of your own llama.cpp instead; with --bench, calibrate the speed model from llama-bench's rates."""

    if bench is not None:
        if log is not None or list_ or clear:
            raise fitter.ConfigError("--bench with --log, --list or --clear: use one at a time")
        speed = Speed(hardware, host_bandwidth, build=llama_build_of(llama_build) if llama_build else None)
        calibrate_bench(bench, model, speed, no_store=no_store, as_json=as_json)
        return
    if hardware != "auto" or host_bandwidth is not None:
        raise fitter.ConfigError("--hardware and --host-bandwidth go with --bench FILE (the speed calibration)")
    if log is not None:
        if list_ or clear:
            raise fitter.ConfigError("--log with --list or --clear: use one at a time")
        _calibrate_log(log, model, backend, llama_build, no_store, as_json)
        return
    if llama_build is not None or no_store:
        raise fitter.ConfigError(f"{'--llama-build' if llama_build is not None else '--no-store'} goes with --log FILE or --bench FILE "
                                 "(without it, calibrate measures the llama.cpp installed here)")
    if list_ or clear:
        if list_ and clear:
            raise fitter.ConfigError("--list and --clear: use one at a time")
        if list_:
            calibrate_list(fitter.calibration, model, as_json)
            if not as_json:
                list_speed_calibrations()
        else:
            calibrate_clear(fitter.calibration, model, as_json)
        return
    if model is None:
        raise fitter.ConfigError("calibrate needs a MODEL (or --list, or --clear [ARCH])")
    be = backend_of(backend)
    path = fitter.resolve_model(model)
    fitter.calibration.check_store()  # before the dry runs, not a traceback after them
    with fitter.Progress("calibrate", json_output=as_json) as progress:
        cal, rows = fitter.calibrate(path, be, progress=progress)
    where = fitter.calibration.save(cal)
    if as_json:
        print(json.dumps({"calibration": cal.model_dump(mode="json"), "identity": cal.identity, "grid": rows,
                          "stored": str(where)}, indent=2))
        return
    print(f"{'n_ctx':>8} {'-ub':>6} {'-fa':>4} {'predicted MiB':>14} {'llama.cpp MiB':>14}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['n_ctx']:>8} {r['n_ubatch']:>6} {r['flash_attn']:>4}  llama.cpp {r['status']}: {r['message']}")
            continue
        m = r.get("measured_device")
        print(f"{r['n_ctx']:>8} {r['n_ubatch']:>6} {r['flash_attn']:>4} {r['predicted_device'] / 2**20:>14,.2f} "
              + (f"{m / 2**20:>14,.2f}" if m is not None else f"{'not reported':>14}"))
    for line in calibration_lines(cal):
        print(line)
    print(f"stored for {cal.architecture} on {cal.backend}, llama.cpp {cal.llama_cpp[:12]}: {where}")


def _calibrate_log(path: str, model: Optional[str], backend: BackendName | None, llama_build: Optional[str],
                   no_store: bool, as_json: bool) -> None:
    """`ggfit calibrate --log FILE [MODEL]`: the log's buffers next to the prediction for its build and settings."""
    ulog = fitter.read_user_log(path)
    if not no_store:
        fitter.calibration.check_store()
    be = fitter.Backend(backend.value) if backend else None
    try:
        cmp = fitter.compare_log(ulog, fitter.resolve_model(model) if model else None, backend=be,
                                 llama_build=llama_build)
    except GGFitError:
        if not as_json:  # what the log says, then why ggfit cannot predict it (one line on stderr)
            print_log_side(ulog)
        raise
    stored = None
    if cmp.prediction is not None and not no_store:
        try:
            stored = fitter.record_log(cmp)
        except GGFitError as e:
            cmp.notes.append(str(e))
    if as_json:
        out = {"log": fitter.log_summary(ulog), "build": cmp.build.label() if cmp.build else None,
               "backend": cmp.backend.value if cmp.backend else None, "model": cmp.model,
               "architecture": cmp.architecture, "frontend": cmp.frontend.value if cmp.frontend else None,
               "config": cmp.config.model_dump(mode="json") if cmp.config else None, "assumed": cmp.assumed,
               "rows": [dict(r.model_dump(mode="json"), diff_bytes=r.diff_bytes) for r in cmp.rows],
               "notes": cmp.notes, "missing": cmp.missing,
               "stored": {"calibration": stored[0].model_dump(mode="json"), "path": str(stored[1])} if stored else None}
        print(json.dumps(out, indent=2))
        return
    print_log_side(ulog, rows=False)
    if cmp.build is not None:
        print(f"build    {cmp.build.label()} ({cmp.build.how})")
    if cmp.prediction is not None:
        print(f"model    {cmp.model} ({cmp.architecture}), predicted as {cmp.prediction.backend.value}, "
              f"{cmp.prediction.frontend.value} defaults")
        if cmp.assumed:
            print("assumed  " + ", ".join(f"{k} = {v}" for k, v in cmp.assumed.items()))
    print()
    if cmp.rows:
        print(f"{'kind':<8} {'side':<6} {'buffer':<24} {'predicted MiB':>14} {'llama.cpp MiB':>14} {'diff MiB':>10} {'diff':>8}")
    for r in cmp.rows:
        names = "/".join(dict.fromkeys(r.printed_buffers or r.predicted_buffers))
        p = "-" if r.predicted_bytes is None else f"{r.predicted_bytes / 2**20:,.2f}"
        m = "-" if r.printed_bytes is None else f"{r.printed_bytes / 2**20:,.2f}"
        d, pct = "-", "-"
        if r.diff_bytes is not None:
            d = f"{r.diff_bytes / 2**20:+,.2f}"
            pct = f"{100 * r.diff_bytes / r.printed_bytes:+.1f}%" if r.printed_bytes else "-"
        print(f"{r.kind:<8} {r.side:<6} {names:<24} {p:>14} {m:>14} {d:>10} {pct:>8}")
    print_log_extras(ulog)
    for note in cmp.notes:
        print(f"note: {note}")
    if cmp.missing:
        print(f"not predicted: {cmp.missing}")
    if stored:
        cal, where = stored
        print(f"stored for {cal.architecture} on {cal.backend}, llama.cpp {cal.llama_cpp} "
              f"({len(cal.logs)} log{'s' if len(cal.logs) > 1 else ''}): {where}")
        for line in calibration_lines(cal):
            print(f"  {line}")
        flag = cal.llama_cpp if not cal.llama_cpp.startswith(fitter.LLAMA_CPP_COMMIT[:12]) else "pinned"
        print(f"later predictions for llama.cpp {cal.llama_cpp[:12]} on {cal.backend} use it "
              f"(ggfit fit ... --llama-build {flag} --backend {cal.backend})")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_signals("the probe was stopped")
def probe(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help=MODEL_HELP + " Any further arguments are llama-server flags.")] = None,
    runner: RunnerOpt = RunnerName.python,
    budget: Annotated[Optional[str], typer.Option("--budget", help=f"CPU only: run the probe under this memory limit: {SIZE_HELP}.")] = None,
    llama_server: LlamaServerOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before the probe is a timeout.")] = 300.0,
    prompt_tokens: PromptTokensOpt = 512,
    gen_tokens: GenTokensOpt = 64,
    repeats: Annotated[int, typer.Option("--repeats", help="Measured runs after one warm-up (1 or more); the median is reported.")] = 3,
    kind: Annotated[PromptKind, typer.Option("--kind", help="The prompt text.")] = PromptKind.prose,
    as_json: AsJson = False,
    url: Annotated[Optional[str], typer.Option("--url", help="openai runner: the OpenAI-compatible server's base URL.")] = None,
    pid: Annotated[Optional[int], typer.Option("--pid", help="openai runner: the server's pid, for its memory (/proc).")] = None,
    depth: Annotated[Optional[list[int]], typer.Option("--depth", help="openai runner: context depth in tokens before the prompt (repeatable; default 0).")] = None,
    concurrency: Annotated[Optional[list[int]], typer.Option("--concurrency", help="openai runner: concurrent clients (repeatable; default 1).")] = None,
    soak: Annotated[int, typer.Option("--soak", help="openai runner: N more requests, one after another, and the server's memory growth.")] = 0,
    reasoning: Annotated[bool, typer.Option("--reasoning/--no-reasoning", help="openai runner: leave the template's thinking on.")] = False,
) -> None:
    """Prove a config with a real request in an isolated process: ok, oom, crash, timeout or error."""
    if runner == RunnerName.openai:
        from search.runner_openai import OpenAIProbe

        if not url:
            raise fitter.GGFitError("--runner openai needs --url (the server's base URL, e.g. http://127.0.0.1:8080)")
        with fitter.Progress("probe", json_output=as_json) as live:  # each request as it ends, on stderr
            res = OpenAIProbe(url, model=model, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats,
                              depths=tuple(depth or (0,)), concurrency=tuple(concurrency or (1,)), timeout=timeout,
                              pid=pid, soak=soak, reasoning=reasoning, progress=live).run()
        print(res.model_dump_json(indent=2) if as_json else res.summary())
        raise typer.Exit(0 if res.ok else 1)
    if model is None:
        raise fitter.GGFitError(f"Missing argument 'MODEL' (--runner {runner.value} needs one; --runner openai takes --url)")
    if runner == RunnerName.mlx:
        from search.runner_mlx import MlxFlags, mlx_probe
        from search.runner_openai import OpenAIProbe

        fitter.require_mlx_lm()
        fitter.load_mlx_model(model)  # a missing or hostile model directory: one line, before the server starts
        with fitter.Progress("probe", json_output=as_json) as live:  # the server's start, each request, on stderr
            res, cmd = mlx_probe(model, MlxFlags(extra_args=tuple(ctx.args)), lambda u, p: OpenAIProbe(
                u, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, depths=tuple(depth or (0,)),
                concurrency=tuple(concurrency or (1,)), pid=p, soak=soak, reasoning=reasoning, progress=live),
                timeout=timeout, progress=live)
        print(res.model_dump_json(indent=2) if as_json else res.summary() + "\n  command: " + " ".join(cmd))
        raise typer.Exit(0 if res.ok else 1)
    from search.probe import probe_cli  # the probe machinery: only for this command
    from search.workload import Workload  # pydantic: not for --help

    if not (0 < timeout < float("inf")):
        raise fitter.ConfigError(f"--timeout {timeout:g}: use a number of seconds above 0")
    workload = Workload.from_flags(prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, kind=kind.value)
    code, text = probe_cli(model, list(ctx.args), runner=runner.value, budget=budget, llama_server=llama_server,
                           timeout=timeout, workload=workload, as_json=as_json)
    print(text)
    raise typer.Exit(code)


@app.command()
def hardware(
    name: Annotated[Optional[str], typer.Argument(metavar="[NAME|auto]", help="A profile to show with its sources, or auto: this machine.")] = None,
    detect: Annotated[bool, typer.Option("--detect", help="What this machine is detected as, and its host memory bandwidth (as NAME auto).")] = False,
    sources: Annotated[bool, typer.Option("--sources", help="Where each figure comes from.")] = False,
    remeasure: Annotated[bool, typer.Option("--remeasure", help="With auto: measure the host bandwidth again (it is cached).")] = False,
    as_json: AsJson = False,
) -> None:
    """The speed model's hardware profiles: memory bandwidth, FP16 compute, GPU cores, memory sizes, each figure's
    source; with auto, this machine's."""
    from cli_hardware import show_hardware

    show_hardware(name, detect=detect, sources=sources, remeasure=remeasure, as_json=as_json)


def _usage_line(e) -> str:
    """click's usage error (unknown option, missing argument, a value that is not a number) as one line."""
    msg = " ".join(e.format_message().split())
    # click's int/float parsing ("'abc' is not a valid int.") in the house's words
    msg = msg.replace(" is not a valid int.", " is not a whole number")
    msg = msg.replace(" is not a valid float.", " is not a number")
    # an Enum option's refusal, in the house's words: the flag, the value, the allowed values
    m = re.fullmatch(r"Invalid value for '([^']+)'(?: / '[^']+')*: '(.*)' is not one of (.+)\.", msg)
    if m:
        allowed = re.findall(r"'([^']*)'", m.group(3))
        msg = f"{m.group(1)} {m.group(2)}: use {', '.join(allowed[:-1])} or {allowed[-1]}"
    cmd = e.ctx.command_path if e.ctx is not None else "ggfit"
    return f"ggfit: error: {msg} (see {cmd} --help)"


_ONE_SHOT = frozenset({"fit", "quants", "inspect"})


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors (ggfit's and click's usage errors) become one line on stderr and exit code 2;
    Ctrl-C is exit code 130."""
    args = sys.argv[1:] if argv is None else argv
    one_shot = bool(args[:1]) and args[0] in _ONE_SHOT
    if one_shot:
        # one answer and exit: what they allocate is bounded (a header, a few graphs), and the cyclic collector's
        # passes over the imported modules' objects cost 20-65 ms of a 0.25-0.4 s command
        gc.disable()
    try:
        _run(argv)
    finally:
        if one_shot and argv is None:
            # and the interpreter's last collection at exit walks every object left (typer's and ggfit's modules:
            # ~25 ms); frozen, they are left to the process's end (their files are closed by then, by the
            # `with` blocks that opened them)
            gc.freeze()


def app_for(args: list[str]) -> typer.Typer:
    """The app that runs `args`: where they start with a command's name, `app` holding that command alone, else `app`
    (the root's help, a mistyped command and click's suggestions). typer builds the parameters of every command it
    holds on each run: 47M instructions for the eight, a run uses one."""
    for info in app.registered_commands:
        name = info.name or (typer.main.get_command_name(info.callback.__name__) if info.callback else None)
        if args[:1] == [name]:
            one = copy.copy(app)
            one.registered_commands = [info]
            return one
    return app


def _run(argv: Optional[list[str]]) -> None:
    from fitter.gguf import header_cache  # the standard library only

    ignored: list[str] = []
    try:
        # fit, quants: a pasted llama-server command line's flags that change no memory are ignored, and said so
        args, ignored = split_server_flags(list(sys.argv[1:] if argv is None else argv))
        with header_cache.enabled():  # a command reads a local header's parse from disk when the file is unchanged
            rc = app_for(args)(args=args, prog_name="ggfit", standalone_mode=False)
    except _NoArgsIsHelp as e:  # `ggfit` / `ggfit fit` alone: the help, as click prints it
        print(e.ctx.get_help(), file=sys.stderr)
        sys.exit(2)
    except _UsageError as e:
        print(_usage_line(e), file=sys.stderr)
        sys.exit(2)
    except GGFitError as e:
        print("ggfit: error: " + " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()), file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        print("ggfit: interrupted", file=sys.stderr)
        sys.exit(130)
    if ignored:
        print(f"ggfit: note: ignored (no effect on memory): {' '.join(ignored)}", file=sys.stderr)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
