"""How ggfit's commands print what they found, apart from `fit`'s and `quants`' plan (cli_fit): `fit --engine mlx`'s
answer, the breakdown table both share, `calibrate`'s tables and a user log's side. cli.py parses the flags and calls
fitter; the text is here."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from cli_fit import mib, print_breakdown  # noqa: F401  (mib: cli_inspect's too)
from cli_options import MlxOptions, detect_backend
from fitter.errors import GGFitError


def print_log_side(ulog, *, rows: bool = True) -> None:
    """What the log says: tool, build, backend, model, settings (and, with rows, every printed buffer)."""
    tool = ulog.tool or "tool not named in the log"
    print(f"log      {ulog.source}: {tool}, backend {', '.join(ulog.backends) or 'not named'}"
          + (f", read the first {ulog.bytes_read:,} bytes" if ulog.truncated else ""))
    if ulog.build:
        number, commit = ulog.build
        print("         build line: " + " ".join(x for x in (f"b{number}" if number else "", f"({commit})" if commit else "") if x))
    m = ulog.model
    named = [x for x in (m.name, m.path, m.arch, m.file_type,
                         f"{m.file_size_mib:,.2f} MiB" if m.file_size_mib else None) if x]
    if named:
        print("         model: " + ", ".join(named))
    s = ulog.settings.model_dump(exclude_none=True)
    if s:
        print("         printed: " + ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in s.items()))
    if rows:
        for kind, buf, n in ulog.buffers():
            print(f"         {kind:<8} {buf:<14} {n / 2**20:>12,.2f} MiB")
        print_log_extras(ulog)


def print_log_extras(ulog) -> None:
    """The memory breakdown table, llama-fit-params' figures and failed allocations, as printed."""
    for b in ulog.breakdown:
        line = f"breakdown {b.name}: model {b.model_mib} + context {b.context_mib} + compute {b.compute_mib} = {b.self_mib} MiB"
        if b.unaccounted_mib is not None:
            line += f"; total {b.total_mib}, free {b.free_mib}, unaccounted {b.unaccounted_mib} MiB"
        print(line)
    if ulog.fit_projected_mib is not None:
        print(f"llama-fit-params projected {ulog.fit_projected_mib:,} MiB of device memory vs {ulog.fit_free_mib:,} MiB free")
    for d in ulog.fit_devices:
        if d.used_mib is not None:
            print(f"llama-fit-params {d.name}: {d.used_mib:,} MiB used")
        else:
            print(f"llama-fit-params {d.name}: model {d.model_mib} context {d.context_mib} compute {d.compute_mib} MiB")
    if ulog.fit_args:
        print(f"llama-fit-params arguments: {ulog.fit_args[:200]}{' ...' if len(ulog.fit_args) > 200 else ''}")
    for a in ulog.alloc_failures:
        print(f"failed allocation: {a.buffer or 'a device buffer'} of {a.bytes:,} bytes ({a.bytes / 2**20:,.2f} MiB)")


def calibration_lines(cal) -> list[str]:
    out = []
    if cal.source == "log":
        out.append("learned from " + ", ".join(p.log for p in cal.logs))
    for name, c in (("device", cal.device), ("host", cal.host)):
        if c:
            out.append(f"{name} compute: measured = {c.a / 2**20:+.3f} MiB + {c.b:.5f} x predicted "
                       f"(worst residual {c.max_abs_error_bytes / 2**20:.3f} MiB over {c.points} points)"
                       + (": identity, the prediction already matches llama.cpp" if c.identity else ""))
    if cal.note:
        out.append(cal.note)
    return out


def calibrate_list(calibration, model: Optional[str], as_json: bool) -> None:
    if model is not None:
        from fitter.llama.flags import ConfigError

        raise ConfigError(f"--list takes no MODEL (got {model})")
    cals, where = calibration.stored(), calibration.store_path()
    if as_json:
        print(json.dumps({"stored": str(where), "calibrations": [dict(c.model_dump(mode="json"), identity=c.identity)
                                                                 for c in cals]}, indent=2))
        return
    if not cals:
        print(f"no calibration stored ({where})")
        return
    for cal in cals:
        print(f"{cal.architecture} on {cal.backend}, llama.cpp {cal.llama_cpp[:12]}"
              + (" (identity: changes nothing)" if cal.identity else ""))
        for line in calibration_lines(cal):
            print(f"  {line}")
    print(f"stored in {where}")


def calibrate_clear(calibration, model: Optional[str], as_json: bool) -> None:

    arch = model
    if model is not None and model not in {c.architecture for c in calibration.stored(warn=False)}:
        from fitter.bundled import resolve_model
        from fitter.llama.model import load_model_spec

        try:  # a model: its architecture
            arch = load_model_spec(resolve_model(model))[1].architecture
        except GGFitError:
            pass  # an architecture with nothing stored
    gone, where = calibration.clear(arch)
    if as_json:
        print(json.dumps({"stored": str(where), "removed": [c.model_dump(mode="json") for c in gone]}, indent=2))
        return
    what = f" for {arch}" if arch else ""
    if not gone:
        print(f"no calibration stored{what} ({where})")
        return
    print(f"removed {len(gone)} calibration{'s' if len(gone) > 1 else ''}{what}: "
          + ", ".join(f"{c.architecture} on {c.backend} (llama.cpp {c.llama_cpp[:12]})" for c in gone) + f" ({where})")


def fit_mlx(model: str, *, budget: str, margin: str | None, n_ctx: int | None, model_draft: str | None,
            options: MlxOptions, draft_n_max: int, as_json: bool, session_requests: int | None = None) -> None:
    """`ggfit fit --engine mlx`: the same table and budget for an MLX model; without -c, the largest -c that fits; and
    mlx_lm.server's memory over a session (its prompt cache: the peak after --session-requests, the limit)."""
    from cli_mlx_session import mlx_session, session_json
    from fitter.fit.budget import available_bytes, parse_budget, parse_margin, parse_size
    from fitter.mlx import mlx_label
    from fitter.mlx.cache import MlxCacheSettings
    from fitter.mlx.config import load_mlx_model
    from fitter.mlx.memory import MlxRun, largest_context_mlx, predict_mlx

    o = options
    bud = parse_budget(budget, detect_backend())
    margin_bytes = parse_margin(margin)
    available = available_bytes(bud, margin_bytes)
    for flag, v in (("--prefill-step-size", o.prefill_step_size), ("--max-tokens", o.max_tokens)):
        if v < 1:
            raise GGFitError(f"{flag} {v}: must be at least 1")
    m = load_mlx_model(model)
    draft = load_mlx_model(model_draft) if model_draft else None
    settings = MlxCacheSettings(max_kv_size=o.max_kv_size, kv_bits=o.kv_bits, kv_group_size=o.kv_group_size,
                                quantized_kv_start=o.quantized_kv_start, prefill_step_size=o.prefill_step_size)
    pc = None  # mlx_lm.server's utils._parse_size: a bare number is bytes
    if o.prompt_cache_bytes:
        pc = (int(o.prompt_cache_bytes) if o.prompt_cache_bytes.strip().isdigit()
              else parse_size(o.prompt_cache_bytes, what="--prompt-cache-bytes"))
    run = MlxRun(n_ctx=n_ctx or 256, max_tokens=o.max_tokens, cache=settings, prompt_cache_bytes=pc,
                 num_draft_tokens=draft_n_max)
    n_max = m.spec.max_position_embeddings or 262144
    if n_ctx is None:
        best, pred = largest_context_mlx(m, run, available, n_max, draft)
        if pred is None:
            pred = predict_mlx(m, run, draft)
    else:
        best, pred = 0, predict_mlx(m, run, draft)
    total = pred.total_device_bytes
    fits = total <= available
    sess = mlx_session(m, pred.run, draft, available, requests=session_requests,
                       prompt_cache_size=o.prompt_cache_size)
    if as_json:
        print(json.dumps({
            "engine": "mlx", "mlx_lm": mlx_label(), "budget_bytes": bud.bytes, "budget_source": bud.source,
            "margin_bytes": margin_bytes, "n_ctx": pred.run.n_ctx, "largest_n_ctx": best if n_ctx is None else None,
            "config": {"max_tokens": o.max_tokens, "max_kv_size": o.max_kv_size, "kv_bits": o.kv_bits,
                       "kv_group_size": o.kv_group_size, "quantized_kv_start": o.quantized_kv_start,
                       "prefill_step_size": o.prefill_step_size, "prompt_cache_bytes": pc},
            "buffers": [b.model_dump(mode="json") for b in pred.buffers], "total_device_bytes": total,
            "fits": fits, "headroom_bytes": available - total, "warnings": pred.warnings,
            "session": session_json(*sess),
        }, indent=2))
    else:
        _print_mlx(model, m, pred, bud, margin_bytes, available, best if n_ctx is None else None, n_max, o, pc,
                   model_draft, draft_n_max, sess)
    if not fits or (session_requests and not sess[2]):
        raise typer.Exit(1)


def _print_mlx(model: str, m: Any, pred: Any, bud: Any, margin_bytes: int, available: int, best: int | None,
               n_max: int, o: MlxOptions, pc: int | None, model_draft: str | None, draft_n_max: int,
               sess: tuple) -> None:
    """fit_mlx's text: the model, the budget, the largest context, the breakdown, the session and the command."""
    from cli_mlx_session import print_session
    from fitter.mlx import mlx_label

    spec = m.spec
    print(f"model    {model} ({spec.model_type}, "
          + (f"{spec.quant_bits}-bit" if spec.quant_bits else spec.act_dtype) + f", {mib(m.file_bytes)} on disk)")
    print(f"engine   mlx, {mlx_label()}")
    print(f"budget   {mib(bud.bytes)} ({bud.source}), margin {mib(margin_bytes)} -> {mib(available)} available")
    if best is not None:
        print(f"\nlargest context: -c {best} (prompt + --max-tokens {o.max_tokens}; the model's limit {n_max:,})"
              if best else "\nnothing fits, not even -c 256")
    print()
    print_breakdown(pred, available)
    for w in pred.warnings:
        print("warning: " + w)
    print_session(sess[0], sess[1], available)
    if pred.total_device_bytes <= available:
        flags = [f"--model {model}", f"--prefill-step-size {o.prefill_step_size}", f"--max-tokens {o.max_tokens}"]
        flags += [f"--kv-bits {o.kv_bits}", f"--kv-group-size {o.kv_group_size}"] if o.kv_bits else []
        flags += [f"--prompt-cache-bytes {pc}"] if pc is not None else []
        flags += [f"--prompt-cache-size {o.prompt_cache_size}"] if o.prompt_cache_size != 10 else []
        flags += [f"--draft-model {model_draft}", f"--num-draft-tokens {draft_n_max}"] if model_draft else []
        print("\nmlx_lm.server \\\n  " + " \\\n  ".join(flags))
