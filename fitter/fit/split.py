"""A `-ts` over several devices (RPC servers, GPUs) that fits the largest context, each device within its own budget.

llama_model::load_tensors gives device i the layers whose index over the offloaded ones falls below the i-th
cumulative share of -ts (std::upper_bound): -ts in whole layers (7,6,6) gives each device exactly that many, the
output layer counted on the last. The budgets' own proportions (llama.cpp's split by free memory) ignore that the
last device holds the output layer and the logits, and that a device's compute buffer does not shrink with its
layers: where one device fills first, moving layers off it lets the context grow.

The search: for a context, start from llama.cpp's own split by the budgets (what -ts set to each device's available
bytes gives, whole layers by load_tensors' upper_bound rule: _proportional), then, while a device is over its budget,
move one layer off the device furthest over to the one with the most room (_balance); where that finds nothing, fill
the devices front to back, each with the most layers that keep it within its budget (_fill). The largest such context
is found in CTX_STEP steps by bisection (fits at a context imply fits below it, as for the solver), so where the
context is not what limits (the training context fits), the split stays llama.cpp's by the budgets. Every answer is a
full prediction of the proposed -ts: what it reports is what ggfit predicts llama.cpp allocates.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from fitter.fit.memory import Prediction, predict
from fitter.fit.solver import CTX_STEP, excess
from fitter.gguf.reader import GGUFHeader
from fitter.llama.cparams import Backend, Frontend, RunConfig
from fitter.llama.hparams import ModelSpec
from fitter.llama_builds import PINNED, LlamaBuild


class Split(NamedTuple):
    tensor_split: tuple[float, ...]  # whole layers per device, llama.cpp's device order ((): none fits; 0: none there)
    n_ctx: int
    pred: Prediction | None  # the prediction at that -ts and n_ctx


def _proportional(n_layers: int, shares: list[int]) -> list[int]:
    """Whole layers per device as llama_model::load_tensors assigns them for -ts `shares`: layer il goes to the first
    device whose cumulative share exceeds il / n_layers (std::upper_bound over the normalised cumulative splits)."""
    total = sum(shares)
    if total <= 0:
        shares, total = [1] * len(shares), len(shares)
    cum = [sum(shares[: i + 1]) / total for i in range(len(shares))]
    counts = [0] * len(shares)
    for il in range(n_layers):
        x = il / n_layers
        counts[min(next((i for i, c in enumerate(cum) if c > x), len(cum) - 1), len(cum) - 1)] += 1
    return counts


def _balance(counts: list[int], devices: list[str], over: Callable[[tuple[int, ...]], dict[str, int]],
             ) -> tuple[int, ...] | None:
    """From `counts`, one layer at a time off the device furthest over its budget (`over`: bytes over each device's
    budget, negative: room) onto the device with the most room, until every device fits; None when no device has room
    for it or a split comes back."""
    seen: set[tuple[int, ...]] = set()
    while tuple(counts) not in seen:
        seen.add(tuple(counts))
        o = over(tuple(counts))
        src = max((d for i, d in enumerate(devices) if counts[i] > 0), key=lambda d: o[d])
        if o[src] <= 0:
            return tuple(counts)
        dst = min(devices, key=lambda d: o[d])
        if o[dst] >= 0:
            return None
        counts[devices.index(src)] -= 1
        counts[devices.index(dst)] += 1
    return None


def _fill(n_layers: int, devices: list[str], fits: Callable[[tuple[int, ...], int], bool]) -> tuple[int, ...] | None:
    """Layer counts, front to back, each device with the most layers that keep it within its budget (`fits(counts,
    i)`: device i fits with these counts); None when the last device cannot take what is left."""
    counts: list[int] = []
    for i in range(len(devices) - 1):
        left = n_layers - sum(counts)
        lo, hi = 0, left - (len(devices) - 1 - i)  # leave one layer at least for each device after this one
        while lo < hi:  # the most layers device i keeps within budget (the rest on the last device meanwhile)
            mid = (lo + hi + 1) // 2
            trial = tuple(counts + [mid] + [0] * (len(devices) - 2 - i) + [left - mid])
            if fits(trial, i):
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None
        counts.append(lo)
    counts.append(n_layers - sum(counts))
    return tuple(counts) if counts[-1] > 0 and fits(tuple(counts), len(devices) - 1) else None


class _Splitter:
    """The split search over `available`'s devices at `base`'s flags: each context's whole layers per device (at) and
    the prediction of a split (pred), every prediction made once."""

    def __init__(self, header: GGUFHeader, spec: ModelSpec, base: RunConfig, backend: Backend, frontend: Frontend,
                 available: dict[str, int], build: LlamaBuild) -> None:
        self.args = (header, spec, base, backend, frontend, build)
        self.available, self.devices = available, list(available)
        # the offloaded layers, the output layer counted (llama_model::load_tensors: act_gpu_layers)
        n_all = len(spec.layers) + 1
        self.n_layers = n_all if base.n_gpu_layers < 0 else min(base.n_gpu_layers, n_all)
        self.start = _proportional(self.n_layers, [max(available[d], 0) for d in self.devices])
        self.preds: dict[tuple, Prediction] = {}

    def pred(self, counts: tuple[int, ...], n_ctx: int) -> Prediction:
        key = (counts, n_ctx)
        if key not in self.preds:
            header, spec, base, backend, frontend, build = self.args
            cfg = base.model_copy(update={"n_ctx": n_ctx, "tensor_split": tuple(float(c) for c in counts)})
            self.preds[key] = predict(header, spec, cfg, backend, frontend, build=build, terms=False)
        return self.preds[key]

    def over(self, counts: tuple[int, ...], n_ctx: int) -> dict[str, int]:
        totals = self.pred(counts, n_ctx).device_totals()
        return {d: totals.get(d, 0) - self.available[d] for d in self.devices}

    def at(self, n_ctx: int) -> tuple[int, ...] | None:
        """The split that fits every device at n_ctx (None: none found); llama.cpp's by the budgets where it fits."""
        if self.n_layers < len(self.devices):
            return None
        counts = (_balance(list(self.start), self.devices, lambda c: self.over(c, n_ctx))
                  or _fill(self.n_layers, self.devices, lambda c, i: self.over(c, n_ctx)[self.devices[i]] <= 0))
        return counts if counts is not None and excess(self.pred(counts, n_ctx), self.available) <= 0 else None


def propose_split(header: GGUFHeader, spec: ModelSpec, base: RunConfig, backend: Backend, frontend: Frontend,
                  available: dict[str, int], *, ctx_max: int | None = None, build: LlamaBuild = PINNED) -> Split:
    """The -ts (whole layers per device, in `available`'s order: llama.cpp's device order) that fits the largest
    context at `base`'s -ub and K/V types; n_ctx 0 where none fits even CTX_STEP."""
    sp = _Splitter(header, spec, base, backend, frontend, available, build)
    lo, hi = 0, (ctx_max or spec.n_ctx_train) // CTX_STEP
    best: tuple[int, ...] | None = None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        counts = sp.at(mid * CTX_STEP)
        if counts is not None:
            lo, best = mid, counts
        else:
            hi = mid - 1
    if best is None or lo == 0:
        return Split((), 0, None)
    return Split(tuple(float(c) for c in best), lo * CTX_STEP, sp.pred(best, lo * CTX_STEP))


def split_at(header: GGUFHeader, spec: ModelSpec, cfg: RunConfig, backend: Backend, frontend: Frontend,
             available: dict[str, int], *, build: LlamaBuild = PINNED) -> tuple[float, ...] | None:
    """The -ts ggfit proposes for `cfg` at its own context (optimise's trials: each its own); None where no split
    fits every device there."""
    counts = _Splitter(header, spec, cfg, backend, frontend, available, build).at(cfg.n_ctx or spec.n_ctx_train)
    return tuple(float(c) for c in counts) if counts is not None else None


class SplitProposal(NamedTuple):
    text: str  # the line `fit` prints
    json: dict  # --json's "split"


def propose_for(header: GGUFHeader, spec: ModelSpec, cfg: RunConfig, pred: Prediction, backend: Backend,
                frontend: Frontend, avail: dict[str, int], build: LlamaBuild = PINNED) -> SplitProposal:
    """`fit`'s split over several devices (RPC servers): the -ts that fits the largest context at the prediction's
    -ub and K/V types, with each device's bytes against its budget less the margin."""
    cp = pred.context
    base = cfg.model_copy(update={"n_ubatch": cp.n_ubatch, "n_batch": cp.n_batch, "type_k": cp.type_k,
                                  "type_v": cp.type_v, "spec_type": "none", "draft_model": None})
    sp = propose_split(header, spec, base, backend, frontend, avail, build=build)
    if not sp.n_ctx:
        return SplitProposal("split: no -ts fits every device within its budget at -ub "
                             f"{cp.n_ubatch}, K/V {cp.type_k}/{cp.type_v}", {"tensor_split": None, "n_ctx": 0})
    ts = ",".join(f"{x:g}" for x in sp.tensor_split)
    totals = sp.pred.device_totals() if sp.pred else {}
    ngl = f"-ngl {base.n_gpu_layers} " if base.n_gpu_layers >= 0 else ""
    text = (f"split: {ngl}-ts {ts} (layers per device, the output layer on the last) fits -c {sp.n_ctx} at -ub "
            f"{cp.n_ubatch}, K/V {cp.type_k}/{cp.type_v}: " + ", ".join(
                f"{d} {totals.get(d, 0) / 2**20:,.2f} of {a / 2**20:,.2f} MiB" for d, a in avail.items()))
    return SplitProposal(text, {"tensor_split": list(sp.tensor_split), "n_ctx": sp.n_ctx, "device_totals": totals,
                                "n_gpu_layers": base.n_gpu_layers})


def host_totals(pred: Prediction, endpoints: list[str]) -> dict:
    """`--json`'s "hosts" with --rpc: what each rpc-server holds (its devices' buffers, one device per server: RPC0,
    RPC1, ... in --rpc order) and what the main host keeps: its own GPU's buffers (CUDA0 beside the RPC devices)
    and host memory (token embedding, logits, host compute; mapped weights by their tensors' bytes)."""
    per_device = pred.device_totals()
    hosts: dict[str, dict] = {}
    for i, ep in enumerate(endpoints):
        n = per_device.get(f"RPC{i}", 0)
        hosts[ep] = {"devices": {f"RPC{i}": n}, "bytes": n}
    local = {d: n for d, n in per_device.items() if d not in {f"RPC{i}" for i in range(len(endpoints))}}
    main: dict = {"devices": local, "host_bytes": pred.host_bytes} if local else {}
    return {**hosts, "main": {**main, "bytes": pred.host_bytes + sum(local.values())}}
