"""The commands that run probes and studies (optimise, compare-engines) past their flags: the study's request,
the engine study, and how Ctrl-C and SIGTERM end them."""

import sys
from typing import Any, Literal, Optional

import typer

from cli_options import (
    AdapterOptions,
    BudgetOptions,
    BuildOptions,
    PlacementOptions,
    RunnerName,
    backend_of,
    detect_backend,
)
from cli_request import llama_build_of, lora_fields, run_config


def optimise_run(models: list[str], study: str, budget: BudgetOptions, *, storage: Optional[str],
                 trials: Optional[int], runner: RunnerName, drafts: Optional[list[str]], seed: Optional[int],
                 no_compare: bool, placement: PlacementOptions, no_op_offload: bool, adapters: AdapterOptions,
                 build: BuildOptions, engine: Optional[str], speed_cut: Optional[float], rpc: Optional[str] = None,
                 rpc_kinds: Optional[str] = None) -> None:
    """`ggfit optimise`: check the flags, then the engine study or the Optuna study of one engine."""
    from fitter.llama.flags import ConfigError

    if runner in (RunnerName.openai, RunnerName.mlx):
        raise ConfigError(f"--runner {runner.value}: optimise takes python or server (engines: ggfit compare-engines)")
    if adapters.mmproj and runner == RunnerName.python:  # llama-cpp-python's Llama loads no projector
        raise ConfigError("--mmproj: the python runner loads no multimodal projector; use --runner server")
    if adapters.mmproj:  # a bad file, or one of another width than the model: one line now, not a failed trial
        from fitter.bundled import resolve_model
        from fitter.mtmd.memory import check_mmproj_models

        check_mmproj_models(adapters.mmproj, backend_of(budget.backend), [resolve_model(m) for m in models])
    llama_build = llama_build_of(build.llama_build, build.llama_server if build.llama_build == "auto" else None)
    if trials is not None and trials < 1:
        raise ConfigError(f"--trials {trials}: use 1 or more")
    if seed is not None and not 0 <= seed < 2**32:
        raise ConfigError(f"--seed {seed}: use a number from 0 to {2**32 - 1}")
    p = placement
    if _engine_study(engine, models, {
            "--study": study != "prefill", "--draft": bool(drafts), "--storage": bool(storage),
            "--runner": runner != RunnerName.python, "--backend": bool(budget.backend), "--no-compare": no_compare,
            "--llama-build": bool(build.llama_build), "-ngl": p.n_gpu_layers != -1, "--n-cpu-moe": bool(p.n_cpu_moe),
            "--cpu-moe": p.cpu_moe, "-ot": bool(p.override_tensor), "--no-kv-offload": p.no_kv_offload,
            "--no-op-offload": no_op_offload, "--rpc": bool(rpc)}):
        compare_engines_run(models[0], models[1], budget=budget.budget, margin=budget.margin, trials=trials,
                            prompt_tokens=64, gen_tokens=16, llama_server=build.llama_server, seed=seed, as_json=False)
        return
    be, fixed, budgets = _rpc_study(rpc, runner, budget, rpc_kinds)
    study_def = _study_with(study, {**_fixed_flags(p, no_op_offload, adapters), **fixed})
    _run_study(models, study_def, budget, storage=storage, trials=trials, runner=runner.value, drafts=drafts, seed=seed,
               no_compare=no_compare, llama_server=build.llama_server, llama_build=llama_build, speed_cut=speed_cut,
               backend=be, rpc_budgets=budgets)


def _rpc_study(rpc: Optional[str], runner: RunnerName, budget: BudgetOptions,
               rpc_kinds: Optional[str] = None) -> tuple[Any, dict[str, Any], Any]:
    """optimise --rpc: the backend with the RPC devices (rpc, or rpc-cuda beside a local GPU), the [fixed] flags
    every trial shares (--rpc and each server's backend) and the budgets as `fit` takes them (one for every device,
    one per device in llama.cpp's order, or auto; each less its own margin: fitter.fit.request.Budgets). -ts is
    each trial's own: the split ggfit proposes at its context (search.study.objective.Predictor.placed)."""
    be = backend_of(budget.backend)
    if not rpc:
        return be, {}, None
    from cli_rpc import rpc_backend, rpc_backends, rpc_budgets
    from fitter.fit.request import Budgets
    from fitter.llama.flags import ConfigError

    if runner != RunnerName.server:  # llama-cpp-python's loader registers no RPC device
        raise ConfigError(f"--rpc {rpc}: the {runner.value} runner loads no RPC devices; use --runner server")
    be = rpc_backend(rpc, be)
    kinds = rpc_backends(rpc, budget.budget, rpc_kinds)
    budgets = Budgets.parse(budget.budget, budget.margin, be, devices=rpc_budgets(rpc, budget.budget, be),
                            remote=kinds)
    return be, {"rpc": rpc, **({"rpc_backends": kinds} if kinds else {})}, budgets


def _fixed_flags(p: PlacementOptions, no_op_offload: bool, a: AdapterOptions) -> dict[str, Any]:
    """The placement flags every trial shares: the study's [fixed] settings (the study file's [space] may search
    n_cpu_moe / n_gpu_layers instead); those left at llama.cpp's defaults are left out."""
    return {k: v for k, v, dflt in (("n_gpu_layers", p.n_gpu_layers, -1), ("n_cpu_moe", p.n_cpu_moe, 0),
                                    ("cpu_moe", p.cpu_moe, False), ("override_tensor", tuple(p.override_tensor or ()), ()),
                                    ("no_kv_offload", p.no_kv_offload, False), ("no_op_offload", no_op_offload, False),
                                    ("lora", lora_fields(a.lora, a.lora_scaled), ()), ("mmproj", a.mmproj, None),
                                    ("no_mmproj_offload", a.no_mmproj_offload, False))
            if v != dflt}


def _study_with(study: str, given: dict[str, Any]) -> Any:
    """The study (a name or a .toml path), with the flags given added to its [fixed] settings."""
    if not given:
        return study
    from search.study.define import StudyDef, load_study

    run_config(**given)  # one line for a value llama.cpp refuses
    d = load_study(study)
    return StudyDef(**{**d.model_dump(), "fixed": {**d.fixed, **given}})


def _run_study(models: list[str], study_def: Any, budget: BudgetOptions, *, storage: Optional[str],
               trials: Optional[int], runner: Literal["python", "server"], drafts: Optional[list[str]],
               seed: Optional[int], no_compare: bool, llama_server: Optional[str], llama_build: Any, speed_cut: Optional[float],
               backend: Any = None, rpc_budgets: Any = None) -> None:
    from fitter.bundled import resolve_model
    from fitter.progress import Progress
    from search.study import NothingFits, run_study  # optuna: only for this command
    from search.study.prior import study_hardware

    try:
        # each trial's outcome as a lasting line, the probe in flight on the live line, both on stderr
        with Progress("optimise") as live:
            b = rpc_budgets  # --rpc: the first device's budget and margin, and what each device may hold
            result = run_study([resolve_model(m) for m in models], study_def,
                               budget=b.main if b else budget.budget, margin=b.main.bytes - b.available if b else budget.margin,
                               per_device=b.avail if b and b.per_device else None,
                               backend=(backend or backend_of(budget.backend)).value, storage=storage,
                               n_trials=trials, runner=runner, drafts=drafts or (), llama_server=llama_server,
                               seed=seed, compare_defaults=not no_compare,
                               progress=lambda line: print(line, file=sys.stderr, flush=True), live=live,
                               llama_build=llama_build, hardware=study_hardware(), speed_cut=speed_cut)
    except NothingFits as e:  # does not fit: exit 1, as fit says it
        print(f"ggfit: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    print(result.text())


def _engine_study(engine: str | None, models: list[str], given: dict[str, bool]) -> bool:
    """optimise --engine: False for llama.cpp alone; True for llama,mlx (the engine study) once its two models are
    there and no llama.cpp-only flag (`given`: flag -> set) is."""
    from fitter.llama.flags import ConfigError

    engines = {e.strip() for e in (engine or "llama").split(",")}
    if not engines <= {"llama", "mlx"}:
        raise ConfigError(f"--engine {engine}: use llama, or llama,mlx (engine searched as a parameter)")
    if engines == {"mlx"}:
        raise ConfigError("--engine mlx: optimise searches MLX beside llama.cpp (--engine llama,mlx MODEL.gguf "
                          "MLX_DIR); fit --engine mlx sizes an MLX model alone")
    if "mlx" not in engines:
        return False
    if len(models) != 2:
        raise ConfigError(f"--engine {engine}: give a GGUF and the same model's MLX directory "
                          f"({len(models)} model{'s' if len(models) != 1 else ''} given)")
    unused = [flag for flag, on in given.items() if on]
    if unused:
        verb = "does" if len(unused) == 1 else "do"
        raise ConfigError(f"--engine {engine}: {', '.join(unused)} {verb} not apply to the engine study "
                          "(its trials search -ub for llama.cpp, --prefill-step-size and --kv-bits for MLX)")
    return True


def compare_engines_run(gguf: str, mlx_model: str, *, budget: str, margin: str | None, trials: int | None,
                     prompt_tokens: int, gen_tokens: int, llama_server: str | None, seed: int | None,
                     as_json: bool) -> None:
    """compare-engines, and optimise --engine llama,mlx: the engine study; exit 1 when no engine ran."""
    from fitter.llama.flags import ConfigError
    from fitter.mlx import require_mlx_lm

    require_mlx_lm()
    trials = 8 if trials is None else trials
    if trials < 2:
        raise ConfigError(f"--trials {trials}: use 2 or more (each engine's defaults come first)")
    from fitter.bundled import resolve_model
    from fitter.fit.budget import available_bytes, parse_budget, parse_margin
    from search.study.engines import compare_engines  # optuna: only for this command

    backend = detect_backend()
    bud = parse_budget(budget, backend)
    available = available_bytes(bud, parse_margin(margin, backend))
    r = compare_engines(resolve_model(gguf), mlx_model, available_bytes=available, n_trials=trials,
                        prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, seed=seed or 0, llama_server=llama_server)
    print(r.model_dump_json(indent=2) if as_json else r.text())
    raise typer.Exit(0 if r.winner else 1)
