"""`fit --rpc` with several servers: which of them to use, weighing the network (issue 47 with the speed model).

A single sequence runs the layers one device after the other, so spreading them over more servers adds no speed:
each server the layers pass through adds its inputs, its graph and a round trip per token (fitter.speed.network).
For every set of the servers (in --rpc order) whose split (fitter.fit.split.propose_split) fits the context `fit`
shows, the speed model's rates with that --rpc and -ts; the fastest first, each with its cost against it in tok/s,
its round trips and bytes per token.
"""

from __future__ import annotations

from itertools import combinations
from typing import TYPE_CHECKING, Any, NamedTuple

from fitter.fit.memory import predict
from fitter.fit.solver import CTX_STEP, excess
from fitter.fit.split import propose_split
from fitter.llama_builds import PINNED, LlamaBuild

if TYPE_CHECKING:
    from fitter.fit.memory import Prediction
    from fitter.fit.request import Speed
    from fitter.gguf.reader import GGUFHeader
    from fitter.llama.cparams import Backend, Frontend, RunConfig
    from fitter.llama.hparams import ModelSpec

MAX_SERVERS = 4  # sets of at most this many servers are tried (2^4 - 1 = 15 splits)


class ServerChoice(NamedTuple):
    rpc: str  # --rpc of this set
    tensor_split: tuple[float, ...]
    n_ctx: int  # the largest context its split fits
    prefill_tps: float
    decode_tps: float
    seconds: float  # one request: the prompt, then 128 decoded tokens
    round_trips: int  # per decoded token
    bytes_token: int  # over the network per decoded token

    @property
    def flags(self) -> str:
        return f"--rpc {self.rpc} -ts {','.join(f'{x:g}' for x in self.tensor_split)}"


class NetworkChoice(NamedTuple):
    text: list[str]  # the lines `fit` prints
    json: dict  # --json's "split_network"


def _choice(header: GGUFHeader, spec: ModelSpec, base: RunConfig, backend: Backend, frontend: Frontend,
            avail: dict[str, int], eps: list[str], n_ctx: int, speed: Speed, build: LlamaBuild) -> ServerChoice | None:
    """The split over these servers (RPC0.. renumbered) and its rates at n_ctx, or None where it does not fit."""
    from fitter.speed.network import Network, layout_of, link_of, ubatch_traffic

    cfg = base.model_copy(update={"rpc": ",".join(eps)})
    sub = {f"RPC{k}": b for k, b in enumerate(avail.values())}
    sp = propose_split(header, spec, cfg, backend, frontend, sub, ctx_max=n_ctx, build=build)
    if not sp.tensor_split or sp.n_ctx < n_ctx - n_ctx % CTX_STEP:
        return None
    cfg = cfg.model_copy(update={"n_ctx": n_ctx, "tensor_split": sp.tensor_split})
    if sp.n_ctx < n_ctx and excess(predict(header, spec, cfg, backend, frontend, build=build, terms=False), sub) > 0:
        return None
    res = speed.predict(header, spec, cfg, backend, len(eps))
    if res is None:
        return None
    rates = res[0]
    net = Network(layout_of(spec, cfg, len(eps)), link_of(eps, speed.rpc_bandwidth, speed.rpc_latency))
    t = ubatch_traffic(net.layout, 1, 1, rates.depth + 1, new_graph=False)
    return ServerChoice(cfg.rpc or "", sp.tensor_split, sp.n_ctx, rates.prefill_tps, rates.decode_tps,
                        rates.seconds(), t.round_trips, t.sent + t.received)


def network_choices(header: GGUFHeader, spec: ModelSpec, cfg: RunConfig, pred: Prediction, backend: Backend,
                    frontend: Frontend, avail: dict[str, int], speed: Speed | None,
                    build: LlamaBuild = PINNED) -> NetworkChoice | None:
    """The sets of --rpc's servers whose split fits the prediction's context, fastest first; None with one server,
    more than MAX_SERVERS, or no rates."""
    from fitter.ggml.backends.rpc.protocol import parse_endpoints
    from fitter.speed.network import link_of

    eps = parse_endpoints(cfg.rpc or "")
    if speed is None or not speed.on or not 1 < len(eps) <= MAX_SERVERS or len(avail) != len(eps):
        return None
    cp = pred.context
    base = cfg.model_copy(update={"n_ubatch": cp.n_ubatch, "n_batch": cp.n_batch, "type_k": cp.type_k,
                                  "type_v": cp.type_v, "spec_type": "none", "draft_model": None})
    budgets = list(avail.values())
    found: list[ServerChoice] = []
    for k in range(1, len(eps) + 1):
        for idx in combinations(range(len(eps)), k):
            c = _choice(header, spec, base, backend, frontend, {f"RPC{i}": budgets[i] for i in idx},
                        [eps[i] for i in idx], cp.n_ctx, speed, build)
            if c is not None:
                found.append(c)
    if not found:
        return None
    found.sort(key=lambda c: (c.seconds, len(c.tensor_split)))
    best = found[0]
    link = link_of(eps, speed.rpc_bandwidth, speed.rpc_latency)
    text = [f"servers by speed (network {link.source}, {link.bandwidth_gbs * 1e3:,.0f} MB/s, {link.latency_ms:g} ms "
            f"ping; one request: pp{speed.prompt} then tg128), of the {len(found)} set(s) whose split fits -c "
            f"{cp.n_ctx}:"]
    for c in found:
        cost = "fastest" if c is best else f"-{best.decode_tps - c.decode_tps:,.1f} tok/s decode"
        text.append(f"  {c.flags}: prefill {c.prefill_tps:,.1f} tok/s, decode {c.decode_tps:,.1f} tok/s ({cost}); "
                    f"{c.round_trips} round trip(s) and {c.bytes_token / 1e6:,.3f} MB per token")
    js: dict[str, Any] = {"link": link._asdict(), "n_ctx": cp.n_ctx,
                          "choices": [{**c._asdict(), "flags": c.flags} for c in found]}
    return NetworkChoice(text, js)
