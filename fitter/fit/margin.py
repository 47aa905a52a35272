"""The default --margin of each backend: what a llama.cpp process holds outside the buffers it prints, plus a
stated safety share.

llama.cpp's own default is one flat figure, 1024 MiB per device (common_params::fit_params_target, `--fit-target`).
ggfit predicts the buffers to the byte, so its margin is only what the buffers leave out, measured where it could
be, and a safety share for what varies between machines (driver, GPU, other processes).

| backend | outside the buffers (modelled) | evidence |
|---|---|---|
| CUDA | 527 MiB CUDA context + 245 MiB CUDA pool and cuBLAS workspace | H200, driver 580.159, CUDA 13: cudaMemGetInfo around 15 real loads and decodes (benchmarks/results/gpu-load-h200.json: context 526.8 MiB every time, pool 84..245 MiB after the first decode) |
| Metal | the whole margin, from the evidence | fitter.fit.metal_evidence: configs that ran bound what Metal holds outside the buffers from above (budget - predicted total), configs that ran out of memory from below; the margin is the smallest upper bound, in whole MiB, and must exceed every lower bound. Today: at most 628.47 MiB by the b9430 seed on a 32 GB M4 (Qwen3.6-35B-A3B Q4_K_M, q8_0, -c 262144 -ub 2048 ran: 24,930.53 MiB predicted of the 25,559 MiB working set); the configs that ran out of memory only say more than -1,114.52 MiB (a public log's macOS breakdown prints a negative `unaccounted`: free memory is read before the allocations, so no log measures it) |
| CPU | 48 MiB | llama-server's resident memory beyond its buffers after a decode, measured here (pinned build, gemma3-270m: 12 MiB of program text, 30 MiB of heap and thread stacks) |

The safety share is 256 MiB on CUDA and the CPU. Metal gets none on top: the evidence bounds the whole margin, and
a share on top of the smallest upper bound would reject the config that ran.

The host budget (`--host-budget`, next to a GPU) gets the same treatment: what the process holds in system RAM
beyond its host buffers and the weights it keeps on the CPU, plus the safety share.

| backend | outside the host buffers | evidence |
|---|---|---|
| CUDA | 747 MiB | H200 host, pinned llama-server with `-lm none` (weights read into process memory, not mapped), Qwen3.6-35B-A3B Q4_K_M shape, `--n-cpu-moe 11 -c 262144`: peak RSS 6,501.3 MiB after a 4,096-token prefill and a decode, against 5,754.6 MiB of predicted host bytes (CPU experts, host buffers) (benchmarks/results/gpu-hostrss-h200.json) |
"""

from __future__ import annotations

from typing import NamedTuple

from fitter.fit.metal_evidence import EVIDENCE, Case
from fitter.ggml import backends

MiB = 1024**2
SAFETY_BYTES = 256 * MiB


class Overhead(NamedTuple):
    bytes: int
    what: str


HOST_OVERHEAD: dict[str, Overhead] = {
    "cuda": Overhead(747 * MiB, "llama-server's resident memory beyond its host buffers (CUDA runtime, heap; "
                                "measured on the H200 host)"),
}


class Bounds(NamedTuple):
    """What the evidence says of the memory outside the buffers: more than `lower` (by `lower_case`, out of memory)
    and at most `upper` (by `upper_case`, ran)."""
    lower: int
    lower_case: Case | None
    upper: int
    upper_case: Case


def metal_bounds(cases: tuple[Case, ...] = EVIDENCE) -> Bounds:
    """(largest lower bound, smallest upper bound) over the cases (fitter.fit.metal_evidence); refuses evidence that
    contradicts itself (a config that ran out of memory needing more than one that ran allows)."""
    ran = [c for c in cases if c.outcome == "ran"]
    oom = [c for c in cases if c.outcome == "oom"]
    hi = min(ran, key=lambda c: c.overhead_bound)
    lo = max(oom, key=lambda c: c.overhead_bound) if oom else None
    b = Bounds(lo.overhead_bound if lo else -(1 << 62), lo, hi.overhead_bound, hi)
    if b.lower >= b.upper // MiB * MiB:
        raise ValueError(f"the Metal evidence contradicts itself: {lo and lo.name} needs more than {hi.name} allows")
    return b


def _metal_margin() -> Overhead:
    b = metal_bounds()
    low = (f"; those that ran out of memory only say more than {b.lower / MiB:,.2f} MiB ({b.lower_case.name})"
           if b.lower_case else "")
    return Overhead(b.upper // MiB * MiB,
                    f"from {len(EVIDENCE)} Metal configs that ran or ran out of memory (fitter/fit/metal_evidence.py): "
                    f"at most {b.upper / MiB:,.2f} MiB outside the buffers, by {b.upper_case.name} "
                    f"({b.upper_case.budget_bytes / MiB:,.0f} MiB working set, ran){low}")


OVERHEAD: dict[str, Overhead] = {
    "cuda": Overhead(772 * MiB, "CUDA context 527 MiB + CUDA pool and cuBLAS workspace 245 MiB (measured on an H200)"),
    "cpu": Overhead(48 * MiB, "llama-server's program and heap beyond its buffers (measured here)"),
    "metal": _metal_margin(),
}
NO_SAFETY = frozenset({"metal"})  # the evidence bounds the whole margin: a share on top would reject what ran


def _with_safety(table: dict[str, Overhead], backend: str) -> int:
    o = table.get(backend)
    return (o.bytes if o else 0) + (0 if table is OVERHEAD and backend in NO_SAFETY else SAFETY_BYTES)


def _note(table: dict[str, Overhead], backend: str, what: str) -> str:
    o = table.get(backend)
    if o and table is OVERHEAD and backend in NO_SAFETY:
        return o.what
    return f"{o.what if o else f'nothing modelled outside the {what}'} + {SAFETY_BYTES // MiB} MiB safety share"


def default_host_margin(backend: str) -> int:
    """What a host budget must leave beside the predicted host bytes: the process's own resident memory outside its
    buffers plus the safety share (0 on the CPU backend, where the one --margin covers it)."""
    return _with_safety(HOST_OVERHEAD, backend) if backends.get(backend).is_gpu else 0


def host_margin_note(backend: str) -> str:
    return f"{backend}: {_note(HOST_OVERHEAD, backend, 'host buffers')}"


def default_margin(backend: str) -> int:
    """The --margin a backend gets when none is given: its modelled overhead plus the safety share."""
    return _with_safety(OVERHEAD, backend)


def margin_note(backend: str) -> str:
    return f"{backend} default: {_note(OVERHEAD, backend, 'buffers')}"
