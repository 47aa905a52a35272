"""The speed model on ggfit's command line (issue 46): `fit`'s and `quants`' rates (--hardware, --host-bandwidth, -t,
--speed-prompt, --speed-depth, --no-speed) and `calibrate --bench FILE`.

`--hardware auto` must not slow `fit`: this machine is detected once, and its host memory bandwidth is measured (once,
then cached by fitter.speed.hardware) only where a prediction needs it: weights on the CPU beside a GPU backend, or
the CPU backend."""

from __future__ import annotations

import json
import os
from typing import Any

import fitter

ROUGH = "no published figures for this GPU: rough"


def rate(x: float) -> str:
    """A rate to 3 significant figures, with thousands separators (9,090; 277; 43.9)."""
    if x <= 0:
        return "0"
    digits = 2 - int(f"{x:e}".split("e")[1])
    return f"{round(x, digits):,.{max(digits, 0)}f}"


class Speed:
    """--hardware, --host-bandwidth, -t, --speed-prompt, --speed-depth and --no-speed, resolved once per command;
    `predict` gives a config's rates (None where none can be said: `note` says why)."""

    def __init__(self, hardware: str = "auto", host_bandwidth: str | None = None, threads: int | None = None,
                 prompt: int = 512, depth: int = 0, *, off: bool = False, build: Any = None) -> None:
        from fitter.speed.hardware import get_profile, parse_bandwidth

        if prompt < 1:
            raise fitter.ConfigError(f"--speed-prompt {prompt}: use 1 or more tokens")
        if depth < 0:
            raise fitter.ConfigError(f"--speed-depth {depth}: use 0 or more tokens")
        self.auto = hardware.strip().lower() == "auto"
        self.off = off
        self.host_gbs = parse_bandwidth(host_bandwidth) if host_bandwidth is not None else None
        self.host_flag = host_bandwidth
        # a named profile is checked even with --no-speed (a mistyped name is one line); auto is detected only for use
        self.profile = None if self.auto and off else get_profile(hardware) if not self.auto else _detect()
        from cli_options import threads_of

        self.threads = threads_of(threads)
        self.prompt, self.depth, self.build = prompt, depth, build or fitter.PINNED
        self.note = ""
        self.notes: list[str] = []  # quants: the notes of its rates
        self.rated: dict[str, tuple[float, float]] = {}  # quants: (prefill, decode) by candidate name
        self.calibrated = ""
        self._cal: Any = False  # not looked up yet

    def backend(self, given: Any) -> Any:
        """--backend, else the profile's (--hardware sets the backend), else this machine's (--no-speed, auto)."""
        from cli_options import backend_of, backend_of_hardware

        return backend_of(given) if self.profile is None else backend_of_hardware(given, self.profile)

    def _this_machine(self) -> bool:
        return self.auto or (self.profile is not None and _detect().name == self.profile.name)

    def _host(self, needed: bool) -> Any:
        """The profile with its host bandwidth: --host-bandwidth, else on unified memory the chip's own, else (needed,
        this machine) measured once; else unknown (the model assumes a desktop's)."""
        from fitter.speed.machine import with_host

        p = self.profile
        assert p is not None
        if self.host_gbs is not None:
            return p.model_copy(update={"host_bandwidth_gbs": self.host_gbs,
                                        "host_bandwidth_source": f"--host-bandwidth {self.host_flag}"})
        p = with_host(p, needed and self._this_machine())
        if p.host_bandwidth_gbs:
            self.profile = p  # measured once per command
        return p

    def calibration(self) -> Any:
        if self._cal is False:
            from fitter.speed import calibration

            self._cal = calibration.load(self.profile.name, self.build) if self.profile is not None else None
        return self._cal

    def predict(self, header: Any, spec: Any, config: Any, backend: Any, n_gpus: int = 1, *,
                bench: Any = None, scale: dict[str, float] | None = None) -> Any:
        """The config's SpeedPrediction and the notes that go with it, or None (and `note`: why). `bench`: a
        llama-bench row's test (its prompt, depth and threads) with `scale` instead of the stored calibration."""
        from fitter.speed import predict_speed
        from fitter.speed.machine import host_needed

        p = self.profile
        if self.off or p is None:
            return None
        if backend.value != "cpu" and backend != p.backend:
            on = f"this machine ({p.name})" if self.auto else f"{p.name} ({p.backend.value})"
            self.note = (f"speed not predicted: --backend {backend.value} on {on}; "
                         "--hardware NAME names the device whose rates to predict")
            return None
        needed = host_needed(header, spec, config, backend, n_gpus)
        hw = self._host(needed)
        cal = self.calibration() if bench is None else None
        prompt, depth, threads = ((max(bench.n_prompt or 0, 1), bench.n_depth or 0, bench.n_threads or self.threads)
                                  if bench is not None else (self.prompt, self.depth, self.threads))
        sp = predict_speed(header, spec, config, backend, hw, prompt=prompt, depth=depth, threads=threads,
                           n_gpus=n_gpus, scale=cal.scale if cal else scale, calibrated=cal.label if cal else "")
        notes = []
        if backend.value != "cpu" and not hw.memory_bandwidth_gbs:
            notes.append(ROUGH)
        if needed and not hw.host_bandwidth_gbs:
            notes.append(f"host bandwidth of {hw.name} unknown: a desktop's assumed (--host-bandwidth sets it)")
        return sp, notes


    def rates(self, backend: Any) -> Any:
        """quant_fit.evaluate's `rate`: each fitting quant's (prefill, decode) rates, kept in `rated` by name."""
        if self.off or self.profile is None:
            return None

        def rate(name: str, header: Any, spec: Any, config: Any) -> None:
            res = self.predict(header, spec, config, backend)
            if res is not None:
                self.notes = list(dict.fromkeys([*self.notes, *res[1]]))
                self.calibrated = res[0].calibrated
                self.rated[name] = (res[0].prefill_tps, res[0].decode_tps)
        return rate

    def candidate_json(self, c: Any) -> dict[str, Any]:
        """A quants candidate as JSON, with its rates (None where it does not fit or none can be said)."""
        pre, dec = self.rated.get(c.name, (None, None))
        return {**c.model_dump(mode="json"), "prefill_tps": pre, "decode_tps": dec}

    def settings_json(self) -> dict[str, Any] | None:
        """What quants' rates are (its JSON's "speed"), or None with --no-speed."""
        if self.off or self.profile is None:
            return None
        return {"hardware": self.profile.name, "prompt_tokens": self.prompt, "depth": self.depth,
                "threads": self.threads, "calibrated": self.calibrated or None, "notes": self.notes,
                "note": self.note or None}


def _detect() -> Any:
    from fitter.speed.hardware import detect

    return detect()


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


def fit_speed(r: Any, placed: bool = False) -> Any:
    """fit's rates (cli_output.FitRun) of the config as printed (placed: of ggfit's placement), or None."""
    cfg = r.placement_cfg if placed else r.pred_config
    if r.speed is None or cfg is None:
        return None
    return r.speed.predict(r.header, r.spec, cfg, r.be, r.n_gpus)


def print_speed(r: Any, placed: bool = False) -> None:
    """fit's line: the rates of the config as printed (placed: of ggfit's placement), or why there are none."""
    res = fit_speed(r, placed)
    if res is not None:
        print(speed_line(res, "speed with this placement" if placed else "speed"))
    elif r.speed is not None and r.speed.note and not placed:
        print(r.speed.note)


def choose_fastest(r: Any) -> None:
    """Fit for speed (fitter.fit.fastest): of the neighbours of ggfit's placement that fit, the fastest for one
    request (--speed-prompt tokens, then 128 decoded); `fit` prints and proposes it, and keeps the ranking."""
    sp = r.speed
    if r.placement is None or sp is None or sp.off or sp.profile is None or r.be != sp.profile.backend:
        return
    from fitter.fit.fastest import fastest_placements
    from fitter.speed.machine import host_needed

    base = r.placement_cfg
    hw = sp._host(host_needed(r.header, r.spec, base, r.be, r.n_gpus))
    cal = sp.calibration()
    opts = fastest_placements(
        r.header, r.spec, base, r.be, r.fe, r.avail, r.host_avail, r.placement, hw, prompt=sp.prompt, depth=sp.depth,
        threads=sp.threads, scale=cal.scale if cal else None, ubatch_fixed=r.asked.get("-ub") is not None,
        draft=r.draft if (r.rec is None or r.rec.draft) else None, n_gpus=r.n_gpus, build=r.build)
    if not opts:
        return
    r.speed_options = opts
    best = opts[0]
    r.placement_cfg = base.model_copy(update=best.update)
    r.placement = r.placement.model_copy(update={
        "value": best.update[r.placement.lever], "total_device_bytes": best.device_bytes,
        "host_bytes": best.host_bytes, "headroom_bytes": best.headroom_bytes,
        "host_headroom_bytes": None if r.host_avail is None else r.host_avail - best.host_bytes})


def print_fastest(r: Any, shown: int = 5) -> None:
    """The ranking behind fit-for-speed's choice: what each placement that fits costs against the fastest."""
    opts = getattr(r, "speed_options", None)
    if not opts:
        return
    sp = opts[0].speed
    print(f"fastest placement that fits ({sp.hardware}, one request: pp{sp.prompt_tokens} then tg128 at depth "
          f"{sp.depth}), of {len(opts)}:")
    for o in opts[:shown]:
        print("  " + o.line(opts[0]))


def fastest_json(r: Any) -> list[dict[str, Any]] | None:
    opts = getattr(r, "speed_options", None)
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
    if not points:
        raise fitter.ConfigError(f"--bench {path}: no row to calibrate from ({len(rows)} read; "
                                 + ("; ".join(_skip_summary(skipped)) or "none usable") + ")")
    scale = {k: sc.scale_of([(p.predicted, p.measured) for p, _ in points if p.kind == k]) for k in sc.KINDS}
    for p, (row, header, spec, cfg, be, n_gpus) in points:
        sp = speed.predict(header, spec, cfg, be, n_gpus, bench=row, scale=scale)[0]
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
