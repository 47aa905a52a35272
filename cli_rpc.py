"""`--rpc HOST:PORT,...`: llama.cpp's RPC devices for `fit` and friends (issue 47; fitter.ggml.backends.rpc).

The main host's CPU with rpc-servers beside it is the backend `rpc`; with the main host's CUDA GPU too (`--backend
cuda`), `rpc-cuda`: its devices are RPC0, RPC1, ... in the order --rpc names the servers (one device per server
unless a server offers several: `--budget auto` asks), then CUDA0 (llama_model_load puts RPC devices first).
`--budget` is one value for every device, one per device in llama.cpp's order, or `auto`: each server's own answer to
RPC_CMD_GET_DEVICE_MEMORY (a CPU rpc-server reports all its RAM as free, as llama.cpp then splits by; a Mac's Metal
server its working set less what Metal holds), and the local GPU's free memory as ggfit reads it without --rpc.
`--rpc-backend` names each server's backend (CPU, CUDA, MTL for a Mac) where `auto` does not ask."""

from __future__ import annotations

from typing import Any

from fitter.fit.sizes import Budget


def rpc_backend(rpc: str | None, be: Any) -> Any:
    """The backend with --rpc: a CPU main host (rpc), or a CUDA one (rpc-cuda), with RPC devices beside it."""
    from fitter.ggml import backends
    from fitter.ggml.backends.base import Backend
    from fitter.llama.flags import ConfigError

    impl = backends.get(be)
    if rpc is None:
        if impl.remote:
            raise ConfigError(f"--backend {be.value}: name the servers with --rpc HOST:PORT[,HOST:PORT...]")
        return be
    from fitter.ggml.backends.rpc.protocol import parse_endpoints

    parse_endpoints(rpc)
    if impl.remote:
        return be
    if impl.is_gpu:
        mixed = [b for b in Backend if backends.get(b).local_gpus and backends.get(b).on(1 << 16).kind == be]
        if not mixed:
            raise ConfigError(f"--rpc with a local {be.value} device: ggfit models RPC devices beside a CPU "
                              "main host (--backend cpu) or a CUDA GPU (--backend cuda)")
        return mixed[0]
    return Backend("rpc")


SERVER_BACKENDS = {"CPU": "CPU", "CUDA": "CUDA", "MTL": "MTL", "METAL": "MTL"}  # llama.cpp's registry names


def rpc_backends(rpc: str, budget: str, given: str | None) -> tuple[str, ...]:
    """The backend each server runs (RunConfig.rpc_backends): --rpc-backend (CPU, CUDA, or a Mac's Metal: MTL as
    llama.cpp's registry names it, or METAL), else with --budget auto what each server's buffer type says
    (protocol.RemoteDevice.backend), else every server a CPU one."""
    from fitter.ggml.backends.rpc.protocol import parse_endpoints, query_devices
    from fitter.llama.flags import ConfigError

    endpoints = parse_endpoints(rpc)
    if given:
        words = [k.strip().upper() for k in given.split(",")]
        kinds = tuple(SERVER_BACKENDS.get(k, "") for k in words)
        if "" in kinds or len(kinds) not in (1, len(endpoints)):
            raise ConfigError(f"--rpc-backend {given}: CPU, CUDA or MTL (a Mac's Metal), one per --rpc "
                              f"server ({len(endpoints)}) or one for all")
        return kinds * len(endpoints) if len(kinds) == 1 else kinds
    if str(budget).strip().lower() == "auto":
        return tuple(d.backend for d in query_devices(endpoints))
    return ()


def rpc_budgets(rpc: str, budget: str, be: Any = None) -> list[Budget]:
    """One budget per device, in llama.cpp's device order (the RPC devices, then a local GPU)."""
    from fitter.fit.budget import parse_budget, parse_budgets
    from fitter.ggml import backends
    from fitter.ggml.backends.base import Backend
    from fitter.ggml.backends.rpc.protocol import parse_endpoints, query_devices
    from fitter.llama.flags import ConfigError

    endpoints = parse_endpoints(rpc)
    impl = backends.get(be or Backend("rpc"))
    local = impl.on(1 << 16)  # the main host's own GPU (itself where there is none)
    n = len(endpoints) + impl.local_gpus
    if str(budget).strip().lower() == "auto":
        out = [Budget(bytes=d.free, source=f"RPC{i} {d.endpoint}: the rpc-server's free memory", note=d.memory_note)
               for i, d in enumerate(query_devices(endpoints))]
        if impl.local_gpus:
            b = parse_budget("auto", local.kind.value)
            out.append(b.model_copy(update={"source": f"{local.name}: {b.source}"}))
        return out
    buds = parse_budgets(budget, impl.kind.value)
    names = impl.device_names(n)
    if len(buds) == 1:
        return [buds[0].model_copy(update={"source": f"{buds[0].source} ({name})"}) for name in names]
    if len(buds) != n:  # one device per server (auto asks how many each has)
        raise ConfigError(f"--budget {budget}: {len(buds)} values for {n} devices ({', '.join(names)}); give "
                          "one per device in llama.cpp's order (RPC devices in --rpc order, then the local "
                          "GPU), one for all, or auto")
    return buds
