"""The speed model's calibration on ggfit's command line (issue 46): `calibrate --bench FILE` (llama-bench's rates
against the model's, this machine's scale stored) and the stored scales `calibrate --list` shows. How `fit` and
`quants` print their rates is cli_fit's; the settings are fitter.fit.request.Speed."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from cli_fit import rate
from fitter.errors import GGFitError

if TYPE_CHECKING:
    from fitter.fit.request import Speed


def _models_for(rows: list, model: str | None) -> tuple[dict[int, tuple[str, Any, Any]], list[str]]:
    """Each usable row's (file name, header, spec): MODEL when given (the rows whose size and parameter count are
    its), else the row's model_filename where that file is on this machine."""
    out: dict[int, tuple[str, Any, Any]] = {}
    skipped: list[str] = []
    from fitter.bundled import resolve_model
    from fitter.llama.model import load_model_spec
    from fitter.speed.calibration import row_matches

    loaded: dict[str, tuple[Any, Any]] = {}

    def load(where: str) -> tuple[Any, Any]:
        if where not in loaded:
            loaded[where] = load_model_spec(resolve_model(where))
        return loaded[where]

    given = load(model) if model else None
    for i, row in enumerate(rows):
        if given is not None:
            if row_matches(row, given[1]):
                out[i] = (os.path.basename(resolve_model(model or "")), *given)
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
        except (GGFitError, ValueError) as e:
            skipped.append(f"{row.test}: {e}")
            continue
        res = speed.predict(header, spec, cfg, be, n_gpus, bench=row)
        if res is None:  # a GPU row on another machine's profile
            skipped.append(f"{row.test} of {row.model_type or name}: ran on {be.value}, which {hw.name} is not "
                           "(--hardware NAME: the machine that ran it)")
            continue
        fitted = speed.predict(header, spec, cfg, be, n_gpus, bench=row, scale=sc.UNSCALED)
        assert fitted is not None
        rates = [(r.prefill_tps if kind == "prefill" else r.decode_tps) for r in (res[0], fitted[0])]
        point = sc.BenchPoint(test=row.test, kind=kind, model=name, measured=row.avg_ts, predicted=rates[0],
                              fitted=rates[1], settings=sc.settings_of(row))
        points.append((point, (row, header, spec, cfg, be, n_gpus)))
    return points


def calibrate_bench(path: str, model: str | None, speed: Speed, *, no_store: bool, as_json: bool) -> None:
    """`ggfit calibrate --bench FILE [MODEL]`: each row's measured rate against the model's, this machine's scales
    (median predicted / measured per kind), stored for the hardware and the rows' llama.cpp build."""
    from fitter.llama.flags import ConfigError
    from fitter.speed import calibration as sc
    from fitter.speed.bench_file import read_bench

    rows = read_bench(path)
    hw = speed.profile
    if hw is None:
        raise ConfigError("calibrate --bench: --no-speed leaves nothing to calibrate")
    models, skipped = _models_for(rows, model)
    points = _bench_points(rows, models, skipped, speed)
    if not points:
        raise ConfigError(f"--bench {path}: no row to calibrate from ({len(rows)} read; "
                          + ("; ".join(_skip_summary(skipped)) or "none usable") + ")")
    scale = {k: sc.scale_of([(p.fitted, p.measured) for p, _ in points if p.kind == k]) for k in sc.KINDS}
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
