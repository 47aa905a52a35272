"""The default --margin of each backend: what a llama.cpp process holds outside the buffers it prints, plus a
stated safety share.

llama.cpp's own default is one flat figure, 1024 MiB per device (common_params::fit_params_target, `--fit-target`).
ggfit predicts the buffers to the byte, so its margin is only what the buffers leave out, measured where it could
be, and a safety share for what varies between machines (driver, GPU, other processes).

| backend | outside the buffers (modelled) | evidence |
|---|---|---|
| CUDA | 527 MiB CUDA context + 245 MiB CUDA pool and cuBLAS workspace | H200, driver 580.159, CUDA 13: cudaMemGetInfo around 15 real loads and decodes (benchmarks/results/gpu-load-h200.json: context 526.8 MiB every time, pool 84..245 MiB after the first decode) |
| Metal | the whole margin, from the evidence | fitter.ggml.backends.metal.evidence: configs that ran bound what Metal holds outside the buffers from above (budget - predicted total), configs that ran out of memory from below; the margin is the smallest upper bound, in whole MiB, and must exceed every lower bound. Today: at most 628.47 MiB by the b9430 seed on a 32 GB M4 (Qwen3.6-35B-A3B Q4_K_M, q8_0, -c 262144 -ub 2048 ran: 24,930.53 MiB predicted of the 25,559 MiB working set); the configs that ran out of memory only say more than -1,114.52 MiB (a public log's macOS breakdown prints a negative `unaccounted`: free memory is read before the allocations, so no log measures it) |
| RPC | 45 MiB per rpc-server; 51 MiB on the main host | CPU rpc-servers and the main llama-server's resident memory beyond their buffers after warm-up, measured here (benchmarks/results/rpc-cpu-here.json) |
| RPC devices of GPU servers | the server's GPU's: CUDA's (context, pool) on a CUDA rpc-server, Metal's on a Mac's | what the server's own backend holds outside its buffers, as on a local GPU of that kind |
| CPU | 48 MiB | llama-server's resident memory beyond its buffers after a decode, measured here (pinned build, gemma3-270m: 12 MiB of program text, 30 MiB of heap and thread stacks) |
| RPC | 45 MiB per CPU rpc-server | the largest VmRSS beyond its buffers of 56 CPU rpc-servers after a load and warm-up here (benchmarks/results/rpc-cpu-here.json; buffers never touched make the figure lower, so it is what a server held at least) |

Each figure is a fact of its backend object (fitter.ggml.backends: `overhead`, `host_overhead`, `margin_safety`);
here they become margins and notes. Where devices of several kinds share a run (--rpc: CPU, CUDA or Metal rpc-servers,
and a local CUDA GPU after them), each device gets its own backend's margin (device_margins): a CPU rpc-server keeps
RPC's 45 MiB beside a local CUDA GPU's 772 MiB. The safety share is 256 MiB on CUDA and the CPU. Metal gets none on top: the evidence bounds the whole margin, and
a share on top of the smallest upper bound would reject the config that ran.

The host budget (`--host-budget`, next to a GPU) gets the same treatment: what the process holds in system RAM
beyond its host buffers and the weights it keeps on the CPU, plus the safety share.

| backend | outside the host buffers | evidence |
|---|---|---|
| RPC | 51 MiB | the main llama-server's largest VmRSS beyond its host buffers over the same 28 loads with CPU rpc-servers |
| CUDA | 747 MiB | H200 host, pinned llama-server with `-lm none` (weights read into process memory, not mapped), Qwen3.6-35B-A3B Q4_K_M shape, `--n-cpu-moe 11 -c 262144`: peak RSS 6,501.3 MiB after a 4,096-token prefill and a decode, against 5,754.6 MiB of predicted host bytes (CPU experts, host buffers) (benchmarks/results/gpu-hostrss-h200.json) |
"""

from __future__ import annotations

from fitter.ggml import backends
from fitter.ggml.backends.base import Overhead

MiB = 1024**2
SAFETY_BYTES = 256 * MiB


def _with_safety(o: Overhead | None, safety: bool) -> int:
    return (o.bytes if o else 0) + (SAFETY_BYTES if safety else 0)


def _note(o: Overhead | None, safety: bool, what: str) -> str:
    if o and not safety:
        return o.what
    return f"{o.what if o else f'nothing modelled outside the {what}'} + {SAFETY_BYTES // MiB} MiB safety share"


def default_host_margin(backend: str) -> int:
    """What a host budget must leave beside the predicted host bytes: the process's own resident memory outside its
    buffers plus the safety share (0 on the CPU backend, where the one --margin covers it)."""
    impl = backends.get(backend)
    return _with_safety(impl.host_overhead, True) if impl.is_gpu else 0


def host_margin_note(backend: str) -> str:
    return f"{backend}: {_note(backends.get(backend).host_overhead, True, 'host buffers')}"


def default_margin(backend: str) -> int:
    """The --margin a backend gets when none is given: its modelled overhead plus the safety share (none where the
    evidence bounds the whole margin: Metal)."""
    impl = backends.get(backend)
    return _with_safety(impl.overhead, impl.margin_safety)


def device_margins(backend: str, n_devices: int, remote: tuple[str, ...] = ()) -> dict[str, int] | None:
    """The default margin of each device by llama.cpp's device name, each from its own backend object (an RPC device
    its server's, rpc/remote.py; a local GPU beside them its own), where they differ from the backend's
    (default_margin); None where every device has that one."""
    impl = backends.get(backend)
    names = impl.device_names(n_devices)
    subs = [impl.on(i) for i in impl.device_ids(n_devices, remote)]
    out = {name: _with_safety(sub.overhead, sub.margin_safety) for name, sub in zip(names, subs)}
    return out if set(out.values()) != {default_margin(backend)} else None


def device_margin_notes(backend: str, n_devices: int, remote: tuple[str, ...] = ()) -> dict[str, str]:
    impl = backends.get(backend)
    names = impl.device_names(n_devices)
    subs = [impl.on(i) for i in impl.device_ids(n_devices, remote)]
    return {name: _note(sub.overhead, sub.margin_safety, "buffers") for name, sub in zip(names, subs)}


def margin_note(backend: str) -> str:
    impl = backends.get(backend)
    return f"{backend} default: {_note(impl.overhead, impl.margin_safety, 'buffers')}"
