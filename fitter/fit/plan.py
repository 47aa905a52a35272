"""One path from a request to a plan (issue 45): `plan(FitRequest) -> Plan` is `ggfit fit`'s whole decision, and
`plan_quants(QuantsRequest) -> QuantsPlan` is `ggfit quants`'. The CLI only parses into the request; output only
prints the plan (fitter/README.md has the diagram).

    resolve the model and the draft -> predict the config as given, or (no -c) solve the table and recommend
    -> where it does not fit: a placement (--n-cpu-moe, else -ngl) -> the fastest placement that fits (speed)
    -> what fits instead -> the build's differences -> llama-server's flags and the rates of what is printed

`check(plan)` runs llama.cpp's own dry run (or llama-fit-params) beside it, when the request asks."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import field
from typing import TYPE_CHECKING, Any

from fitter.bundled import resolve_model
from fitter.fit import solver
from fitter.fit.memory import build_differences, predict, repack_applies
from fitter.ggml import backends
from fitter.llama.cparams import served_config
from fitter.llama.model import load_model_spec
from fitter.record import Record

if TYPE_CHECKING:
    from fitter.fit.fastest import SpeedOption
    from fitter.fit.memory import BuildDifference, Prediction
    from fitter.fit.quant_fit import Candidate
    from fitter.fit.request import Budgets, FitRequest, QuantsRequest, Speed, SpeedResult
    from fitter.fit.sizes import Budget
    from fitter.ggml.backends.base import Backend, BackendImpl
    from fitter.gguf.reader import GGUFHeader
    from fitter.llama.cparams import ContextParams, Frontend, RunConfig
    from fitter.llama.hparams import ModelSpec
    from fitter.llama_builds import LlamaBuild

Draft = tuple["GGUFHeader", "ModelSpec"]


class Plan(Record, frozen=False):
    """What `fit` found for a request: the prediction shown (at the recommended solution when it solved for the
    context), the table, the placement, what fits instead, the flags and the rates. Read-only once plan() returns
    (check() adds the measurement)."""

    request: FitRequest
    path: str  # the model, resolved
    header: GGUFHeader
    spec: ModelSpec
    draft: Draft | None
    cfg: RunConfig  # the flags as solved (with the table's placement where one was needed)
    pred: Prediction
    solutions: list[solver.Solution] = field(default_factory=list)
    rec: solver.Solution | None = None
    table_placement: solver.PlacementChoice | None = None  # no -c, and the placement given fit no context
    placement: solver.PlacementChoice | None = None  # where the config as given does not fit
    placement_why: str = ""
    placement_cfg: RunConfig | None = None
    speed_options: list[SpeedOption] | None = None  # the placements that fit, fastest first
    alternatives: list[solver.Alternative] = field(default_factory=list)  # what fits instead, one change at a time
    differences: list[BuildDifference] = field(default_factory=list)  # the build's rules that differ from the pin
    flags: list[str] | None = None  # llama-server's flags, where it fits
    placement_flags: list[str] | None = None  # llama-server's flags with ggfit's placement
    rates: SpeedResult | None = None  # the rates of the config printed
    placed_rates: SpeedResult | None = None  # the rates with ggfit's placement
    measured: dict[str, Any] | None = None  # --check: llama.cpp's dry run
    fit_params: dict[str, Any] | None = None  # --check with --llama-bin: llama-fit-params
    # issue 47 (--rpc): the -ts over the RPC devices that fits the largest context, and what each host holds
    rpc_split: Any = None  # fitter.fit.split.SplitProposal
    rpc_hosts: dict[str, Any] | None = None
    rpc_network: Any = None  # fitter.fit.split_network.NetworkChoice: the servers' sets by speed
    # issue 48: what llama-server holds over the request's session (fitter.session.fit.FitSession; None: not asked,
    # or not llama-server)
    session: Any = None

    # --- the request's parts, by the names the output reads ---------------------------------------------------
    @property
    def be(self) -> Backend:
        return self.request.backend

    @property
    def impl(self) -> BackendImpl:
        return backends.get(self.request.backend)

    @property
    def fe(self) -> Frontend:
        return self.request.frontend

    @property
    def build(self) -> LlamaBuild:
        return self.request.build

    @property
    def budgets(self) -> Budgets:
        return self.request.budgets

    @property
    def bud(self) -> Budget:
        return self.budgets.main

    @property
    def host(self) -> Budget | None:
        return self.budgets.host

    @property
    def speed(self) -> Speed | None:
        return self.request.speed

    @property
    def n_gpus(self) -> int:
        return self.request.n_gpus

    @property
    def asked(self) -> dict[str, int | None]:
        """-b and -ub as given (None: not given)."""
        return {"-b": self.request.asked_batch, "-ub": self.request.asked_ubatch}

    @property
    def avail(self) -> int | dict[str, int]:
        return self.budgets.avail

    @property
    def host_avail(self) -> int | None:
        return self.budgets.host_avail

    # --- what the plan concludes ------------------------------------------------------------------------------
    @property
    def pred_draft(self) -> Draft | None:
        """The draft of the prediction shown (None where the recommended solution leaves it out)."""
        return self.draft if (self.rec is None or self.rec.draft) else None

    @property
    def model_draft(self) -> str | None:
        """-md of the prediction shown (None where the recommended solution leaves it out)."""
        return self.request.model_draft if (self.rec is None or self.rec.draft) else None

    @property
    def pred_config(self) -> RunConfig:
        """The config of the prediction shown (the recommended solution's when fit solved for the context)."""
        return served_config(self.pred.context, self.cfg, self.model_draft if self.pred_draft else None)

    @property
    def headroom(self) -> int:
        return -solver.excess(self.pred, self.avail)

    @property
    def fits(self) -> bool:
        """Every GPU within its budget (one budget: the device total), and what lands in RAM within the host budget."""
        if self.host_avail is not None and self.pred.host_bytes > self.host_avail:
            return False
        return solver.excess(self.pred, self.avail) <= 0

    @property
    def verdict(self) -> str:
        """fits (as given; without -c, at the context solved for, with the table's placement if any),
        fits_with_placement (-c, -ub and K/V types as asked, with the placement ggfit found), or does_not_fit."""
        if self.fits:
            return "fits"
        return "fits_with_placement" if self.placement is not None else "does_not_fit"

    @property
    def exit_code(self) -> int:
        """0 when a command fits (fits, fits_with_placement), 1 when none does: in text and JSON alike."""
        return 1 if self.verdict == "does_not_fit" else 0

    def alternative_flags(self, a: solver.Alternative) -> list[str] | None:
        """llama-server's flags of one change of what fits instead (None: a change without a config)."""
        if a.update is None:
            return None
        cfg = self.cfg.model_copy(update=a.update)
        drafted = cfg.spec_type != "none" and (self.rec is None or self.rec.draft)
        p = predict(self.header, self.spec, cfg, self.be, self.fe, self.draft if drafted else None, build=self.build)
        return server_flags(self.path, p.context, cfg, self.request.model_draft if drafted else None, self.spec,
                            self.be, self.n_gpus)


def server_flags(model: str, cp: ContextParams, cfg: RunConfig, draft_path: str | None, spec: ModelSpec | None = None,
                 be: Backend | None = None, n_gpus: int = 1) -> list[str]:
    """llama-server flags for a resolved context, one item per flag; --no-repack only where the extra CPU buffer
    types could take a weight (fitter.fit.memory.repack_applies)."""
    groups = served_config(cp, cfg, draft_path).to_server_args(model)
    if spec is not None and be is not None and not repack_applies(spec, cfg, be, n_gpus):
        groups = [g for g in groups if g != ["--no-repack"]]
    return [" ".join(g) for g in groups]


def nothing_fits_line(p: Plan) -> str:
    """Why no context fits, and what to change: never -ngl on the CPU (no GPU) nor on unified memory."""
    line = ("nothing fits, not even -c 256 with the smallest settings: the weights alone need "
            f"{p.pred.by_kind('model') / 2**20:,.2f} MiB")
    if p.impl.unified_memory:
        line += f" ({p.impl.label}'s memory is unified: weights moved to the CPU free nothing)"
    elif p.impl.is_gpu:
        line += f"; no placement fits either ({p.placement_why})" if p.placement_why else ""
    return line + "; pick a smaller quant or raise the budget"


def plan(req: FitRequest) -> Plan:
    """The request's plan: predict (or solve the table), place, pick the fastest placement, say what fits instead,
    the build's differences, then the flags and rates of what `fit` prints."""
    path = resolve_model(req.model)
    header, spec = load_model_spec(path)
    draft = load_model_spec(resolve_model(req.model_draft)) if req.model_draft else None
    # -c given: one config, each of its graphs (and each placement's, where it does not fit) predicted once
    from fitter.llama.traced_graph import predict_once

    with nullcontext() if req.solve_ctx else predict_once():
        p = _solve(req, path, header, spec, draft)
        _solve_placement(p)
        _choose_fastest(p)
        p.alternatives = _what_fits_instead(p)
        if not req.build.is_pinned:
            p.differences = build_differences(header, spec, p.pred_config, p.be, p.fe, p.pred_draft, p.pred,
                                              n_gpus=p.n_gpus)
    _flags_and_rates(p)
    if req.session is not None:
        from fitter.session.fit import session_of

        p.session = session_of(p, req.session)
    if req.config.rpc:
        _rpc(p)
    return p


def predict_plan(req: FitRequest, *, model: tuple[GGUFHeader, ModelSpec] | None = None,
                 draft: Draft | None = None) -> Plan:
    """The plan of one config as given, nothing solved or placed: a study trial's (FitRequest.trial), compare-engines' and
    `fit -c`'s first step. `model` and `draft`: the model and its draft already read (a study reads each file
    once); else read here."""
    path = resolve_model(req.model) if model is None else req.model
    header, spec = model if model is not None else load_model_spec(path)
    if draft is None and req.model_draft:
        draft = load_model_spec(resolve_model(req.model_draft))
    pred = predict(header, spec, req.config, req.backend, req.frontend, draft, build=req.build)
    return Plan(request=req, path=path, header=header, spec=spec, draft=draft, cfg=req.config, pred=pred)


def _rpc(p: Plan) -> None:
    """--rpc: what each host holds, and with several devices the -ts that fits the largest context."""
    from fitter.fit.split import host_totals, propose_for
    from fitter.ggml.backends.rpc.protocol import parse_endpoints

    p.rpc_hosts = host_totals(p.pred, parse_endpoints(p.cfg.rpc or ""))
    avail = p.avail
    if isinstance(avail, dict):
        # over the layers -ngl as given offloads (all by default), else over those the solver's placement keeps
        asked = p.cfg.model_copy(update={"n_gpu_layers": p.request.config.n_gpu_layers})
        p.rpc_split = propose_for(p.header, p.spec, asked, p.pred, p.be, p.fe, avail, build=p.build)
        if not p.rpc_split.json["n_ctx"] and asked.n_gpu_layers != p.cfg.n_gpu_layers:
            p.rpc_split = propose_for(p.header, p.spec, p.cfg, p.pred, p.be, p.fe, avail, build=p.build)
        from fitter.fit.split_network import network_choices

        p.rpc_network = network_choices(p.header, p.spec, p.cfg, p.pred, p.be, p.fe, avail, p.speed, build=p.build)


def _solve(req: FitRequest, path: str, header: GGUFHeader, spec: ModelSpec, draft: Draft | None) -> Plan:
    """Predict the config as given, or (no -c) solve for the largest context and predict the recommended one; where
    the placement given fits no context, the table is solved again with the placement solve_placement finds."""
    if not req.solve_ctx:
        p = predict_plan(req, model=(header, spec), draft=draft)
        p.path = path
        return p
    kwargs: dict[str, Any] = {"ubatches": solver.table_ubatches(spec, req.asked_batch, req.asked_ubatch)}
    if req.kv_given:
        kwargs["kv_pairs"] = ((req.config.type_k, req.config.type_v),)
    p = _solve_table(req, path, header, spec, draft, req.config, kwargs)
    if p.rec is None:
        p = _place_table(p, kwargs)
    return p


def _solve_table(req: FitRequest, path: str, header: GGUFHeader, spec: ModelSpec, draft: Draft | None,
                 cfg: RunConfig, kwargs: dict[str, Any]) -> Plan:
    be, fe, b, bud = req.backend, req.frontend, req.build, req.budgets
    solutions = solver.solve(header, spec, cfg, be, fe, bud.main.bytes, bud.margin_bytes, draft=draft, build=b,
                             per_device=bud.per_device, margins=bud.margins, **kwargs)
    rec = solver.recommend(solutions, spec.n_ctx_train)
    pred = (solver.prediction_for(header, spec, cfg, be, fe, rec, draft, build=b) if rec else
            predict(header, spec, cfg.model_copy(update={"n_ctx": 256}), be, fe, draft, build=b))
    return Plan(request=req, path=path, header=header, spec=spec, draft=draft, cfg=cfg, pred=pred,
                solutions=solutions, rec=rec)


def _place_table(p: Plan, kwargs: dict[str, Any]) -> Plan:
    """No context fits the placement given: the placement that fits the training context (else 4,096 tokens) at
    the asked -ub and K/V types (fewest --n-cpu-moe for a MoE model, largest -ngl for a dense one: solve_placement),
    and the table solved again with it. The CPU backend has no GPU; unified memory frees nothing."""
    why = ""
    for target in dict.fromkeys((p.spec.n_ctx_train, min(p.spec.n_ctx_train, 4096))):
        base = p.cfg.model_copy(update={"n_ctx": target})  # -ub and -b as given: llama.cpp resolves them
        placed, reason = solver.solve_placement(p.header, p.spec, base, p.be, p.fe, p.avail, p.host_avail,
                                                draft=p.draft, build=p.build)
        why = why or reason
        if placed is not None:
            cfg = p.cfg.model_copy(update=placed.update)
            q = _solve_table(p.request, p.path, p.header, p.spec, p.draft, cfg, kwargs)
            q.table_placement = placed
            return q
    p.placement_why = why
    return p


def _solve_placement(p: Plan) -> None:
    """When the config does not fit (or the context solved for stops short of the training context): the
    placement (--n-cpu-moe, else -ngl) that fits at the asked context (else the training context)."""
    cp = p.pred.context
    if p.fits and (p.rec is None or p.rec.n_ctx >= p.spec.n_ctx_train):
        return
    if not p.impl.is_gpu or p.table_placement is not None or p.placement_why:
        return  # no GPU, or the table's placement was solved already (or why there is none said)
    target = p.cfg.n_ctx if p.cfg.n_ctx is not None else p.spec.n_ctx_train
    base = p.cfg.model_copy(update={"n_ctx": target, "n_ubatch": cp.n_ubatch, "type_k": cp.type_k,
                                    "type_v": cp.type_v})
    if p.rec is not None:
        base = base.model_copy(update={"n_batch": p.rec.n_batch})
    p.placement, p.placement_why = solver.solve_placement(p.header, p.spec, base, p.be, p.fe, p.avail, p.host_avail,
                                                          draft=p.pred_draft, build=p.build)
    if p.placement is not None:
        p.placement_cfg = base.model_copy(update=p.placement.update)


def _choose_fastest(p: Plan) -> None:
    """Fit for speed (fitter.fit.fastest): of the neighbours of ggfit's placement that fit, the fastest for one
    request (--speed-prompt tokens, then 128 decoded); `fit` prints and proposes it, and keeps the ranking."""
    sp = p.speed
    if p.placement is None or p.placement_cfg is None or sp is None or not sp.on:
        return
    assert sp.profile is not None
    if p.be != sp.profile.backend:
        return
    from fitter.fit.fastest import fastest_placements
    from fitter.speed.machine import host_needed

    base = p.placement_cfg
    hw = sp.host(host_needed(p.header, p.spec, base, p.be, p.n_gpus))
    cal = sp.calibration()
    opts = fastest_placements(
        p.header, p.spec, base, p.be, p.fe, p.avail, p.host_avail, p.placement, hw, prompt=sp.prompt, depth=sp.depth,
        threads=sp.threads, scale=cal.scale if cal else None, ubatch_fixed=p.request.asked_ubatch is not None,
        draft=p.pred_draft, n_gpus=p.n_gpus, build=p.build)
    if not opts:
        return
    p.speed_options = opts
    best = opts[0]
    p.placement_cfg = base.model_copy(update=best.update)
    p.placement = p.placement.model_copy(update={
        "value": best.update[p.placement.lever], "total_device_bytes": best.device_bytes,
        "host_bytes": best.host_bytes, "headroom_bytes": best.headroom_bytes,
        "host_headroom_bytes": None if p.host_avail is None else p.host_avail - best.host_bytes})


def _what_fits_instead(p: Plan) -> list[solver.Alternative]:
    """Alternatives, one change at a time, where the config (or without -c every context) does not fit: the
    placement that fits first, then solver.what_to_change's (its "no context fits with these settings" only where no
    placement fits: it speaks of the placement given)."""
    if p.fits:
        return []
    if p.rec is None and p.solutions:
        return [solver.Alternative(flags=[], reason=nothing_fits_line(p))]
    if solver.excess(p.pred, p.avail) <= 0:
        return [solver.Alternative(flags=[], reason=(
            "over the host budget: a placement with less on the CPU, or a larger --host-budget"))]
    alts = solver.what_to_change(p.header, p.spec, p.cfg, p.be, p.fe, p.avail, p.draft, p.pred, build=p.build)
    c = p.placement
    placed = [] if c is None else [solver.Alternative(
        flags=[f"{f} {v}" for f, v in zip(c.flags[::2], c.flags[1::2])],
        reason=f"ggfit's placement, above: fits at -c {c.n_ctx}", update=c.update)]
    return placed + [a for a in alts if a.update is not None or c is None]


def _flags_and_rates(p: Plan) -> None:
    """llama-server's flags of what fits (and of ggfit's placement), and the rates of both."""
    if p.fits:
        p.flags = server_flags(p.path, p.pred.context, p.cfg, p.model_draft, p.spec, p.be, p.n_gpus)
    if p.placement_cfg is not None and p.placement is not None:
        placed = predict(p.header, p.spec, p.placement_cfg, p.be, p.fe, p.pred_draft, build=p.build)
        p.placement_flags = server_flags(p.path, placed.context, p.placement_cfg, p.model_draft, p.spec, p.be,
                                         p.n_gpus)
    sp = p.speed
    if sp is None:
        return
    if p.placement_cfg is not None:
        p.placed_rates = sp.predict(p.header, p.spec, p.placement_cfg, p.be, p.n_gpus)
    p.rates = sp.predict(p.header, p.spec, p.pred_config, p.be, p.n_gpus)


def check(p: Plan) -> None:
    """--check: llama.cpp's own dry run of the config printed (with --llama-bin, its llama-fit-params) beside the
    prediction."""
    req = p.request
    if not req.check:
        return
    from fitter.oracle.check import dry_run_check
    from fitter.oracle.fit_params import FIT_PARAMS_FRONTEND, fit_params_check, fit_params_check_config

    if req.fit_params is not None:
        ccfg = fit_params_check_config(p.pred, p.pred_config)
        cpred = predict(p.header, p.spec, ccfg, p.be, FIT_PARAMS_FRONTEND, build=p.build)
        p.fit_params = fit_params_check(req.fit_params, p.path, ccfg, cpred)
    else:
        p.measured = dry_run_check(p.path, p.pred, req.config)


class QuantsPlan(Record, frozen=False):
    """`quants`' answer: each ftype's (and each --candidate's) sizes and largest context at the request's flags, the
    best fit, and why none fits where none does."""

    request: QuantsRequest
    header: GGUFHeader
    spec: ModelSpec
    candidates: list[Candidate]
    best: Candidate | None
    context: ContextParams | None  # -c given: the context as llama.cpp resolves it (its n_ctx_train warning)
    none_fits: str | None = None

    @property
    def n_ctx(self) -> int:
        return self.candidates[0].n_ctx if self.candidates else 0


def plan_quants(req: QuantsRequest) -> QuantsPlan:
    """Every quant of the request's model at its flags (fitter.fit.quant_fit.evaluate: one prediction per ftype),
    with its rates where the request's speed settings give them."""
    from fitter.fit import quant_fit
    from fitter.llama.cparams import resolve_context

    f = req.fit
    header, spec = load_model_spec(resolve_model(f.model))
    draft = load_model_spec(resolve_model(f.model_draft)) if f.model_draft else None
    context = resolve_context(spec, f.config, f.frontend) if f.config.n_ctx else None
    cands = quant_fit.evaluate(header, spec, f.config, f.backend, f.frontend, f.budgets.main.bytes,
                               f.budgets.margin_bytes, candidates=req.candidates, draft=draft,
                               include_imatrix=req.include_imatrix, build=f.build,
                               rate=f.speed.rates(f.backend) if f.speed is not None else None,
                               per_device=f.budgets.per_device, margins=f.budgets.margins)
    best = quant_fit.best_fit(cands)
    none = (quant_fit.why_none_fits(cands, cands[0].n_ctx, f.backend.value, spec.n_expert > 0)
            if cands and not best else None)
    return QuantsPlan(request=req, header=header, spec=spec, candidates=cands, best=best, context=context,
                      none_fits=none)
