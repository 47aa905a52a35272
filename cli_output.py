"""How ggfit's commands print what they found: `fit`'s run (the prediction, the solved table, the recommendation,
the placement, the build's rules, the checks), `fit --engine mlx`'s, `calibrate`'s tables and a user log's side. cli.py parses the
flags and calls fitter; the text is here."""

from __future__ import annotations

import json
import sys
from dataclasses import field
from typing import Any, Optional

import typer

import fitter
from cli_mlx_session import mlx_session, print_session, session_json
from cli_options import detect_backend
from cli_speed import fastest_json, fit_speed, print_fastest, print_speed, speed_json
from cli_verdict import (
    alternatives_json,
    batch_notes,
    print_placement,
    print_recommendation,
    print_what_to_change,
    server_flags,
    verdict_line,
    verdict_of,
    what_fits_instead,
)
from fitter import GGFitError


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def print_build(build, differences) -> None:
    """Which build's rules applied, and (not the pinned build) where its rules differ in a way that costs here."""
    if build.is_pinned:
        return
    matter = [d for d in differences if d.device_bytes]
    print(f"build    {build.label()}: {build.how}")
    if matter:
        print(f"         rules of this build that differ from the pinned {fitter.PINNED.label()} here:")
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


class FitRun(fitter.Record, frozen=False):
    """What `ggfit fit` found: the prediction (at the recommended solution when it solved for the context)."""

    path: str
    header: Any
    spec: Any
    cfg: Any
    be: Any
    fe: Any
    bud: Any
    margin_bytes: int
    available: int
    draft: Any
    model_draft: str | None
    build: Any
    margin_default: bool = False
    host: Any = None  # the host budget (None on the CPU backend: everything is the one budget there)
    n_gpus: int = 1
    per_device: dict[str, int] | None = None  # --budget per GPU, by buffer name
    speed: Any = None  # cli_speed.Speed: --hardware and the rates' settings (None: no rates)
    speed_options: Any = None  # fit for speed: the placements that fit, fastest first (cli_speed.choose_fastest)

    @property
    def avail(self) -> Any:
        """What the prediction may use: the available bytes, or per GPU (each budget less the margin)."""
        if self.per_device:
            return {name: b - self.margin_bytes for name, b in self.per_device.items()}
        return self.available
    solutions: list = field(default_factory=list)
    differences: list = field(default_factory=list)
    rec: Any = None
    pred: Any = None
    measured: dict | None = None
    fit_params: dict | None = None
    placement: Any = None  # a PlacementChoice when the config as given does not fit
    placement_why: str = ""
    placement_cfg: Any = None
    table_placement: Any = None  # the PlacementChoice the table was solved with (no -c: the placement given fit nothing)
    alternatives: list = field(default_factory=list)  # what fits instead, one change at a time (Alternative)
    asked: dict[str, int | None] = field(default_factory=dict)  # -b and -ub as given (None: not given)

    def solve(self, *, solve_ctx: bool, n_batch: int | None, n_ubatch: int | None, kv_given: bool) -> None:
        """Predict the config as given, or (no -c) solve for the largest context and predict the recommended one; where
        the placement given fits no context, the table is solved again with the placement solve_placement finds."""
        if not solve_ctx:
            self.pred = fitter.predict(self.header, self.spec, self.cfg, self.be, self.fe, self.draft, build=self.build)
            return
        kwargs: dict[str, Any] = {"ubatches": fitter.table_ubatches(self.spec, n_batch, n_ubatch)}
        if kv_given:
            kwargs["kv_pairs"] = ((self.cfg.type_k, self.cfg.type_v),)
        self._solve_table(kwargs)
        if self.rec is None:
            self._place_table(kwargs)

    def _solve_table(self, kwargs: dict[str, Any]) -> None:
        h, spec, cfg, be, fe, b = self.header, self.spec, self.cfg, self.be, self.fe, self.build
        self.solutions = fitter.solve(h, spec, cfg, be, fe, self.bud.bytes, self.margin_bytes, draft=self.draft,
                                      build=b, per_device=self.per_device, **kwargs)
        self.rec = fitter.recommend(self.solutions, spec.n_ctx_train)
        self.pred = (fitter.prediction_for(h, spec, cfg, be, fe, self.rec, self.draft, build=b) if self.rec else
                     fitter.predict(h, spec, cfg.model_copy(update={"n_ctx": 256}), be, fe, self.draft, build=b))

    def _place_table(self, kwargs: dict[str, Any]) -> None:
        """No context fits the placement given: the placement that fits the training context (else 4,096 tokens) at
        the asked -ub and K/V types (fewest --n-cpu-moe for a MoE model, largest -ngl for a dense one: solve_placement),
        and the table solved again with it. The CPU backend has no GPU; Metal's unified memory frees nothing."""
        for target in dict.fromkeys((self.spec.n_ctx_train, min(self.spec.n_ctx_train, 4096))):
            base = self.cfg.model_copy(update={"n_ctx": target})  # -ub and -b as given: llama.cpp resolves them
            placed, why = fitter.solve_placement(self.header, self.spec, base, self.be, self.fe, self.avail,
                                                 self.host_avail, draft=self.draft, build=self.build)
            self.placement_why = self.placement_why or why
            if placed is not None:
                self.table_placement, self.placement_why = placed, ""
                self.cfg = self.cfg.model_copy(update=placed.update)
                self._solve_table(kwargs)
                return

    @property
    def pred_config(self) -> Any:
        """The config of the prediction shown (the recommended solution's when fit solved for the context)."""
        return fitter.served_config(self.pred.context, self.cfg, self.model_draft if self.pred_draft else None)

    @property
    def pred_draft(self) -> Any:
        return self.draft if (self.rec is None or self.rec.draft) else None

    def solve_placement(self) -> None:
        """When the config does not fit (or the context solved for stops short of the training context): the
        placement (--n-cpu-moe, else -ngl) that fits at the asked context (else the training context)."""
        cp = self.pred.context
        if self.fits and (self.rec is None or self.rec.n_ctx >= self.spec.n_ctx_train):
            return
        if self.be.value == "cpu" or self.table_placement is not None or self.placement_why:
            return  # no GPU, or the table's placement was solved already (or why there is none said)
        target = self.cfg.n_ctx if self.cfg.n_ctx is not None else self.spec.n_ctx_train
        base = self.cfg.model_copy(update={"n_ctx": target, "n_ubatch": cp.n_ubatch, "type_k": cp.type_k,
                                           "type_v": cp.type_v})
        if self.rec is not None:
            base = base.model_copy(update={"n_batch": self.rec.n_batch})
        host = self.host_avail
        self.placement, self.placement_why = fitter.solve_placement(
            self.header, self.spec, base, self.be, self.fe, self.avail, host,
            draft=self.draft if (self.rec is None or self.rec.draft) else None, build=self.build)
        if self.placement is not None:
            self.placement_cfg = base.model_copy(update=self.placement.update)

    @property
    def host_margin(self) -> int:
        """What the host budget keeps for the process's own memory beside the predicted host bytes."""
        return fitter.default_host_margin(self.be.value)

    @property
    def host_avail(self) -> int | None:
        """What the predicted host bytes may use: the host budget less the host margin (None: no host budget)."""
        return None if self.host is None else self.host.bytes - self.host_margin

    @property
    def fits(self) -> bool:
        # every GPU within its budget (one budget: the device total), and what lands in RAM within the host budget
        if self.host_avail is not None and self.pred.host_bytes > self.host_avail:
            return False
        return fitter.excess(self.pred, self.avail) <= 0

    def placement_flags(self) -> list[str]:
        pcfg = self.placement_cfg
        pred = fitter.predict(self.header, self.spec, pcfg, self.be, self.fe,
                              self.draft if (self.rec is None or self.rec.draft) else None, build=self.build)
        draft = self.model_draft if (self.rec is None or self.rec.draft) else None
        return server_flags(self.path, pred.context, pcfg, draft, self.spec, self.be, self.n_gpus)

    def flags(self) -> list[str]:
        draft = self.model_draft if (self.rec is None or self.rec.draft) else None
        return server_flags(self.path, self.pred.context, self.cfg, draft, self.spec, self.be, self.n_gpus)

    def conclude(self) -> None:
        """What fits instead (one change at a time) when the config, or without -c every context, does not fit."""
        self.alternatives = what_fits_instead(self)

    @property
    def verdict(self) -> str:
        return verdict_of(self)

    @property
    def exit_code(self) -> int:
        """0 when a command fits (fits, fits_with_placement), 1 when none does: in text and JSON alike."""
        return 1 if self.verdict == "does_not_fit" else 0

    def as_json(self) -> dict[str, Any]:
        total = self.pred.total_device_bytes
        out = {
            "backend": self.be.value,
            "frontend": self.fe.value,
            "llama_cpp": fitter.build_label() if self.build.is_pinned else self.build.label(),
            "llama_build": {"label": self.build.label(), "how": self.build.how, "pinned": self.build.is_pinned,
                            "differences": [d.model_dump(mode="json") for d in self.differences]},
            "budget_bytes": self.bud.bytes,
            "budget_source": self.bud.source,
            "margin_bytes": self.margin_bytes,
            "margin_source": fitter.margin_note(self.be.value) if self.margin_default else "--margin",
            "config": self.pred.context.model_dump(mode="json"),
            "buffers": [b.model_dump(mode="json") for b in self.pred.buffers],
            "total_device_bytes": total,
            "fits": self.fits,
            "headroom_bytes": -fitter.excess(self.pred, self.avail),
            "device_totals": self.pred.device_totals(),
            "solutions": [s.model_dump(mode="json") for s in self.solutions],
            "recommended": self.rec.model_dump(mode="json") if self.rec else None,
            "flags": self.flags() if self.fits else None,
            "calibration": [a.model_dump(mode="json") for a in self.pred.calibration],
            "host_bytes": self.pred.host_bytes,
            "host_budget_bytes": self.host.bytes if self.host is not None else None,
            "host_budget_source": self.host.source if self.host is not None else None,
            "host_margin_bytes": self.host_margin if self.host is not None else None,
            "host_margin_source": fitter.host_margin_note(self.be.value) if self.host is not None else None,
            "placement": ({**self.placement.model_dump(mode="json"), "flags": self.placement_flags(),
                           "speed": speed_json(fit_speed(self, placed=True)), "by_speed": fastest_json(self)}
                          if self.placement is not None else None),
            "placement_note": self.placement_why or None,
            "table_placement": ({**self.table_placement.model_dump(mode="json"), "flags": self.table_placement.flags}
                                if self.table_placement is not None else None),
            "batch_notes": batch_notes(self),
            "what_to_change": alternatives_json(self),
            "verdict": {"verdict": self.verdict, "line": verdict_line(self), "exit_code": self.exit_code,
                        "flags": (self.flags() if self.fits else self.placement_flags()
                                  if self.placement is not None else None)},
        }
        out["speed"] = speed_json(fit_speed(self))
        if out["speed"] is None and self.speed is not None and self.speed.note:
            out["speed_note"] = self.speed.note
        if self.measured is not None:
            out["check"] = self.measured
        if self.fit_params is not None:
            out["check"] = self.fit_params
        return out


def print_fit(r: FitRun) -> None:
    """`ggfit fit`'s text: the model and budget, the solutions, the breakdown, then the command or what to change, and
    the verdict last (FitRun.verdict_line: the same as JSON's). Exit code FitRun.exit_code."""
    spec, pred = r.spec, r.pred
    print(f"model    {r.path} ({spec.architecture}, {spec.file_type_name or '?'}, {mib(spec.file_size)})")
    print(f"backend  {r.be.value}, {r.fe.value} defaults, "
          + (fitter.build_label() if r.build.is_pinned else f"rules of {r.build.label()}"))
    print_build(r.build, r.differences)
    note = f" [{r.bud.note}]" if r.bud.note else ""
    why = f" ({fitter.margin_note(r.be.value)})" if r.margin_default else ""
    print(f"budget   {mib(r.bud.bytes)} ({r.bud.source}){note}, margin {mib(r.margin_bytes)}{why} -> "
          f"{mib(r.available)} available")
    if pred.context.defaults_applied:
        print("defaults " + ", ".join(f"{k} = {v}" for k, v in pred.context.defaults_applied.items()))
    # llama_context::llama_context caps n_batch at n_ctx and n_ubatch at n_batch without a word; ggfit says so
    for i, line in enumerate(batch_notes(r)):
        print(("capped   " if i == 0 else "         ") + line)
    if r.solutions:
        print_recommendation(r)
        if r.rec is None:
            print(f"\nverdict: {verdict_line(r)}")
            raise typer.Exit(r.exit_code)
    print()
    print_breakdown(pred, r.available, r.avail if r.per_device else None)
    print_speed(r)
    print_calibration(pred)
    if r.measured is not None:
        print()
        print_check(r.measured)
    if r.fit_params is not None:
        print()
        print_fit_params(r.fit_params)
    if r.be.value == "metal" and (r.cfg.n_cpu_moe or r.cfg.cpu_moe or r.cfg.override_tensor or r.cfg.n_gpu_layers >= 0):
        print("note: Metal's memory is unified: weights kept on the CPU (--n-cpu-moe, --cpu-moe, -ot, -ngl) leave the "
              "Metal buffers but stay in the same RAM, so they free nothing overall")
    if r.host is not None:
        hb, ha = pred.host_bytes, r.host_avail
        print(f"host memory: {mib(hb)} of the {mib(r.host.bytes)} host budget ({r.host.source}) less a "
              f"{mib(r.host_margin)} host margin ({fitter.host_margin_note(r.be.value)}): "
              + ("fits" if ha is not None and hb <= ha else "does NOT fit"))
    print_placement(r)
    if r.placement is not None:
        print_speed(r, placed=True)
        print_fastest(r)
    if r.fits:
        print("\nllama-server \\\n  " + " \\\n  ".join(r.flags()))
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
        raise fitter.ConfigError(f"--list takes no MODEL (got {model})")
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
        try:  # a model: its architecture
            arch = fitter.load_model_spec(fitter.resolve_model(model))[1].architecture
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
             max_kv_size: int | None, kv_bits: int | None, kv_group_size: int, quantized_kv_start: int,
             prefill_step_size: int, max_tokens: int, prompt_cache_bytes: str | None, draft_n_max: int,
             as_json: bool, prompt_cache_size: int = 10, session_requests: int | None = None) -> None:
    """`ggfit fit --engine mlx`: the same table and budget for an MLX model; without -c, the largest -c that fits."""
    bud = fitter.parse_budget(budget, detect_backend())
    margin_bytes = fitter.parse_margin(margin)
    available = fitter.available_bytes(bud, margin_bytes)
    for flag, v in (("--prefill-step-size", prefill_step_size), ("--max-tokens", max_tokens)):
        if v < 1:
            raise fitter.GGFitError(f"{flag} {v}: must be at least 1")
    m = fitter.load_mlx_model(model)
    draft = fitter.load_mlx_model(model_draft) if model_draft else None
    settings = fitter.MlxCacheSettings(max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size,
                                       quantized_kv_start=quantized_kv_start, prefill_step_size=prefill_step_size)
    pc = None  # mlx_lm.server's utils._parse_size: a bare number is bytes
    if prompt_cache_bytes:
        pc = (int(prompt_cache_bytes) if prompt_cache_bytes.strip().isdigit()
              else fitter.parse_size(prompt_cache_bytes, what="--prompt-cache-bytes"))
    run = fitter.MlxRun(n_ctx=n_ctx or 256, max_tokens=max_tokens, cache=settings, prompt_cache_bytes=pc,
                        num_draft_tokens=draft_n_max)
    spec = m.spec
    n_max = spec.max_position_embeddings or 262144
    if n_ctx is None:
        best, pred = fitter.largest_context_mlx(m, run, available, n_max, draft)
        if pred is None:
            pred = fitter.predict_mlx(m, run, draft)
    else:
        best, pred = 0, fitter.predict_mlx(m, run, draft)
    total = pred.total_device_bytes
    fits = total <= available
    sess, proposal, sess_fits = mlx_session(m, pred.run, draft, available, requests=session_requests,
                                            prompt_cache_size=prompt_cache_size)
    if as_json:
        print(json.dumps({
            "engine": "mlx", "mlx_lm": fitter.mlx_label(), "budget_bytes": bud.bytes, "budget_source": bud.source,
            "margin_bytes": margin_bytes, "n_ctx": pred.run.n_ctx, "largest_n_ctx": best if n_ctx is None else None,
            "config": {"max_tokens": max_tokens, "max_kv_size": max_kv_size, "kv_bits": kv_bits,
                       "kv_group_size": kv_group_size, "quantized_kv_start": quantized_kv_start,
                       "prefill_step_size": prefill_step_size, "prompt_cache_bytes": pc},
            "buffers": [b.model_dump(mode="json") for b in pred.buffers], "total_device_bytes": total,
            "fits": fits, "headroom_bytes": available - total, "warnings": pred.warnings,
            "session": session_json(sess, proposal, sess_fits),
        }, indent=2))
    else:
        print(f"model    {model} ({spec.model_type}, "
              + (f"{spec.quant_bits}-bit" if spec.quant_bits else spec.act_dtype) + f", {mib(m.file_bytes)} on disk)")
        print(f"engine   mlx, {fitter.mlx_label()}")
        print(f"budget   {mib(bud.bytes)} ({bud.source}), margin {mib(margin_bytes)} -> {mib(available)} available")
        if n_ctx is None:
            print(f"\nlargest context: -c {best} (prompt + --max-tokens {max_tokens}; the model's limit {n_max:,})"
                  if best else "\nnothing fits, not even -c 256")
        print()
        print_breakdown(pred, available)
        for w in pred.warnings:
            print("warning: " + w)
        print_session(sess, proposal, available)
        if fits:
            flags = [f"--model {model}", f"--prefill-step-size {prefill_step_size}", f"--max-tokens {max_tokens}"]
            flags += [f"--kv-bits {kv_bits}", f"--kv-group-size {kv_group_size}"] if kv_bits else []
            flags += [f"--prompt-cache-bytes {pc}"] if pc is not None else []
            flags += [f"--prompt-cache-size {prompt_cache_size}"] if prompt_cache_size != 10 else []
            flags += [f"--draft-model {model_draft}", f"--num-draft-tokens {draft_n_max}"] if model_draft else []
            print("\nmlx_lm.server \\\n  " + " \\\n  ".join(flags))
    if not fits or (session_requests and not sess_fits):
        raise typer.Exit(1)
