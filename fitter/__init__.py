"""ggfit's fitter: GGUF header reader, model description, memory model, budget and solver.

Never imports `search` (search depends on fitter, not the reverse). `search` and `cli.py` import only the
names in `__all__` (`from fitter import predict, RunConfig`). They load on first use (PEP 562), so that
`python -m fitter...` children and `ggfit --help` do not pay for pydantic and the whole model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # errors, build, bundled models, progress
    "GGFitError": "fitter.errors",
    "LLAMA_CPP_COMMIT": "fitter.llama_builds",
    "PINNED_COMMIT": "fitter.llama_builds",
    "PINNED_LLAMA_CPP_PYTHON": "fitter.llama_builds",
    "build_label": "fitter.llama_builds",
    "LlamaBuild": "fitter.llama_builds",
    "PINNED": "fitter.llama_builds",
    "resolve_build": "fitter.llama_builds",
    "build_from_text": "fitter.llama_builds.identify",
    "build_of_binary": "fitter.llama_builds.identify",
    "resolve_model": "fitter.bundled",
    "Progress": "fitter.progress",
    "Record": "fitter.record",
    # GGUF and the model
    "read_header": "fitter.gguf.reader",
    "load_model_spec": "fitter.llama.model",
    "LayerKind": "fitter.llama.hparams",
    # run configuration (llama.cpp's context params)
    "Backend": "fitter.ggml.backends.base",
    "Frontend": "fitter.llama.cparams",
    "RunConfig": "fitter.llama.cparams",
    "ConfigError": "fitter.llama.cparams",
    "resolve_context": "fitter.llama.cparams",
    "KV_CACHE_TYPES": "fitter.llama.cparams",
    "SERVER_FLAGS": "fitter.llama.cparams",
    "ServerArgs": "fitter.llama.cparams",
    "served_config": "fitter.llama.cparams",
    # the prediction, solver, budget, quants
    "predict": "fitter.fit.memory",
    "repack_applies": "fitter.fit.memory",
    "predict_once": "fitter.llama.traced_graph",
    "build_differences": "fitter.fit.memory",
    "solve": "fitter.fit.solver",
    "recommend": "fitter.fit.solver",
    "prediction_for": "fitter.fit.solver",
    "largest_context": "fitter.fit.solver",
    "Alternative": "fitter.fit.solver",
    "what_to_change": "fitter.fit.solver",
    "table_ubatches": "fitter.fit.solver",
    "DEFAULT_N_BATCH": "fitter.llama.cparams",
    "MiB": "fitter.fit.budget",
    "Budget": "fitter.fit.budget",
    "available_bytes": "fitter.fit.budget",
    "parse_budget": "fitter.fit.budget",
    "parse_margin": "fitter.fit.budget",
    "margin_note": "fitter.fit.margin",
    "default_margin": "fitter.fit.margin",
    "default_host_margin": "fitter.fit.margin",
    "host_margin_note": "fitter.fit.margin",
    "parse_size": "fitter.fit.budget",
    "BEST_RULE": "fitter.fit.quant_fit",
    "THIS_FILE": "fitter.fit.quant_fit",
    "best_fit": "fitter.fit.quant_fit",
    "evaluate": "fitter.fit.quant_fit",
    "why_none_fits": "fitter.fit.quant_fit",
    "calibration": "fitter.fit.calibration",  # the module itself (the store: load, save, stored, clear)
    "calibrate": "fitter.oracle.calibrate",
    "compare_log": "fitter.oracle.calibrate",  # calibrate --log: a user's log next to the prediction
    "record_log": "fitter.oracle.calibrate",
    "read_user_log": "fitter.oracle.user_log",
    "log_summary": "fitter.oracle.user_log",
    # llama.cpp's own run (the oracle): child processes, log parser, check
    "dry_run_check": "fitter.oracle.check",
    "fit_params_binary": "fitter.oracle.fit_params",
    "fit_params_check": "fitter.oracle.fit_params",
    "fit_params_check_config": "fitter.oracle.fit_params",
    "FIT_PARAMS_FRONTEND": "fitter.oracle.fit_params",
    "parse_log": "fitter.oracle.llama_log",
    # MLX (mlx-lm): its own model, cache and prediction; the same Buffer rows
    "load_mlx_model": "fitter.mlx.config",
    "MlxCacheSettings": "fitter.mlx.cache",
    "MlxRun": "fitter.mlx.memory",
    "predict_mlx": "fitter.mlx.memory",
    "largest_context_mlx": "fitter.mlx.memory",
    "mlx_label": "fitter.mlx",
    "require_mlx_lm": "fitter.mlx",
    "FLASH_ATTN": "fitter.oracle.llama_run",
    "SPLIT_MODES": "fitter.oracle.llama_run",
    "GGML_TYPES": "fitter.ggml.types",
    "BuildReport": "fitter.oracle.llama_run",
    "REPO_ROOT": "fitter.oracle.child_process",
    "check_model_path": "fitter.oracle.child_process",
    "child_env": "fitter.oracle.child_process",
    "child_event": "fitter.oracle.child_process",
    "child_events": "fitter.oracle.child_process",
    "child_preexec": "fitter.oracle.child_process",
    "kill_group": "fitter.oracle.child_process",
    "short_abort": "fitter.oracle.child_process",
    "signal_name": "fitter.oracle.child_process",
    "sigterm_cleanup": "fitter.oracle.child_process",
    "signals_held": "fitter.oracle.child_process",
    "watchdog_for": "fitter.oracle.child_process",
    # the child's helpers (standard library and llama_cpp only), shared with search's probe child
    "GGML_LOG_DEBUG": "fitter.oracle._llama_child",
    "GGML_LOG_INFO": "fitter.oracle._llama_child",
    "ChildLog": "fitter.oracle._llama_child",
    "apply_fields": "fitter.oracle._llama_child",
    "build_info": "fitter.oracle._llama_child",
    "emit_event": "fitter.oracle._llama_child",
    "load_ggml_base": "fitter.oracle._llama_child",
    "lib_type_name": "fitter.oracle._llama_child",
    "apply_placement": "fitter.oracle._llama_child",
    # placement: where weights go (-ngl, -ot, --n-cpu-moe), host memory, and the solver over placements
    "parse_budgets": "fitter.fit.budget",
    "parse_host_budget": "fitter.fit.budget",
    "solve_placement": "fitter.fit.solver",
    "excess": "fitter.fit.solver",
    "PlacementChoice": "fitter.fit.solver",
    # --mmproj: a multimodal projector's buffers (fitter.mtmd)
    "mmproj_buffers_of_file": "fitter.mtmd.memory",
    "check_mmproj_models": "fitter.mtmd.memory",
}
_MODULE_EXPORTS = {"calibration"}  # names that are modules, not attributes of theirs

__all__ = [  # the same names as _EXPORTS (tests/test_public_api.py checks)
    "mmproj_buffers_of_file", "check_mmproj_models",
    "Alternative", "BEST_RULE", "THIS_FILE", "PlacementChoice", "apply_placement", "parse_budgets", "parse_host_budget",
    "solve_placement", "excess", "SPLIT_MODES", "Backend", "Budget", "ChildLog", "ConfigError", "FIT_PARAMS_FRONTEND", "FLASH_ATTN", "Frontend",
    "GGFitError", "GGML_LOG_DEBUG", "GGML_LOG_INFO", "GGML_TYPES", "KV_CACHE_TYPES", "LLAMA_CPP_COMMIT", "LayerKind",
    "BuildReport", "LlamaBuild", "MiB", "PINNED", "PINNED_COMMIT", "PINNED_LLAMA_CPP_PYTHON", "Progress", "REPO_ROOT", "Record", "RunConfig",
    "SERVER_FLAGS", "ServerArgs", "apply_fields", "available_bytes", "best_fit", "build_differences", "build_from_text", "build_info", "build_label", "build_of_binary",
    "calibrate", "calibration", "check_model_path", "compare_log", "log_summary", "read_user_log", "record_log", "child_env", "child_event", "child_events", "child_preexec",
    "kill_group",
    "dry_run_check", "emit_event", "evaluate", "fit_params_binary", "fit_params_check", "fit_params_check_config", "largest_context", "lib_type_name", "load_ggml_base",
    "load_model_spec", "margin_note", "default_margin", "default_host_margin", "host_margin_note", "parse_budget", "parse_log", "parse_margin", "parse_size", "predict", "predict_once", "repack_applies", "prediction_for",
    "read_header", "recommend", "resolve_build", "resolve_context", "resolve_model", "served_config", "short_abort", "signal_name",
    "signals_held", "sigterm_cleanup", "solve", "watchdog_for", "what_to_change", "why_none_fits",
    "table_ubatches", "DEFAULT_N_BATCH",
    "MlxCacheSettings", "MlxRun", "largest_context_mlx", "load_mlx_model", "mlx_label", "predict_mlx", "require_mlx_lm",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fitter' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if name in _MODULE_EXPORTS else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the same names, for type checkers
    from fitter.bundled import resolve_model
    from fitter.errors import GGFitError
    from fitter.fit import calibration
    from fitter.fit.budget import (
        Budget,
        MiB,
        available_bytes,
        parse_budget,
        parse_budgets,
        parse_host_budget,
        parse_margin,
        parse_size,
    )
    from fitter.fit.margin import default_host_margin, default_margin, host_margin_note, margin_note
    from fitter.fit.memory import build_differences, predict, repack_applies
    from fitter.fit.quant_fit import BEST_RULE, THIS_FILE, best_fit, evaluate, why_none_fits
    from fitter.fit.solver import (
        Alternative,
        PlacementChoice,
        excess,
        largest_context,
        prediction_for,
        recommend,
        solve,
        solve_placement,
        table_ubatches,
        what_to_change,
    )
    from fitter.ggml.types import GGML_TYPES
    from fitter.gguf.reader import read_header
    from fitter.llama.cparams import (
        DEFAULT_N_BATCH,
        KV_CACHE_TYPES,
        SERVER_FLAGS,
        Backend,
        ConfigError,
        Frontend,
        RunConfig,
        ServerArgs,
        resolve_context,
        served_config,
    )
    from fitter.llama.hparams import LayerKind
    from fitter.llama.model import load_model_spec
    from fitter.llama.traced_graph import predict_once
    from fitter.llama_builds import (
        LLAMA_CPP_COMMIT,
        PINNED,
        PINNED_COMMIT,
        PINNED_LLAMA_CPP_PYTHON,
        LlamaBuild,
        build_label,
        resolve_build,
    )
    from fitter.llama_builds.identify import build_from_text, build_of_binary
    from fitter.mlx import mlx_label, require_mlx_lm
    from fitter.mlx.cache import CacheSettings as MlxCacheSettings
    from fitter.mlx.config import load_mlx_model
    from fitter.mlx.memory import MlxRun, largest_context_mlx, predict_mlx
    from fitter.mtmd.memory import check_mmproj_models, mmproj_buffers_of_file
    from fitter.oracle._llama_child import (
        GGML_LOG_DEBUG,
        GGML_LOG_INFO,
        ChildLog,
        apply_fields,
        apply_placement,
        build_info,
        emit_event,
        lib_type_name,
        load_ggml_base,
    )
    from fitter.oracle.calibrate import calibrate, compare_log, record_log
    from fitter.oracle.check import dry_run_check
    from fitter.oracle.child_process import (
        REPO_ROOT,
        check_model_path,
        child_env,
        child_event,
        child_events,
        child_preexec,
        kill_group,
        short_abort,
        signal_name,
        signals_held,
        sigterm_cleanup,
        watchdog_for,
    )
    from fitter.oracle.fit_params import (
        FIT_PARAMS_FRONTEND,
        fit_params_binary,
        fit_params_check,
        fit_params_check_config,
    )
    from fitter.oracle.llama_log import parse_log
    from fitter.oracle.llama_run import (
        FLASH_ATTN,
        SPLIT_MODES,
        BuildReport,
    )
    from fitter.oracle.user_log import log_summary, read_user_log
    from fitter.progress import Progress
    from fitter.record import Record
