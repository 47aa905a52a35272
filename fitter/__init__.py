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
    "PINNED_COMMIT": ("fitter.llama_run", "PINNED_COMMIT"),
    "PINNED_LLAMA_CPP_PYTHON": ("fitter.llama_run", "PINNED_LLAMA_CPP_PYTHON"),
    "build_label": ("fitter.build", "build_label"),
    "resolve_model": ("fitter.bundled", "resolve_model"),
    "Progress": ("fitter.progress", "Progress"),
    # GGUF and the model
    "read_header": ("fitter.gguf.reader", "read_header"),
    "load_model_spec": ("fitter.llama.model", "load_model_spec"),
    "LayerKind": ("fitter.llama.hparams", "LayerKind"),
    # run configuration (llama.cpp's context params)
    "Backend": ("fitter.config", "Backend"),
    "Frontend": ("fitter.config", "Frontend"),
    "RunConfig": ("fitter.config", "RunConfig"),
    "ConfigError": ("fitter.config", "ConfigError"),
    "config_error": ("fitter.config", "config_error"),
    "resolve_context": ("fitter.config", "resolve_context"),
    "KV_CACHE_TYPES": ("fitter.config", "KV_CACHE_TYPES"),
    # the prediction, solver, budget, quants
    "predict": ("fitter.memory", "predict"),
    "solve": ("fitter.solver", "solve"),
    "recommend": ("fitter.solver", "recommend"),
    "prediction_for": ("fitter.solver", "prediction_for"),
    "largest_context": ("fitter.solver", "largest_context"),
    "MiB": ("fitter.budget", "MiB"),
    "Budget": ("fitter.budget", "Budget"),
    "available_bytes": ("fitter.budget", "available_bytes"),
    "parse_budget": ("fitter.budget", "parse_budget"),
    "parse_margin": ("fitter.budget", "parse_margin"),
    "parse_size": ("fitter.budget", "parse_size"),
    "BEST_RULE": ("fitter.quant_fit", "BEST_RULE"),
    "best_fit": ("fitter.quant_fit", "best_fit"),
    "evaluate": ("fitter.quant_fit", "evaluate"),
    "why_none_fits": ("fitter.quant_fit", "why_none_fits"),
    "calibration": ("fitter.calibration", None),
    # llama.cpp's own run (the oracle): child processes, log parser, check
    "dry_run_check": ("fitter.check", "dry_run_check"),
    "parse_log": ("fitter.llama_log", "parse_log"),
    "FLASH_ATTN": ("fitter.llama_run", "FLASH_ATTN"),
    "GGML_TYPES": ("fitter.llama_run", "GGML_TYPES"),
    "LlamaBuild": ("fitter.llama_run", "LlamaBuild"),
    "REPO_ROOT": ("fitter.llama_run", "_REPO_ROOT"),
    "check_model_path": ("fitter.llama_run", "_check_model_path"),
    "child_env": ("fitter.llama_run", "_child_env"),
    "child_events": ("fitter.llama_run", "child_events"),
    "child_preexec": ("fitter.llama_run", "child_preexec"),
    "short_abort": ("fitter.llama_run", "_short_abort"),
    "signal_name": ("fitter.llama_run", "signal_name"),
    "sigterm_cleanup": ("fitter.llama_run", "sigterm_cleanup"),
    "watchdog_for": ("fitter.llama_run", "watchdog_for"),
    # the child's helpers (standard library and llama_cpp only), shared with search's probe child
    "GGML_LOG_DEBUG": ("fitter._llama_child", "_DEBUG"),
    "GGML_LOG_INFO": ("fitter._llama_child", "_INFO"),
    "ChildLog": ("fitter._llama_child", "_Log"),
    "apply_fields": ("fitter._llama_child", "_apply"),
    "build_info": ("fitter._llama_child", "_build_info"),
    "emit_event": ("fitter._llama_child", "_emit"),
    "load_ggml_base": ("fitter._llama_child", "_ggml_base"),
    "lib_type_name": ("fitter._llama_child", "_ggml_type_name"),
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
    from fitter import calibration as calibration
    from fitter._llama_child import _DEBUG as GGML_LOG_DEBUG, _INFO as GGML_LOG_INFO, _Log as ChildLog
    from fitter._llama_child import _apply as apply_fields, _build_info as build_info, _emit as emit_event
    from fitter._llama_child import _ggml_base as load_ggml_base, _ggml_type_name as lib_type_name
    from fitter.budget import MiB, Budget, available_bytes, parse_budget, parse_margin, parse_size
    from fitter.build import LLAMA_CPP_COMMIT, build_label
    from fitter.bundled import resolve_model
    from fitter.check import dry_run_check
    from fitter.config import KV_CACHE_TYPES, Backend, ConfigError, Frontend, RunConfig, config_error, resolve_context
    from fitter.errors import GGFitError
    from fitter.gguf.reader import read_header
    from fitter.llama.hparams import LayerKind
    from fitter.llama.model import load_model_spec
    from fitter.llama_log import parse_log
    from fitter.llama_run import FLASH_ATTN, GGML_TYPES, PINNED_COMMIT, PINNED_LLAMA_CPP_PYTHON, LlamaBuild
    from fitter.llama_run import _REPO_ROOT as REPO_ROOT, _check_model_path as check_model_path
    from fitter.llama_run import _child_env as child_env, _short_abort as short_abort
    from fitter.llama_run import child_events, child_preexec, signal_name, sigterm_cleanup, watchdog_for
    from fitter.memory import predict
    from fitter.quant_fit import BEST_RULE, best_fit, evaluate, why_none_fits
    from fitter.solver import largest_context, prediction_for, recommend, solve
