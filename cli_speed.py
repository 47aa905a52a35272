"""The speed model on ggfit's command line (issue 46): how `fit` and `quants` print their rates, and
`calibrate --bench FILE`. The settings (--hardware, --host-bandwidth, -t, --speed-prompt, --speed-depth, --no-speed)
are fitter.speed.settings.Speed; the rates of a fit are its plan's (fitter.fit.plan)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import fitter

if TYPE_CHECKING:
    from fitter.fit.plan import Plan
    from fitter.speed.settings import Speed


def rate(x: float) -> str:
    """A rate to 3 significant figures, with thousands separators (9,090; 277; 43.9)."""
    if x <= 0:
        return "0"
    digits = 2 - int(f"{x:e}".split("e")[1])
    return f"{round(x, digits):,.{max(digits, 0)}f}"


def candidate_json(speed: Speed, c: Any) -> dict[str, Any]:
    """A quants candidate as JSON, with its rates (None where it does not fit or none can be said)."""
    pre, dec = speed.rated.get(c.name, (None, None))
    return {**c.model_dump(mode="json"), "prefill_tps": pre, "decode_tps": dec}


def settings_json(speed: Speed) -> dict[str, Any] | None:
    """What quants' rates are (its JSON's "speed"), or None with --no-speed."""
    if not speed.on or speed.profile is None:
        return None
    return {"hardware": speed.profile.name, "prompt_tokens": speed.prompt, "depth": speed.depth,
            "threads": speed.threads, "calibrated": speed.calibrated or None, "notes": speed.notes,
            "note": speed.note or None}


def speed_line(res: Any, label: str = "speed") -> str:
    """`speed (nvidia-h200, llama-bench pp512 / tg at depth 0, -ub 512): prefill 9,090 tok/s (6,490-12,700), ..."""
    sp, notes = res
    b = sp.bound
    bound = (f"both bound by {b['prefill']}" if b["prefill"] == b["decode"]
             else f"prefill bound by {b['prefill']}, decode by {b['decode']}")
    extra = [sp.calibrated] if sp.calibrated else []
    return (f"{label} ({sp.hardware}, llama-bench pp{sp.prompt_tokens} / tg at depth {sp.depth}, -ub {sp.n_ubatch}): "
            f"prefill {rate(sp.prefill_tps)} tok/s ({rate(sp.low.prefill_tps)}-{rate(sp.high.prefill_tps)}), "
            f"decode {rate(sp.decode_tps)} tok/s ({rate(sp.low.decode_tps)}-{rate(sp.high.decode_tps)}); {bound}"
            + "".join(f"; {x}" for x in extra) + "".join(f" ({n})" for n in notes))


def print_speed(r: Plan, placed: bool = False) -> None:
    """fit's line: the rates of the config as printed (placed: of ggfit's placement), or why there are none."""
    res = r.placed_rates if placed else r.rates
    if res is not None:
        print(speed_line(res, "speed with this placement" if placed else "speed"))
    elif r.speed is not None and r.speed.note and not placed:
        print(r.speed.note)


def print_fastest(r: Plan, shown: int = 5) -> None:
    """The ranking behind fit-for-speed's choice: what each placement that fits costs against the fastest."""
    opts = r.speed_options
    if not opts:
        return
    sp = opts[0].speed
    print(f"fastest placement that fits ({sp.hardware}, one request: pp{sp.prompt_tokens} then tg128 at depth "
          f"{sp.depth}), of {len(opts)}:")
    for o in opts[:shown]:
        print("  " + o.line(opts[0]))


def fastest_json(r: Plan) -> list[dict[str, Any]] | None:
    opts = r.speed_options
    if not opts:
        return None
    return [{"flags": o.flags, "update": o.update, "headroom_bytes": o.headroom_bytes, "seconds": o.seconds,
             "prefill_tps": o.speed.prefill_tps, "decode_tps": o.speed.decode_tps} for o in opts]


def speed_json(res: Any) -> dict[str, Any] | None:
    if res is None:
        return None
    sp, notes = res
    return {"prefill_tps": sp.prefill_tps, "decode_tps": sp.decode_tps, "prompt_tokens": sp.prompt_tokens,
            "depth": sp.depth, "n_ubatch": sp.n_ubatch, "hardware": sp.hardware,
            "low": sp.low.model_dump(mode="json"), "high": sp.high.model_dump(mode="json"), "bound": dict(sp.bound),
            "calibrated": sp.calibrated or None, "notes": notes}


def print_quants(cands: list, best: Any, speed: Speed) -> None:
    """quants' table: each quant's sizes, and where it fits and rates can be said, its prefill and decode rates."""
    rated = bool(speed.rated)
    head = f"{'prefill t/s':>13}{'decode t/s':>12}" if rated else ""
    print(f"  {'quant':<24}{'file MiB':>11}{'device MiB':>12}{head}{'headroom':>11}{'largest -c':>12}  verdict")
    for c in cands:
        verdict = "fits" if c.fits else f"over by {-c.headroom_bytes / 2**20:,.0f} MiB"
        flag = (" (this file)" if c.source == fitter.THIS_FILE else " (imatrix)" if c.needs_imatrix
                else "" if c.exact else " (size only)")
        mark = "*" if best is not None and c.name == best.name else " "
        rates = ""
        if rated:
            pre, dec = speed.rated.get(c.name, (None, None))
            rates = f"{rate(pre):>13}{rate(dec):>12}" if pre is not None and dec is not None else f"{'-':>13}{'-':>12}"
        print(f"{mark} {c.name + flag:<24}{c.file_bytes / 2**20:>11,.0f}{c.total_device_bytes / 2**20:>12,.0f}"
              f"{rates}{c.headroom_bytes / 2**20:>11,.0f}{c.largest_ctx:>12,}  {verdict}")
    if rated and speed.profile is not None:
        print(f"rates: llama-bench pp{speed.prompt} / tg at depth {speed.depth} on {speed.profile.name}, predicted "
              "(tok/s)" + "".join(f"; {x}" for x in [speed.calibrated, *speed.notes] if x))
    elif speed.note:
        print(speed.note)


# --- calibrate --bench -----------------------------------------------------------------------------------------


def _models_for(rows: list, model: str | None) -> tuple[dict[int, tuple[str, Any, Any]], list[str]]:
    """Each usable row's (file name, header, spec): MODEL when given (the rows whose size and parameter count are
    its), else the row's model_filename where that file is on this machine."""
    out: dict[int, tuple[str, Any, Any]] = {}
    skipped: list[str] = []
    from fitter.speed.calibration import row_matches

    loaded: dict[str, tuple[Any, Any]] = {}

    def load(where: str) -> tuple[Any, Any]:
        if where not in loaded:
            loaded[where] = fitter.load_model_spec(fitter.resolve_model(where))
        return loaded[where]

    given = load(model) if model else None
    for i, row in enumerate(rows):
        if given is not None:
            if row_matches(row, given[1]):
                out[i] = (os.path.basename(fitter.resolve_model(model or "")), *given)
            else:
                skipped.append(f"{row.test} of {row.model_type or row.model_filename or 'another model'}: "
                               "not MODEL (another size or parameter count)")
            continue
        f = row.model_filename
        if f and os.path.isfile(f):
            out[i] = (os.path.basename(f), *load(f))
        else:
            skipped.append(f"{row.test} of {row.model_type or 'a model'}: "
                           + (f"{f} is not on this machine" if f else "the row names no model file")
                           + " (give MODEL)")
    return out, skipped


def _bench_points(rows: list, models: dict[int, tuple[str, Any, Any]], skipped: list[str], speed: Speed) -> list:
    """Each usable llama-bench row as a BenchPoint (measured and predicted rate) with what predicted it; the rows left
    out are added to `skipped`, with why."""
    from fitter.speed import calibration as sc

    hw = speed.profile
    assert hw is not None
    points: list[tuple[Any, Any]] = []
    for i, row in enumerate(rows):
        kind = sc.kind_of(row)
        if kind is None:
            skipped.append(f"{row.test}: prefill and decode in one rate")
            continue
        if i not in models:
            continue
        name, header, spec = models[i]
        be = sc.backend_of_row(row, hw.backend)
        try:
            cfg, n_gpus = sc.config_of_row(row, be)
        except (fitter.GGFitError, ValueError) as e:
            skipped.append(f"{row.test}: {e}")
            continue
        res = speed.predict(header, spec, cfg, be, n_gpus, bench=row)
        if res is None:  # a GPU row on another machine's profile
            skipped.append(f"{row.test} of {row.model_type or name}: ran on {be.value}, which {hw.name} is not "
                           "(--hardware NAME: the machine that ran it)")
            continue
        sp = res[0]
        predicted = sp.prefill_tps if kind == "prefill" else sp.decode_tps
        point = sc.BenchPoint(test=row.test, kind=kind, model=name, measured=row.avg_ts, predicted=predicted,
                              settings=sc.settings_of(row))
        points.append((point, (row, header, spec, cfg, be, n_gpus)))
    return points


def calibrate_bench(path: str, model: str | None, speed: Speed, *, no_store: bool, as_json: bool) -> None:
    """`ggfit calibrate --bench FILE [MODEL]`: each row's measured rate against the model's, this machine's scales
    (median predicted / measured per kind), stored for the hardware and the rows' llama.cpp build."""
    from fitter.speed import calibration as sc
    from fitter.speed.bench_file import read_bench

    rows = read_bench(path)
    hw = speed.profile
    if hw is None:
        raise fitter.ConfigError("calibrate --bench: --no-speed leaves nothing to calibrate")
    models, skipped = _models_for(rows, model)
    points = _bench_points(rows, models, skipped, speed)
    if not points:
        raise fitter.ConfigError(f"--bench {path}: no row to calibrate from ({len(rows)} read; "
                                 + ("; ".join(_skip_summary(skipped)) or "none usable") + ")")
    scale = {k: sc.scale_of([(p.predicted, p.measured) for p, _ in points if p.kind == k]) for k in sc.KINDS}
    for p, (row, header, spec, cfg, be, n_gpus) in points:
        res = speed.predict(header, spec, cfg, be, n_gpus, bench=row, scale=scale)
        assert res is not None  # it was predicted once already
        sp = res[0]
        p.calibrated = sp.prefill_tps if p.kind == "prefill" else sp.decode_tps
    import time

    first = rows[0]
    cal = sc.SpeedCalibration(
        hardware=hw.name, llama_cpp=sc.rows_build_key(first.build_commit, first.build_number, speed.build),
        prefill=scale["prefill"], decode=scale["decode"],
        prefill_rows=sum(1 for p, _ in points if p.kind == "prefill"),
        decode_rows=sum(1 for p, _ in points if p.kind == "decode"),
        date=time.strftime("%Y-%m-%d", time.gmtime()), source=os.path.basename(path))
    where = None if no_store else sc.save(cal)
    pts = [p for p, _ in points]
    if as_json:
        print(json.dumps({"calibration": cal.model_dump(mode="json"), "label": cal.label,
                          "rows": [p.model_dump(mode="json") for p in pts], "skipped": skipped,
                          "stored": str(where) if where else None}, indent=2))
        return
    print_bench_table(pts, hw.name)
    for line in _skip_summary(skipped):
        print(f"skipped {line}")
    print(f"scale (predicted / measured, the median): prefill x{cal.prefill:.3f} over {cal.prefill_rows} pp rows, "
          f"decode x{cal.decode:.3f} over {cal.decode_rows} tg rows")
    if where:
        print(f"stored for {cal.hardware}, llama.cpp {cal.llama_cpp[:12]}: {where}; fit and quants with --hardware "
              f"{cal.hardware} use it")


def list_speed_calibrations() -> None:
    """`calibrate --list`'s speed lines: each stored scale (calibrate --bench)."""
    from fitter.speed import calibration as sc

    cals = sc.stored()
    for cal in cals:
        print(f"speed on {cal.hardware}, llama.cpp {cal.llama_cpp[:12]}: prefill x{cal.prefill:.3f}, decode "
              f"x{cal.decode:.3f}, {cal.label.removeprefix('calibrated ')} of {cal.source}")
    if cals:
        print(f"speed calibrations stored in {sc.store_path()}")


def _skip_summary(skipped: list[str]) -> list[str]:
    """The "TEST of MODEL: why" lines by reason: "32 rows (of llama 8B F16, qwen35 0.8B F16): why"."""
    out: dict[str, list[str]] = {}
    for line in skipped:
        what, _, why = line.partition(": ")
        out.setdefault(why, []).append(what.partition(" of ")[2])
    return [f"{len(ms)} row{'s' if len(ms) > 1 else ''}"
            + (f" (of {', '.join(dict.fromkeys(m for m in ms if m))})" if any(ms) else "") + f": {why}"
            for why, ms in out.items()]


def _err(p: float, m: float) -> str:
    return f"{100 * (p - m) / m:+.0f}%" if m > 0 else "-"


def print_bench_table(points: list, hardware: str) -> None:
    import statistics

    print(f"llama-bench rows against the speed model on {hardware} (tok/s):")
    print(f"  {'model':<28}{'test':<16}{'settings':<26}{'measured':>10}{'before':>10}{'err':>7}{'after':>10}{'err':>7}")
    for p in points:
        print(f"  {p.model[:27]:<28}{p.test:<16}{p.settings[:25]:<26}{rate(p.measured):>10}{rate(p.predicted):>10}"
              f"{_err(p.predicted, p.measured):>7}{rate(p.calibrated):>10}{_err(p.calibrated, p.measured):>7}")
    for kind in ("prefill", "decode"):
        ks = [p for p in points if p.kind == kind]
        if ks:
            before = statistics.median(abs(p.predicted / p.measured - 1) for p in ks)
            after = statistics.median(abs(p.calibrated / p.measured - 1) for p in ks)
            print(f"  {kind}: median error {100 * before:.0f}% before, {100 * after:.0f}% after ({len(ks)} rows)")
