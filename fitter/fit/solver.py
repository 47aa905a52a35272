"""Solve for the largest context that fits a budget, per ubatch and K/V type pair, and recommend one.

The device total grows with n_ctx (KV cells and attention scratch grow) and is piecewise linear, so the
largest n_ctx (a multiple of 256: llama.cpp pads n_ctx to 256 anyway) is found by interpolation inside an
exact bracket (`largest_fitting`, fitter.fit.largest), in a handful of predictions.

It is not strictly monotone. ggml-alloc's placement can leave a compute buffer smaller at a larger context:
llama.cpp's own dry run of gemma3-270m on the CPU (-ub 2048 -ctk f32 -ctv f32 -fa on --swa-full -np 1) reserves
95.83 MiB at -c 2816 and 93.08 MiB at -c 3072. Where the compute buffer falls by more than the KV cache grows, or
the KV cache is not on the device (a partial offload), the device total falls too: for gpt-oss-20b on CUDA (-ub
2048 -ctk f32 -ctv f32 -fa on -np 2 --kv-unified) ggfit predicts 16.5 MiB less compute and 12 MiB more KV at
-c 11520 than at 11264. The answer is then a context that fits with the next step predicted over the budget, as a
binary search's is; a larger context past the dip may fit too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any, Literal

from fitter.fit.largest import Hint, _extrapolated, largest_fitting, next_hint
from fitter.fit.memory import Prediction, predict
from fitter.ggml import backends
from fitter.gguf.reader import GGUFHeader
from fitter.llama.cparams import DEFAULT_N_BATCH, Backend, ConfigError, Frontend, RunConfig, resolve_context
from fitter.llama.hparams import ModelSpec
from fitter.llama_builds import PINNED, LlamaBuild
from fitter.record import Record

# what the prediction may use: one number (the device total), or per device buffer name (CUDA0, CUDA1, ...: one
# budget per GPU, each less the margin)
Available = int | dict[str, int]


def excess(pred: Prediction, available: Available) -> int:
    """How far over its budget the fullest device is (<= 0: it fits)."""
    if isinstance(available, int):
        return pred.total_device_bytes - available
    totals = pred.device_totals()
    return max(totals.get(name, 0) - a for name, a in available.items())


UBATCHES = (256, 512, 1024, 2048, 4096)
KV_PAIRS = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"))
KV_QUALITY = {"f32": 4, "f16": 3, "bf16": 3, "q8_0": 2, "q5_1": 1, "q5_0": 1, "q4_1": 0, "q4_0": 0, "iq4_nl": 0}
CTX_STEP = 256


class Solution(Record):
    n_ubatch: int
    n_batch: int
    type_k: str
    type_v: str
    draft: bool
    n_ctx: int  # largest fitting context (0: not even 256 fits)
    total_device_bytes: int  # at that context
    headroom_bytes: int  # budget - margin - total

    @property
    def fits(self) -> bool:
        return self.n_ctx > 0


def table_ubatches(spec: ModelSpec, n_batch: int | None, n_ubatch: int | None) -> tuple[int, ...]:
    """The ubatches fit's table solves for: the one llama.cpp runs for a -ub or -b given (llama_context::llama_context:
    n_ubatch = min(n_batch, -ub), n_batch = min(n_ctx, -b); the contexts stop at n_ctx_train), else UBATCHES (a -b
    that holds each is ggfit's proposal: _config_for)."""
    if n_batch is None and n_ubatch is None:
        return UBATCHES
    cap = min(n_batch if n_batch is not None else DEFAULT_N_BATCH, spec.n_ctx_train)
    return tuple(sorted({min(u, cap) for u in ((n_ubatch,) if n_ubatch is not None else UBATCHES)}))


def batch_for(base: RunConfig, ub: int) -> int:
    """-b for a solution at ubatch `ub`: the user's -b as given (table_ubatches keeps ub within it), else the default
    or, for a larger ubatch, -b = -ub (ggfit's proposal: llama.cpp would cap n_ubatch at the default n_batch)."""
    return base.n_batch if base.n_batch is not None else max(DEFAULT_N_BATCH, ub)


def _config_for(base: RunConfig, n_ctx: int, ub: int, tk: str, tv: str, draft: bool) -> RunConfig:
    n_batch = batch_for(base, ub)
    update = {"n_ctx": n_ctx, "n_ubatch": ub, "n_batch": n_batch, "type_k": tk, "type_v": tv}
    if not draft:
        update.update({"spec_type": "none", "draft_model": None})
    return base.model_copy(update=update)


def largest_context(
    header: GGUFHeader,
    spec: ModelSpec,
    base: RunConfig,
    backend: Backend,
    frontend: Frontend,
    available: Available,
    *,
    n_ubatch: int,
    type_k: str,
    type_v: str,
    with_draft: bool,
    draft: tuple[GGUFHeader, ModelSpec] | None,
    ctx_max: int,
    build: LlamaBuild = PINNED,
    hint: Hint | None = None,
    asked: dict[int, int] | None = None,
) -> Solution:
    """The largest context that fits (a Solution); `hint` and `asked` as largest_fitting's, in CTX_STEP steps."""
    totals: dict[int, int] = {}

    def over(steps: int) -> int:  # grows with the context on every device (the module's docstring: not strictly)
        cfg = _config_for(base, steps * CTX_STEP, n_ubatch, type_k, type_v, with_draft)
        p = predict(header, spec, cfg, backend, frontend, draft if with_draft else None, build=build, terms=False)
        totals[steps] = p.total_device_bytes
        return excess(p, available)

    steps, worst = largest_fitting(over, 0, ctx_max // CTX_STEP, hint=hint, asked=asked)
    n_batch = batch_for(base, n_ubatch)
    return Solution(
        n_ubatch=n_ubatch, n_batch=n_batch, type_k=type_k, type_v=type_v, draft=with_draft,
        n_ctx=steps * CTX_STEP, total_device_bytes=totals.get(steps, 0) if steps else 0,
        headroom_bytes=-worst if steps else (available if isinstance(available, int) else min(available.values())),
    )


def solve(
    header: GGUFHeader,
    spec: ModelSpec,
    base: RunConfig,
    backend: Backend,
    frontend: Frontend,
    budget_bytes: int,
    margin_bytes: int,
    *,
    draft: tuple[GGUFHeader, ModelSpec] | None = None,
    ubatches: tuple[int, ...] = UBATCHES,
    kv_pairs: tuple[tuple[str, str], ...] = KV_PAIRS,
    ctx_max: int | None = None,
    build: LlamaBuild = PINNED,
    per_device: dict[str, int] | None = None,
    margins: dict[str, int] | None = None,
) -> list[Solution]:
    """Largest n_ctx for every ubatch x K/V pair, with and without the draft (or MTP head). `per_device`: the budget
    of each GPU by buffer name (the margin is taken from each: `margins`' where it names the device)."""
    available: Available = budget_bytes - margin_bytes
    if per_device:
        available = {name: b - (margins or {}).get(name, margin_bytes) for name, b in per_device.items()}
    ctx_max = ctx_max or spec.n_ctx_train
    has_spec = draft is not None or base.spec_type == "draft-mtp"
    out = []
    for with_draft in ((True, False) if has_spec else (False,)):
        for tk, tv in kv_pairs:
            if base.flash_attn == "off" and tv not in ("f16", "f32", "bf16"):
                continue  # quantized V needs flash attention
            hint = None  # each ubatch's search starts where the last one's ended (largest_fitting)
            slopes: list[tuple[int, int]] = []  # (ubatch, bytes per step) of the searches that measured one
            for ub in ubatches:
                asked: dict[int, int] = {}
                try:
                    sol = largest_context(
                        header, spec, base, backend, frontend, available, n_ubatch=ub, type_k=tk, type_v=tv,
                        with_draft=with_draft, draft=draft, ctx_max=ctx_max, build=build,
                        hint=_extrapolated(hint, slopes, ub), asked=asked,
                    )
                except ConfigError:
                    continue  # a pair llama.cpp refuses for this model (block size, MLA K != V)
                out.append(sol)
                hint = next_hint(asked, sol.n_ctx // CTX_STEP, hint)
                if hint is not None and len(asked) > 1:
                    slopes.append((ub, hint[1]))
    return out


def recommend(solutions: list[Solution], ctx_target: int) -> Solution | None:
    """The config to run: keep the draft if it still reaches the target context, prefer the best K/V
    type that reaches it, then the largest ubatch up to 2048 (prefill speed); if nothing reaches the
    target, the largest context."""
    fitting = [s for s in solutions if s.fits]
    if not fitting:
        return None
    reach = [s for s in fitting if s.n_ctx >= ctx_target]
    if reach:
        return max(reach, key=lambda s: (s.draft, KV_QUALITY.get(s.type_v, 0) + KV_QUALITY.get(s.type_k, 0),
                                         min(s.n_ubatch, 2048), -s.n_ubatch, s.headroom_bytes))
    return max(fitting, key=lambda s: (s.n_ctx, s.draft, KV_QUALITY.get(s.type_v, 0), min(s.n_ubatch, 2048)))


def prediction_for(
    header: GGUFHeader, spec: ModelSpec, base: RunConfig, backend: Backend, frontend: Frontend, s: Solution,
    draft: tuple[GGUFHeader, ModelSpec] | None = None, *, build: LlamaBuild = PINNED,
) -> Prediction:
    cfg = _config_for(base, s.n_ctx, s.n_ubatch, s.type_k, s.type_v, s.draft)
    return predict(header, spec, cfg, backend, frontend, draft if s.draft else None, build=build)


class Alternative(Record):
    """One change that makes an over-budget config fit (what `fit` suggests, one change at a time)."""

    flags: list[str]  # the llama-server flags to change, one item per flag ([]: drop the draft / nothing fits)
    reason: str  # e.g. "fits at -c 32768", "largest context that fits", "no context fits with these settings"
    update: dict[str, Any] | None = None  # the RunConfig fields this change sets (None: nothing fits)

    @property
    def line(self) -> str:
        if not self.flags:
            return self.reason
        return " ".join(self.flags) + ("" if self.reason == "largest context that fits" else f" ({self.reason})")


def what_to_change(header: GGUFHeader, spec: ModelSpec, cfg: RunConfig, backend: Backend, frontend: Frontend,
                   available: Available, draft: tuple[GGUFHeader, ModelSpec] | None, pred: Prediction, *,
                   build: LlamaBuild = PINNED) -> list[Alternative]:
    """For a prediction over budget: the largest context that fits, and each other single change (a quantized K/V
    cache, a smaller ubatch, no draft) that keeps the requested context."""
    cp = pred.context
    with_draft = draft is not None or cfg.spec_type == "draft-mtp"
    fits_at = f"fits at -c {cp.n_ctx}"

    def largest(base: RunConfig, *, ub: int = cp.n_ubatch, tk: str = cp.type_k, tv: str = cp.type_v,
                drafted: bool = with_draft) -> int:
        return largest_context(header, spec, base, backend, frontend, available, n_ubatch=ub, type_k=tk, type_v=tv,
                               with_draft=drafted, draft=draft if drafted else None, ctx_max=cp.n_ctx,
                               build=build).n_ctx

    n_ctx = largest(cfg)
    out = [Alternative(flags=[f"-c {n_ctx}"], reason="largest context that fits", update={"n_ctx": n_ctx}) if n_ctx
           else Alternative(flags=[], reason="no context fits with these settings")]
    # a quantized V cache needs flash attention: suggest both together when it is off
    fa_cfg, fa_flags = (cfg, []) if cp.flash_attn else (cfg.model_copy(update={"flash_attn": "on"}), ["-fa on"])
    for tk, tv in (("q8_0", "q8_0"), ("q4_0", "q4_0")):
        if (tk, tv) != (cp.type_k, cp.type_v):
            try:
                n_ctx = largest(fa_cfg, tk=tk, tv=tv)
            except ConfigError:
                continue  # llama.cpp refuses this pair for the model (block size, MLA)
            if n_ctx >= cp.n_ctx:
                out.append(Alternative(flags=[*fa_flags, f"-ctk {tk}", f"-ctv {tv}"], reason=fits_at,
                                       update={"type_k": tk, "type_v": tv, "flash_attn": fa_cfg.flash_attn}))
                break
    for ub in (1024, 512, 256):
        if ub < cp.n_ubatch and largest(cfg, ub=ub) >= cp.n_ctx:
            out.append(Alternative(flags=[f"-ub {ub}"], reason=fits_at, update={"n_ubatch": ub}))
            break
    if with_draft and largest(cfg, drafted=False) >= cp.n_ctx:
        out.append(Alternative(flags=[], reason=f"drop the draft model ({fits_at})",
                               update={"spec_type": "none", "draft_model": None}))
    return out


class PlacementChoice(Record):
    """Where the weights go when the model does not fit the device as given: MoE experts of the first N layers on
    the CPU (--n-cpu-moe N, every layer still on the GPU), or fewer layers on the GPU (-ngl N) for a dense model."""

    lever: Literal["n_cpu_moe", "n_gpu_layers"]
    value: int
    n_ctx: int  # the context it was solved for
    total_device_bytes: int
    host_bytes: int  # what lands in system RAM (Prediction.host_bytes)
    headroom_bytes: int  # device budget - margin - total
    host_headroom_bytes: int | None  # host budget - host bytes (None: no host budget)
    # (value of the lever, the largest context that fits the device with it)
    table: list[tuple[int, int]] = field(default_factory=list)
    n_cpu_moe: int = 0  # with -ngl as the lever: the experts already all on the CPU when the model is MoE

    @property
    def update(self) -> dict[str, int]:
        """The RunConfig fields of this placement."""
        out: dict[str, int] = {self.lever: self.value}
        if self.lever == "n_gpu_layers" and self.n_cpu_moe:
            out["n_cpu_moe"] = self.n_cpu_moe
        return out

    @property
    def flags(self) -> list[str]:
        if self.lever == "n_cpu_moe":
            return ["--n-cpu-moe", str(self.value)]
        return (["--n-cpu-moe", str(self.n_cpu_moe)] if self.n_cpu_moe else []) + ["-ngl", str(self.value)]


def solve_placement(
    header: GGUFHeader,
    spec: ModelSpec,
    base: RunConfig,
    backend: Backend,
    frontend: Frontend,
    available: Available,
    host_available: int | None,
    *,
    draft: tuple[GGUFHeader, ModelSpec] | None = None,
    table: bool = True,
    build: LlamaBuild = PINNED,
) -> tuple[PlacementChoice | None, str]:
    """The placement that fits `base` (its -c, -ub, K/V types) on the device with the most on the GPU: for a MoE
    model every layer stays on the GPU and the experts of the first N layers go to the CPU, the smallest N that fits
    (what --n-cpu-moe does; llama.cpp's --fit also moves experts first); a dense model, or a MoE model whose
    attention and shared weights alone do not fit, gets the largest -ngl that fits. Host memory grows as the device's
    shrinks: a placement over `host_available` (the host budget less its margin) is refused. Returns the choice, or None and why not."""
    refusal = backends.get(backend).placement_refusal()
    if refusal:
        return None, refusal
    placer = _Placer(header, spec, backend, frontend, available, host_available, draft, table, build)
    # before #15077 (b6089) llama-server has no --n-cpu-moe to propose: the lever is -ngl
    if spec.n_expert > 0 and not base.cpu_moe and not base.override_tensor and build.has("n_cpu_moe_flag"):
        found = placer.by_experts(base)
        if found is not None:
            return found
        base = base.model_copy(update={"n_cpu_moe": spec.n_layer})  # experts all on the CPU, and fewer layers too
    return placer.by_layers(base)


class _Placer:
    """solve_placement's predictions (totals and host bytes only) and its two levers."""

    def __init__(self, header: GGUFHeader, spec: ModelSpec, backend: Backend, frontend: Frontend, available: Available,
                 host_available: int | None, draft: tuple[GGUFHeader, ModelSpec] | None, table: bool,
                 build: LlamaBuild) -> None:
        self.header, self.spec, self.backend, self.frontend = header, spec, backend, frontend
        self.available, self.host_available, self.draft, self.table, self.build = (
            available, host_available, draft, table, build)

    def pred(self, cfg: RunConfig) -> Prediction:
        return predict(self.header, self.spec, cfg, self.backend, self.frontend, self.draft, build=self.build,
                       terms=False)

    def fits(self, p: Prediction) -> bool:
        return excess(p, self.available) <= 0

    def by_experts(self, base: RunConfig) -> tuple[PlacementChoice | None, str] | None:
        """The smallest --n-cpu-moe that fits, every layer on the GPU; None when not even all experts on the CPU do."""
        def at(n: int) -> Prediction:
            return self.pred(base.model_copy(update={"n_cpu_moe": n}))

        if self.fits(at(base.n_cpu_moe)):
            return self.choice(base, "n_cpu_moe", base.n_cpu_moe, at(base.n_cpu_moe))
        n_layer = self.spec.n_layer
        if self.fits(at(n_layer)):
            # at(n_cpu_moe) does not fit, at(n_layer) does: device bytes fall as N grows
            n = _first_true(base.n_cpu_moe, n_layer, lambda n: self.fits(at(n)))
            return self.choice(base, "n_cpu_moe", n, at(n))
        return None

    def by_layers(self, base: RunConfig) -> tuple[PlacementChoice | None, str]:
        """The largest -ngl that fits."""
        n_all = len(self.spec.layers) + 1  # -ngl counts the output layer

        def at_ngl(n: int) -> Prediction:
            return self.pred(base.model_copy(update={"n_gpu_layers": n}))

        if not self.fits(at_ngl(0)):
            return None, "not even -ngl 0 fits: the context alone is over the budget (lower -c, -ub or the K/V type)"
        top = min(n_all, base.n_gpu_layers if base.n_gpu_layers >= 0 else n_all)
        # at_ngl(0) fits: the largest -ngl that does (device bytes grow with it)
        n = top if self.fits(at_ngl(top)) else _first_true(0, top, lambda n: not self.fits(at_ngl(n))) - 1
        return self.choice(base, "n_gpu_layers", n, at_ngl(n))

    def choice(self, base: RunConfig, lever: Literal["n_cpu_moe", "n_gpu_layers"], value: int,
               p: Prediction) -> tuple[PlacementChoice | None, str]:
        host, host_available = p.host_bytes, self.host_available
        if host_available is not None and host > host_available:
            what = "--n-cpu-moe" if lever == "n_cpu_moe" else "-ngl"
            return None, (f"{what} {value} fits the device but needs {host / 2**20:,.0f} MiB of host memory, over the "
                          f"{host_available / 2**20:,.0f} MiB the host budget leaves after its margin")
        rows = (_placement_table(self.header, self.spec, base, self.backend, self.frontend, self.available, self.draft,
                                 lever, value, self.build) if self.table else [])
        return PlacementChoice(
            lever=lever, value=value, n_ctx=p.context.n_ctx, total_device_bytes=p.total_device_bytes, host_bytes=host,
            headroom_bytes=-excess(p, self.available),
            host_headroom_bytes=None if host_available is None else host_available - host, table=rows,
            n_cpu_moe=base.n_cpu_moe), ""


def _first_true(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest n in (lo, hi] with ok(n), given ok is false at lo, true at hi and monotone between."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _placement_table(header: GGUFHeader, spec: ModelSpec, base: RunConfig, backend: Backend, frontend: Frontend,
                     available: Available, draft: tuple[GGUFHeader, ModelSpec] | None, lever: str,
                     chosen: int, build: LlamaBuild) -> list[tuple[int, int]]:
    """The largest context that fits the device at a few values of the lever around the choice (the trade-off: more
    on the GPU, or a longer context)."""
    top = spec.n_layer if lever == "n_cpu_moe" else len(spec.layers) + 1
    values = sorted({v for v in (0, top // 4, top // 2, 3 * top // 4, top, chosen) if 0 <= v <= top})
    cp = resolve_context(spec, base, frontend, build=build)
    out = []
    for v in values:
        cfg = base.model_copy(update={lever: v})
        try:
            s = largest_context(header, spec, cfg, backend, frontend, available, n_ubatch=cp.n_ubatch,
                                type_k=cp.type_k, type_v=cp.type_v, with_draft=draft is not None, draft=draft,
                                ctx_max=spec.n_ctx_train, build=build)
        except ConfigError:
            continue
        out.append((v, s.n_ctx))
    return out
