"""How `ggfit fit` and `ggfit quants` print their plan (fitter.fit.plan): the text and the JSON, the breakdown table
(fit --engine mlx's too) and the rates. Nothing here decides: each function reads a Plan (or a QuantsPlan) that
plan() returned; the verdict's words and the placement's are cli_verdict's."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import typer

from cli_verdict import (
    alternatives_json,
    batch_notes,
    print_placement,
    print_recommendation,
    print_what_to_change,
    verdict_line,
)

if TYPE_CHECKING:
    from fitter.fit.plan import Plan, QuantsPlan
    from fitter.fit.request import Speed


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def print_breakdown(pred, available: int, per_device: dict[str, int] | None = None) -> None:
    print(f"{'owner':<7} {'buffer':<12} {'kind':<8} {'MiB':>11}  {'budget':<6}  detail")
    for b in pred.buffers:
        print(f"{b.owner:<7} {b.device:<12} {b.kind:<8} {b.bytes / 2**20:>11,.2f}  {'yes' if b.counts else 'no':<6}  {b.detail}")
    if per_device:  # one budget per GPU
        totals = pred.device_totals()
        for name, a in per_device.items():
            t = totals.get(name, 0)
            print(f"{name} against its budget: {mib(t)} of {mib(a)} available: "
                  f"{'fits' if t <= a else 'does NOT fit'}, headroom {(a - t) / 2**20:,.2f} MiB")
        return
    total = pred.total_device_bytes
    verdict = "fits" if total <= available else "does NOT fit"
    print(f"total against the budget: {mib(total)} of {mib(available)} available: {verdict}, "
          f"headroom {(available - total) / 2**20:,.2f} MiB")
    if pred.total_host_bytes:
        print(f"host memory outside the budget: {mib(pred.total_host_bytes)}")


def print_build(build, differences) -> None:
    """Which build's rules applied, and (not the pinned build) where its rules differ in a way that costs here."""
    from fitter.llama_builds import PINNED

    if build.is_pinned:
        return
    matter = [d for d in differences if d.device_bytes]
    print(f"build    {build.label()}: {build.how}")
    if matter:
        print(f"         rules of this build that differ from the pinned {PINNED.label()} here:")
    for d in matter:
        print(f"         - {d.line}")
    if len(differences) > len(matter):
        print(f"         ({len(differences) - len(matter)} other rules differ from the pinned build and change "
              "nothing here)")


def warn_ctx_train(cp, spec) -> None:
    """llama_context::llama_context warns "n_ctx_seq > n_ctx_train -- possible training context overflow"; so does ggfit."""
    if cp.n_ctx_seq > spec.n_ctx_train:
        print(f"ggfit: warning: n_ctx_seq ({cp.n_ctx_seq}) > n_ctx_train ({spec.n_ctx_train}) -- possible training "
              "context overflow (llama-server caps each slot at n_ctx_train)", file=sys.stderr)


def _host_json(r: Plan) -> dict[str, Any]:
    from fitter.fit.margin import host_margin_note

    host = r.host
    return {
        "host_bytes": r.pred.host_bytes,
        "host_budget_bytes": host.bytes if host is not None else None,
        "host_budget_source": host.source if host is not None else None,
        "host_margin_bytes": r.budgets.host_margin if host is not None else None,
        "host_margin_source": host_margin_note(r.be.value) if host is not None else None,
    }


def _placement_json(r: Plan) -> dict[str, Any]:
    p, tp = r.placement, r.table_placement
    return {
        "placement": ({**p.model_dump(mode="json"), "flags": r.placement_flags, "speed": speed_json(r.placed_rates),
                       "by_speed": fastest_json(r)} if p is not None else None),
        "placement_note": r.placement_why or None,
        "table_placement": {**tp.model_dump(mode="json"), "flags": tp.flags} if tp is not None else None,
    }


def plan_json(r: Plan) -> dict[str, Any]:
    """`fit --json`: the plan, every field the text prints and the verdict's (the same line and exit code)."""
    from fitter.fit.margin import margin_note
    from fitter.llama_builds import build_label

    b = r.budgets
    out = {
        "backend": r.be.value,
        "frontend": r.fe.value,
        "llama_cpp": build_label() if r.build.is_pinned else r.build.label(),
        "llama_build": {"label": r.build.label(), "how": r.build.how, "pinned": r.build.is_pinned,
                        "differences": [d.model_dump(mode="json") for d in r.differences]},
        "budget_bytes": r.bud.bytes,
        "budget_source": r.bud.source,
        "margin_bytes": b.margin_bytes,
        "margin_source": margin_note(r.be.value) if b.margin_default else "--margin",
        "device_margins": _device_margins(r),
        "config": r.pred.context.model_dump(mode="json"),
        "buffers": [x.model_dump(mode="json") for x in r.pred.buffers],
        "total_device_bytes": r.pred.total_device_bytes,
        "fits": r.fits,
        "headroom_bytes": r.headroom,
        "device_totals": r.pred.device_totals(),
        "solutions": [s.model_dump(mode="json") for s in r.solutions],
        "recommended": r.rec.model_dump(mode="json") if r.rec else None,
        "flags": r.flags if r.fits else None,
        "calibration": [a.model_dump(mode="json") for a in r.pred.calibration],
        **_host_json(r),
        **_placement_json(r),
        "batch_notes": batch_notes(r),
        "what_to_change": alternatives_json(r),
        "verdict": {"verdict": r.verdict, "line": verdict_line(r), "exit_code": r.exit_code,
                    "flags": r.flags if r.fits else r.placement_flags if r.placement is not None else None},
    }
    out["speed"] = speed_json(r.rates)
    if out["speed"] is None and r.speed is not None and r.speed.note:
        out["speed_note"] = r.speed.note
    out["session"] = r.session.as_json() if r.session is not None else None
    if r.measured is not None:
        out["check"] = r.measured
    if r.fit_params is not None:
        out["check"] = r.fit_params
    if r.rpc_hosts is not None:  # --rpc: what each host holds, and the -ts that fits the largest context
        out.update(hosts=r.rpc_hosts, split=r.rpc_split.json if r.rpc_split else None,
                   split_network=r.rpc_network.json if r.rpc_network else None)
    return out


def _device_margins(r: Plan) -> dict[str, dict] | None:
    """Each device's own default margin where they differ (--rpc: fitter.fit.margin.device_margins)."""
    from fitter.fit.margin import device_margin_notes

    b = r.budgets
    if not b.margins:
        return None
    notes = device_margin_notes(r.be.value, len(b.devices), r.cfg.rpc_backends)
    return {name: {"bytes": m, "source": notes.get(name, "")} for name, m in b.margins.items()}


def _print_head(r: Plan) -> None:
    """The model, backend, build, budget, the defaults llama.cpp applied and its caps of -b and -ub."""
    from fitter.fit.margin import margin_note
    from fitter.llama_builds import build_label

    spec, pred, b = r.spec, r.pred, r.budgets
    print(f"model    {r.path} ({spec.architecture}, {spec.file_type_name or '?'}, {mib(spec.file_size)})")
    print(f"backend  {r.be.value}, {r.fe.value} defaults, "
          + (build_label() if r.build.is_pinned else f"rules of {r.build.label()}"))
    print_build(r.build, r.differences)
    note = f" [{r.bud.note}]" if r.bud.note else ""
    why = f" ({margin_note(r.be.value)})" if b.margin_default else ""
    margin = r.bud.bytes - b.available if b.margins else b.margin_bytes  # the main device's own
    why = " (each device its own below)" if b.margins else why
    print(f"budget   {mib(r.bud.bytes)} ({r.bud.source}){note}, margin {mib(margin)}{why} -> "
          f"{mib(b.available)} available")
    for name, m in (_device_margins(r) or {}).items():
        print(f"margin   {name} {mib(m['bytes'])} ({m['source']})")
    if pred.context.defaults_applied:
        print("defaults " + ", ".join(f"{k} = {v}" for k, v in pred.context.defaults_applied.items()))
    # llama_context::llama_context caps n_batch at n_ctx and n_ubatch at n_batch without a word; ggfit says so
    for i, line in enumerate(batch_notes(r)):
        print(("capped   " if i == 0 else "         ") + line)


def _print_memory(r: Plan) -> None:
    """The breakdown, the rates, the calibration and checks, and the host side."""
    from fitter.fit.margin import host_margin_note

    pred, b = r.pred, r.budgets
    print()
    print_breakdown(pred, b.available, r.avail if b.per_device else None)  # type: ignore[arg-type]
    print_speed(r)
    if r.session is not None:
        print("\n".join(r.session.lines()))
    print_calibration(pred)
    if r.measured is not None:
        print()
        print_check(r.measured)
    if r.fit_params is not None:
        print()
        print_fit_params(r.fit_params)
    cfg = r.cfg
    if r.impl.unified_memory and (cfg.n_cpu_moe or cfg.cpu_moe or cfg.override_tensor or cfg.n_gpu_layers >= 0):
        label = r.impl.label
        print(f"note: {label}'s memory is unified: weights kept on the CPU (--n-cpu-moe, --cpu-moe, -ot, -ngl) leave "
              f"the {label} buffers but stay in the same RAM, so they free nothing overall")
    if r.host is not None:
        hb, ha = pred.host_bytes, r.host_avail
        print(f"host memory: {mib(hb)} of the {mib(r.host.bytes)} host budget ({r.host.source}) less a "
              f"{mib(b.host_margin)} host margin ({host_margin_note(r.be.value)}): "
              + ("fits" if ha is not None and hb <= ha else "does NOT fit"))


def print_fit(r: Plan) -> None:
    """`ggfit fit`'s text: the model and budget, the solutions, the breakdown, then the command or what to change, and
    the verdict last (verdict_line: the same as JSON's). Exit code Plan.exit_code."""
    if r.rpc_split is not None:
        print(r.rpc_split.text + "\n")
    if r.rpc_network is not None:
        print("\n".join(r.rpc_network.text) + "\n")
    _print_head(r)
    if r.solutions:
        print_recommendation(r)
        if r.rec is None:
            print(f"\nverdict: {verdict_line(r)}")
            raise typer.Exit(r.exit_code)
    _print_memory(r)
    print_placement(r)
    if r.placement is not None:
        print_speed(r, placed=True)
        print_fastest(r)
    if r.fits:
        print("\nllama-server \\\n  " + " \\\n  ".join(r.flags or ()))
    else:
        print()
        print_what_to_change(r)
    print(f"\nverdict: {verdict_line(r)}")
    if r.exit_code:
        raise typer.Exit(r.exit_code)


def print_calibration(pred) -> None:
    for a in pred.calibration:
        changes = ", ".join(f"{c.owner} {c.device} compute {c.predicted_bytes / 2**20:,.2f} -> "
                            f"{c.calibrated_bytes / 2**20:,.2f} MiB" for c in a.changed)
        print(f"calibration applied: {a.architecture} on {a.backend}, llama.cpp {a.llama_cpp[:12]}, from {a.stored}: "
              + (f"changed {changes}" if changes else "identity, no buffer changed" if a.identity else "no buffer changed"))


def print_fit_params(check: dict) -> None:
    print(f"your llama-fit-params, predicted vs printed (MiB, rounded down as it prints them):\n  $ {check['command']}")
    print("  (its context is common_params': logits for the whole batch, one KV stream per sequence; ggfit predicted "
          "that context for this check)")
    print(f"  {'device':<10}{'kind':<9}{'predicted':>11}{'printed':>9}{'diff':>7}")
    for row in check["rows"]:
        p, m = row["predicted_mib"], row["measured_mib"]
        d = "-" if p is None or m is None else f"{p - m:+d}"
        print(f"  {row['device']:<10}{row['kind']:<9}{'-' if p is None else p:>11}{'-' if m is None else m:>9}{d:>7}")
    print("  exact" if check["exact"] else "  differs: see the rows above")


def print_check(measured: dict) -> None:
    print(f"llama.cpp dry run ({measured.get('llama_cpp', '?')}), predicted vs measured:")
    print(f"  {'kind':<9}{'predicted MiB':>15}{'llama.cpp MiB':>15}{'diff MiB':>11}")
    for row in measured["rows"]:
        p, m = row["predicted_bytes"], row["measured_bytes"]
        mm = "-" if m is None else f"{m / 2**20:,.2f}"
        d = "-" if m is None else f"{(p - m) / 2**20:+,.2f}"
        print(f"  {row['kind']:<9}{p / 2**20:>15,.2f}{mm:>15}{d:>11}")
    for line in measured.get("notes", []):
        print(f"  {line}")




def print_quants_plan(q: QuantsPlan, as_json: bool) -> None:
    """`ggfit quants`' table (or JSON): each quant's sizes and rates, the best fit, or why none fits (exit 1)."""
    import json

    from fitter.fit.quant_fit import BEST_RULE
    from fitter.llama_builds import build_label

    f = q.request.fit
    speed, be, build, b = f.speed, f.backend, f.build, f.budgets
    assert speed is not None
    if as_json:
        print(json.dumps({"backend": be.value, "llama_cpp": build_label() if build.is_pinned else build.label(),
                          "budget_bytes": b.main.bytes, "margin_bytes": b.margin_bytes,
                          "header_bytes_fetched": q.header.bytes_fetched,
                          "candidates": [candidate_json(speed, c) for c in q.candidates],
                          "best": q.best.name if q.best else None, "best_rule": BEST_RULE,
                          "none_fits": q.none_fits, "speed": settings_json(speed)},
                         indent=2))
        raise typer.Exit(1 if q.none_fits else 0)  # as the text: 1 when nothing fits
    if not build.is_pinned:
        print(f"rules of {build.label()} ({build.how})")
    cfg, best = f.config, q.best
    print(f"{q.spec.architecture}, {q.spec.n_params / 1e9:.2f} B parameters; backend {be.value}, -c {q.n_ctx}, "
          f"-ctk {cfg.type_k} -ctv {cfg.type_v}; budget {mib(b.main.bytes)} - margin {mib(b.margin_bytes)} = "
          f"{mib(b.available)}")
    print_quants(q.candidates, best, speed)
    if best:
        print(f"best fit: {best.name} ({best.file_bytes / 2**20:,.0f} MiB), headroom "
              f"{best.headroom_bytes / 2**20:,.0f} MiB ({BEST_RULE})")
    elif q.candidates:
        print(q.none_fits)
        raise typer.Exit(1)


# --- the rates: fit's speed lines and ranking, quants' columns ---------------------------------------------------


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
    from fitter.fit.quant_fit import THIS_FILE

    rated = bool(speed.rated)
    head = f"{'prefill t/s':>13}{'decode t/s':>12}" if rated else ""
    print(f"  {'quant':<24}{'file MiB':>11}{'device MiB':>12}{head}{'headroom':>11}{'largest -c':>12}  verdict")
    for c in cands:
        verdict = "fits" if c.fits else f"over by {-c.headroom_bytes / 2**20:,.0f} MiB"
        flag = (" (this file)" if c.source == THIS_FILE else " (imatrix)" if c.needs_imatrix
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
