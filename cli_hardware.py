"""`ggfit hardware`: the speed model's hardware profiles (fitter.speed.hardware), and what this machine is.

cli.py's `hardware` command calls show_hardware; the text and JSON are made here."""

from __future__ import annotations

import json
from typing import Any

from fitter.speed import hardware as hw

# the figures of a profile as the table and the detail view show them: field, label
FIGURES = (("memory_bandwidth_gbs", "memory bandwidth GB/s"), ("fp16_tflops", "FP16 TFLOPS"),
           ("int8_tops", "INT8 TOPS"), ("gpu_cores", "GPU cores"), ("memory_gib", "memory GiB"),
           ("pcie_gbs", "PCIe GB/s"))


def _num(v: Any) -> str:
    if v is None or v == ():
        return "-"
    if isinstance(v, tuple):
        return ", ".join(_num(x) for x in v)
    if isinstance(v, float):
        return f"{v:,.2f}".rstrip("0").rstrip(".") if v != int(v) else f"{int(v):,}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(profiles: list[hw.HardwareProfile], sources: bool = False) -> list[str]:
    """One line per profile: name, backend, memory bandwidth, FP16 TFLOPS, GPU cores, memory sizes; with
    `sources`, each figure's source below it."""
    head = ("name", "backend", "bandwidth GB/s", "FP16 TFLOPS", "GPU cores", "memory GiB")
    rows = [(p.name, p.backend.value, _num(p.memory_bandwidth_gbs), _num(p.fp16_tflops), _num(p.gpu_cores),
             _num(p.memory_gib)) for p in profiles]
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(r)).rstrip()
    out = [line(head)]
    for p, r in zip(profiles, rows):
        out.append(line(r))
        if sources:
            out += [f"    {field}: {url}" for field, url in p.sources.items()]
    return out


def detail(p: hw.HardwareProfile, more: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """One profile, a figure a line, each with its source; then `more` (label, text)."""
    rows = [("profile", p.name), ("chip", p.chip), ("backend", p.backend.value + (", unified memory" if p.unified else ""))]
    for field, label in FIGURES:
        v = getattr(p, field)
        if v is None or v == ():
            continue
        src = p.sources.get(field)
        rows.append((label, _num(v) + (f"  ({src})" if src else "")))
    if p.nvml_names:
        rows.append(("NVML names", ", ".join(p.nvml_names)))
    for field, url in p.sources.items():
        if field not in dict(FIGURES):
            rows.append((f"source of {field}", url))
    if p.detected_by:
        rows.append(("detected by", p.detected_by))
    if p.n_devices > 1:
        rows.append(("GPUs", str(p.n_devices)))
    if p.host_bandwidth_source:
        host = "-" if p.host_bandwidth_gbs is None else f"{p.host_bandwidth_gbs:,.2f} GB/s"
        rows.append(("host bandwidth", f"{host} ({p.host_bandwidth_source})"))
    if p.cpu_rate_source:
        def per(rates: dict[str, float]) -> str:
            return ", ".join(f"{c} {v:,.0f}" for c, v in rates.items()) or "-"
        rows.append(("CPU GFLOP/s", f"per thread, prefill {per(p.cpu_prefill_gflops)}; decode "
                                    f"{per(p.cpu_decode_gflops)} ({p.cpu_rate_source})"))
    from fitter.speed.predict import profile_scale

    scale = profile_scale(p, p.backend)
    if scale:  # fit's rates on this profile: the fitted coefficients' times this (a stored calibration replaces it)
        rows.append(("speed scale", ", ".join(f"{k} x{v:g}" for k, v in sorted(scale.items()))
                     + " (time, measured / predicted over its llama-bench rows in benchmarks/speed_model.py's truth set)"))
    rows += more
    w = max(len(k) for k, _ in rows)
    return [f"{k:<{w}}  {v}" for k, v in rows]


def show_hardware(name: str | None = None, *, detect: bool = False, sources: bool = False, remeasure: bool = False,
                  as_json: bool = False) -> None:
    """`ggfit hardware [NAME|auto] [--detect] [--sources] [--remeasure] [--json]`: every profile; one, with its
    sources; or (auto, --detect) this machine's, with its host bandwidth measured (cached), llama.cpp's default -t
    and, where the CPU runs the models, the CPU's matrix rates at that -t (measured, cached)."""
    auto = detect or (name is not None and name.strip().lower() == "auto")
    if name is not None and not auto:
        p = hw.get_profile(name, flag="ggfit hardware")
        print(json.dumps(hw.profile_dict(p), indent=2) if as_json else "\n".join(detail(p)))
        return
    if auto:
        p = hw.resolve("auto", measure=lambda: hw.measure_host_bandwidth(refresh=remeasure))
        threads = hw.default_threads()
        from fitter.ggml import backends
        from fitter.speed.machine import with_cpu_rate

        p = with_cpu_rate(p, threads, not backends.get(p.backend).is_gpu, refresh=remeasure)
        if as_json:
            print(json.dumps(dict(hw.profile_dict(p), threads=threads), indent=2))
            return
        print("\n".join(detail(p, (("threads", f"{threads} (llama.cpp's default -t: the physical cores)"),))))
        return
    known = list(hw.profiles().values())
    if as_json:
        print(json.dumps({"profiles": [hw.profile_dict(p) for p in known]}, indent=2))
        return
    print("\n".join(table(known, sources)))
    if not sources:
        print("\n--sources: where each figure comes from; ggfit hardware auto: this machine")
