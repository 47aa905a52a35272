"""`ggfit calibrate`'s work past its flags: the dry-run grid on this machine, and a user log's buffers beside the
prediction for its build (--log). cli.py checks the flags; the text and JSON are here."""

from __future__ import annotations

import json
from typing import Any, Optional

from cli_options import BackendName, backend_of
from cli_output import calibration_lines, print_log_extras, print_log_side
from fitter.errors import GGFitError


def calibrate_grid(model: str, backend: BackendName | None, as_json: bool) -> None:
    """llama.cpp's dry runs over a small grid here, and the compute corrections stored for this build and backend."""
    from fitter.bundled import resolve_model
    from fitter.fit import calibration
    from fitter.oracle.calibrate import calibrate
    from fitter.progress import Progress

    be = backend_of(backend)
    path = resolve_model(model)
    calibration.check_store()  # before the dry runs, not a traceback after them
    with Progress("calibrate", json_output=as_json) as progress:
        cal, rows = calibrate(path, be, progress=progress)
    where = calibration.save(cal)
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



def calibrate_log(path: str, model: Optional[str], backend: BackendName | None, llama_build: Optional[str],
                   no_store: bool, as_json: bool) -> None:
    """`ggfit calibrate --log FILE [MODEL]`: the log's buffers next to the prediction for its build and settings."""
    from fitter.bundled import resolve_model
    from fitter.fit import calibration
    from fitter.ggml.backends.base import Backend
    from fitter.oracle.calibrate import compare_log, record_log
    from fitter.oracle.user_log import read_user_log

    ulog = read_user_log(path)
    if not no_store:
        calibration.check_store()
    be = Backend(backend.value) if backend else None
    try:
        cmp = compare_log(ulog, resolve_model(model) if model else None, backend=be,
                          llama_build=llama_build)
    except GGFitError:
        if not as_json:  # what the log says, then why ggfit cannot predict it (one line on stderr)
            print_log_side(ulog)
        raise
    stored = None
    if cmp.prediction is not None and not no_store:
        try:
            stored = record_log(cmp)
        except GGFitError as e:
            cmp.notes.append(str(e))
    if as_json:
        print(json.dumps(_log_json(ulog, cmp, stored), indent=2))
        return
    _print_log(ulog, cmp, stored)


def _log_json(ulog: Any, cmp: Any, stored: Any) -> dict[str, Any]:
    from fitter.oracle.user_log import log_summary

    return {"log": log_summary(ulog), "build": cmp.build.label() if cmp.build else None,
               "backend": cmp.backend.value if cmp.backend else None, "model": cmp.model,
               "architecture": cmp.architecture, "frontend": cmp.frontend.value if cmp.frontend else None,
               "config": cmp.config.model_dump(mode="json") if cmp.config else None, "assumed": cmp.assumed,
               "rows": [dict(r.model_dump(mode="json"), diff_bytes=r.diff_bytes) for r in cmp.rows],
               "notes": cmp.notes, "missing": cmp.missing,
               "stored": {"calibration": stored[0].model_dump(mode="json"), "path": str(stored[1])} if stored else None}


def _print_log(ulog: Any, cmp: Any, stored: Any) -> None:
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
        from fitter.llama_builds import LLAMA_CPP_COMMIT

        flag = cal.llama_cpp if not cal.llama_cpp.startswith(LLAMA_CPP_COMMIT[:12]) else "pinned"
        print(f"later predictions for llama.cpp {cal.llama_cpp[:12]} on {cal.backend} use it "
              f"(ggfit fit ... --llama-build {flag} --backend {cal.backend})")
