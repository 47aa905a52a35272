"""`--rpc HOST:PORT,...`: llama.cpp's RPC devices for `fit` and friends (issue 47; fitter.ggml.backends.rpc).

The main host's CPU with rpc-servers beside it is the backend `rpc`: its devices are RPC0, RPC1, ... in the order
--rpc names the servers (one device per server unless a server offers several: `--budget auto` asks). `--budget` is
one value for every RPC device, one per device in llama.cpp's order, or `auto`: each server's own answer to
RPC_CMD_GET_DEVICE_MEMORY (a CPU rpc-server reports all its RAM as free, as llama.cpp then splits by)."""

from __future__ import annotations

from typing import Any

import fitter
from fitter.fit.sizes import Budget


def rpc_backend(rpc: str | None, be: Any) -> Any:
    """The backend with --rpc: the CPU main host becomes `rpc`; a local GPU beside RPC devices is not modelled yet."""
    if rpc is None:
        if be.value == "rpc":
            raise fitter.ConfigError("--backend rpc: name the servers with --rpc HOST:PORT[,HOST:PORT...]")
        return be
    from fitter.ggml.backends.rpc.protocol import parse_endpoints

    parse_endpoints(rpc)
    if be.value not in ("cpu", "rpc"):
        raise fitter.ConfigError(f"--rpc with a local {be.value} device: ggfit models RPC devices beside a CPU main "
                                 f"host (--backend cpu); a local GPU with them is not modelled yet")
    return fitter.Backend("rpc")


def rpc_budgets(rpc: str, budget: str) -> list[Budget]:
    """One budget per RPC device, in llama.cpp's device order."""
    from fitter.ggml.backends.rpc.protocol import parse_endpoints, query_devices

    endpoints = parse_endpoints(rpc)
    if str(budget).strip().lower() == "auto":
        return [Budget(bytes=d.free, source=f"RPC{i} {d.endpoint}: the rpc-server's free memory",
                       note="a CPU rpc-server reports all its RAM as free")
                for i, d in enumerate(query_devices(endpoints))]
    buds = fitter.parse_budgets(budget, "rpc")
    if len(buds) == 1:
        return [buds[0].model_copy(update={"source": f"{buds[0].source} (RPC{i} {ep})"})
                for i, ep in enumerate(endpoints)]
    if len(buds) != len(endpoints):  # one device per server (auto asks how many each has)
        raise fitter.ConfigError(f"--budget {budget}: {len(buds)} values for {len(endpoints)} RPC servers; give one "
                                 "per device in --rpc order (RPC0, RPC1, ...), one for all, or auto")
    return buds


def device_budgets(be: Any, buds: list[Budget]) -> dict[str, int]:
    """{device name: budget} for several devices: CUDA0, CUDA1, ... or RPC0, RPC1, ..."""
    from fitter.ggml import backends

    name = backends.get(be).name.rstrip("0123456789")
    return {f"{name}{i}": b.bytes for i, b in enumerate(buds)}


def host_totals(pred: Any, rpc: str | None) -> dict[str, Any] | None:
    """`--json`'s "hosts" with --rpc: what each rpc-server holds (its devices' buffers) and what the main host keeps
    (the host buffers: token embedding, logits, host compute; mapped weights by their tensors' bytes)."""
    if not rpc:
        return None
    from fitter.ggml.backends.rpc.protocol import parse_endpoints

    per_device = pred.device_totals()
    hosts: dict[str, Any] = {ep: {"devices": {}, "bytes": 0} for ep in parse_endpoints(rpc)}
    for i, ep in enumerate(hosts):  # one device per server, RPC0, RPC1, ... in --rpc order
        n = per_device.get(f"RPC{i}", 0)
        hosts[ep]["devices"][f"RPC{i}"] = n
        hosts[ep]["bytes"] += n
    return {**hosts, "main": {"bytes": pred.host_bytes}}


def split_note(r: Any) -> tuple[str, dict[str, Any]] | None:
    """With several RPC devices: the -ts that fits the largest context at the prediction's -ub and K/V types
    (fitter.fit.split), beside what the budgets' own split (llama.cpp's default, by free memory) fits."""
    if not r.per_device or r.pred is None:
        return None
    from fitter.fit.split import propose_split

    cp = r.pred.context
    base = r.cfg.model_copy(update={"n_ubatch": cp.n_ubatch, "n_batch": cp.n_batch, "type_k": cp.type_k,
                                    "type_v": cp.type_v, "spec_type": "none", "draft_model": None})
    sp = propose_split(r.header, r.spec, base, r.be, r.fe, r.avail, build=r.build)
    if not sp.n_ctx:
        return ("split: no -ts fits every device within its budget at -ub "
                f"{cp.n_ubatch}, K/V {cp.type_k}/{cp.type_v}", {"tensor_split": None, "n_ctx": 0})
    ts = ",".join(f"{x:g}" for x in sp.tensor_split)
    totals = sp.pred.device_totals() if sp.pred else {}
    text = (f"split: -ts {ts} (layers per device, the output layer on the last) fits -c {sp.n_ctx} at -ub "
            f"{cp.n_ubatch}, K/V {cp.type_k}/{cp.type_v}: " + ", ".join(
                f"{d} {totals.get(d, 0) / 2**20:,.2f} of {a / 2**20:,.2f} MiB" for d, a in r.avail.items()))
    return text, {"tensor_split": list(sp.tensor_split), "n_ctx": sp.n_ctx, "device_totals": totals}
