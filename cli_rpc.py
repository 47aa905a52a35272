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
    """The backend with --rpc: a CPU main host with RPC devices beside it; a local GPU beside RPC devices is not
    modelled yet."""
    from fitter.ggml import backends

    impl = backends.get(be)
    if rpc is None:
        if impl.remote:
            raise fitter.ConfigError(f"--backend {be.value}: name the servers with --rpc HOST:PORT[,HOST:PORT...]")
        return be
    from fitter.ggml.backends.rpc.protocol import parse_endpoints

    parse_endpoints(rpc)
    if impl.is_gpu and not impl.remote:
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
