"""ggfit's fitter: GGUF header reader, model description, memory model, budget and solver.

Never imports `search` (search depends on fitter, not the reverse). `search` and `cli.py` import only the
names in `__all__` (`from fitter import predict, RunConfig`). They load on first use (PEP 562), so that
`python -m fitter...` children and `ggfit --help` do not pay for pydantic and the whole model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> (module, attribute in it; None: the module itself)
_EXPORTS: dict[str, tuple[str, str | None]] = {
    # errors, build, bundled models, progress
    "GGFitError": ("fitter.errors", "GGFitError"),
    "LLAMA_CPP_COMMIT": ("fitter.build", "LLAMA_CPP_COMMIT"),
    "PINNED_COMMIT": ("fitter.build", "PINNED_COMMIT"),
    "PINNED_LLAMA_CPP_PYTHON": ("fitter.build", "PINNED_LLAMA_CPP_PYTHON"),
    "build_label": ("fitter.build", "build_label"),
    "resolve_model": ("fitter.bundled", "resolve_model"),
    "Progress": ("fitter.progress", "Progress"),
    # GGUF and the model
    "read_header": ("fitter.gguf.reader", "read_header"),
    "load_model_spec": ("fitter.llama.model", "load_model_spec"),
    "LayerKind": ("fitter.llama.hparams", "LayerKind"),
    # run configuration (llama.cpp's context params)
    "Backend": ("fitter.llama.cparams", "Backend"),
    "Frontend": ("fitter.llama.cparams", "Frontend"),
    "RunConfig": ("fitter.llama.cparams", "RunConfig"),
    "ConfigError": ("fitter.llama.cparams", "ConfigError"),
    "config_error": ("fitter.llama.cparams", "config_error"),
    "resolve_context": ("fitter.llama.cparams", "resolve_context"),
    "KV_CACHE_TYPES": ("fitter.llama.cparams", "KV_CACHE_TYPES"),
    "SERVER_FLAGS": ("fitter.llama.cparams", "SERVER_FLAGS"),
    "ServerArgs": ("fitter.llama.cparams", "ServerArgs"),
    "served_config": ("fitter.llama.cparams", "served_config"),
    # the prediction, solver, budget, quants
    "predict": ("fitter.fit.memory", "predict"),
    "solve": ("fitter.fit.solver", "solve"),
    "recommend": ("fitter.fit.solver", "recommend"),
    "prediction_for": ("fitter.fit.solver", "prediction_for"),
    "largest_context": ("fitter.fit.solver", "largest_context"),
    "Alternative": ("fitter.fit.solver", "Alternative"),
    "what_to_change": ("fitter.fit.solver", "what_to_change"),
    "MiB": ("fitter.fit.budget", "MiB"),
    "Budget": ("fitter.fit.budget", "Budget"),
    "available_bytes": ("fitter.fit.budget", "available_bytes"),
    "parse_budget": ("fitter.fit.budget", "parse_budget"),
    "parse_margin": ("fitter.fit.budget", "parse_margin"),
    "parse_size": ("fitter.fit.budget", "parse_size"),
    "BEST_RULE": ("fitter.fit.quant_fit", "BEST_RULE"),
    "best_fit": ("fitter.fit.quant_fit", "best_fit"),
    "evaluate": ("fitter.fit.quant_fit", "evaluate"),
    "why_none_fits": ("fitter.fit.quant_fit", "why_none_fits"),
    "calibration": ("fitter.fit.calibration", None),
    "calibrate": ("fitter.oracle.calibrate", "calibrate"),
    # llama.cpp's own run (the oracle): child processes, log parser, check
    "dry_run_check": ("fitter.oracle.check", "dry_run_check"),
    "parse_log": ("fitter.oracle.llama_log", "parse_log"),
    "FLASH_ATTN": ("fitter.oracle.llama_run", "FLASH_ATTN"),
    "GGML_TYPES": ("fitter.ggml.types", "GGML_TYPES"),
    "LlamaBuild": ("fitter.oracle.llama_run", "LlamaBuild"),
    "REPO_ROOT": ("fitter.oracle.llama_run", "_REPO_ROOT"),
    "check_model_path": ("fitter.oracle.llama_run", "_check_model_path"),
    "child_env": ("fitter.oracle.llama_run", "_child_env"),
    "child_events": ("fitter.oracle.llama_run", "child_events"),
    "child_preexec": ("fitter.oracle.llama_run", "child_preexec"),
    "short_abort": ("fitter.oracle.llama_run", "_short_abort"),
    "signal_name": ("fitter.oracle.llama_run", "signal_name"),
    "sigterm_cleanup": ("fitter.oracle.llama_run", "sigterm_cleanup"),
    "watchdog_for": ("fitter.oracle.llama_run", "watchdog_for"),
    # the child's helpers (standard library and llama_cpp only), shared with search's probe child
    "GGML_LOG_DEBUG": ("fitter.oracle._llama_child", "_DEBUG"),
    "GGML_LOG_INFO": ("fitter.oracle._llama_child", "_INFO"),
    "ChildLog": ("fitter.oracle._llama_child", "_Log"),
    "apply_fields": ("fitter.oracle._llama_child", "_apply"),
    "build_info": ("fitter.oracle._llama_child", "_build_info"),
    "emit_event": ("fitter.oracle._llama_child", "_emit"),
    "load_ggml_base": ("fitter.oracle._llama_child", "_ggml_base"),
    "lib_type_name": ("fitter.oracle._llama_child", "_ggml_type_name"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'fitter' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the same names, for type checkers
    from fitter.fit import calibration as calibration
    from fitter.oracle.calibrate import calibrate
    from fitter.oracle._llama_child import _DEBUG as GGML_LOG_DEBUG, _INFO as GGML_LOG_INFO, _Log as ChildLog
    from fitter.oracle._llama_child import _apply as apply_fields, _build_info as build_info, _emit as emit_event
    from fitter.oracle._llama_child import _ggml_base as load_ggml_base, _ggml_type_name as lib_type_name
    from fitter.fit.budget import MiB, Budget, available_bytes, parse_budget, parse_margin, parse_size
    from fitter.build import LLAMA_CPP_COMMIT, PINNED_COMMIT, PINNED_LLAMA_CPP_PYTHON, build_label
    from fitter.bundled import resolve_model
    from fitter.oracle.check import dry_run_check
    from fitter.llama.cparams import KV_CACHE_TYPES, SERVER_FLAGS, Backend, ConfigError, Frontend, RunConfig, ServerArgs
    from fitter.llama.cparams import config_error, resolve_context, served_config
    from fitter.errors import GGFitError
    from fitter.gguf.reader import read_header
    from fitter.llama.hparams import LayerKind
    from fitter.llama.model import load_model_spec
    from fitter.oracle.llama_log import parse_log
    from fitter.ggml.types import GGML_TYPES
    from fitter.oracle.llama_run import FLASH_ATTN, LlamaBuild
    from fitter.oracle.llama_run import _REPO_ROOT as REPO_ROOT, _check_model_path as check_model_path
    from fitter.oracle.llama_run import _child_env as child_env, _short_abort as short_abort
    from fitter.oracle.llama_run import child_events, child_preexec, signal_name, sigterm_cleanup, watchdog_for
    from fitter.fit.memory import predict
    from fitter.fit.quant_fit import BEST_RULE, best_fit, evaluate, why_none_fits
    from fitter.fit.solver import Alternative, largest_context, prediction_for, recommend, solve, what_to_change
