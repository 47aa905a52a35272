"""The default --margin of each backend: what a llama.cpp process holds outside the buffers it prints, plus a
stated safety share.

llama.cpp's own default is one flat figure, 1024 MiB per device (common_params::fit_params_target, `--fit-target`).
ggfit predicts the buffers to the byte, so its margin is only what the buffers leave out, measured where it could
be, and a safety share for what varies between machines (driver, GPU, other processes).

| backend | outside the buffers (modelled) | evidence |
|---|---|---|
| CUDA | 527 MiB CUDA context + 245 MiB CUDA pool and cuBLAS workspace | H200, driver 580.159, CUDA 13: cudaMemGetInfo around 15 real loads and decodes (benchmarks/results/gpu-load-h200.json: context 526.8 MiB every time, pool 84..245 MiB after the first decode) |
| Metal | 512 MiB | no public log measures it (Metal's breakdown prints a negative `unaccounted`: free memory is read before the allocations); bounded above by the issue-13 seed on a 32 GB M4 (b9430, Qwen3.6-35B-A3B Q4_K_M, q8_0, -c 262144 -ub 2048 ran; ggfit predicts 24,657.71 MiB for it, which leaves 901 MiB of the 25,559 MiB working set) |
| CPU | 48 MiB | llama-server's resident memory beyond its buffers after a decode, measured here (pinned build, gemma3-270m: 12 MiB of program text, 30 MiB of heap and thread stacks) |

The safety share is 256 MiB on every backend.

The host budget (`--host-budget`, next to a GPU) gets the same treatment: what the process holds in system RAM
beyond its host buffers and the weights it keeps on the CPU, plus the safety share.

| backend | outside the host buffers | evidence |
|---|---|---|
| CUDA | 747 MiB | H200 host, pinned llama-server with `-lm none` (weights read into process memory, not mapped), Qwen3.6-35B-A3B Q4_K_M shape, `--n-cpu-moe 11 -c 262144`: peak RSS 6,501.3 MiB after a 4,096-token prefill and a decode, against 5,754.6 MiB of predicted host bytes (CPU experts, host buffers) (benchmarks/results/gpu-hostrss-h200.json) |
"""

from __future__ import annotations

from typing import NamedTuple

MiB = 1024**2
SAFETY_BYTES = 256 * MiB


class Overhead(NamedTuple):
    bytes: int
    what: str


OVERHEAD: dict[str, Overhead] = {
    "cuda": Overhead(772 * MiB, "CUDA context 527 MiB + CUDA pool and cuBLAS workspace 245 MiB (measured on an H200)"),
    "metal": Overhead(512 * MiB, "Metal's own allocations, estimated (at most 901 MiB by the b9430 seed)"),
    "cpu": Overhead(48 * MiB, "llama-server's program and heap beyond its buffers (measured here)"),
}


HOST_OVERHEAD: dict[str, Overhead] = {
    "cuda": Overhead(747 * MiB, "llama-server's resident memory beyond its host buffers (CUDA runtime, heap; "
                                "measured on the H200 host)"),
}


def _with_safety(table: dict[str, Overhead], backend: str) -> int:
    o = table.get(backend)
    return (o.bytes if o else 0) + SAFETY_BYTES


def _note(table: dict[str, Overhead], backend: str, what: str) -> str:
    o = table.get(backend)
    return f"{o.what if o else f'nothing modelled outside the {what}'} + {SAFETY_BYTES // MiB} MiB safety share"


def default_host_margin(backend: str) -> int:
    """What a host budget must leave beside the predicted host bytes: the process's own resident memory outside its
    buffers plus the safety share (0 on the CPU backend, where the one --margin covers it)."""
    return 0 if backend == "cpu" else _with_safety(HOST_OVERHEAD, backend)


def host_margin_note(backend: str) -> str:
    return f"{backend}: {_note(HOST_OVERHEAD, backend, 'host buffers')}"


def default_margin(backend: str) -> int:
    """The --margin a backend gets when none is given: its modelled overhead plus the safety share."""
    return _with_safety(OVERHEAD, backend)


def margin_note(backend: str) -> str:
    return f"{backend} default: {_note(OVERHEAD, backend, 'buffers')}"
