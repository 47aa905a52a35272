"""Fit for speed: of the placements that fit, the fastest (issue 46).

`solve_placement` finds the placement with the most on the GPU at the config's -ub: the smallest --n-cpu-moe, or
the largest -ngl, that fits. A larger -ub prefills faster under expert offload (each ubatch streams the CPU-held
weights to the GPU once) but takes a larger compute buffer, which may cost one more layer's experts on the CPU: the
fastest placement is a trade the memory model alone cannot make. Here every neighbour (the lever a few steps
further, times each -ub) is predicted for memory and speed, those that fit are ranked by the time of one request
(the prompt, then `n_gen` decoded tokens, as llama-bench's pp<N> and tg<n_gen> measure them), and each alternative
shows what it costs against the fastest.
"""

from __future__ import annotations

from fitter.fit.memory import predict
from fitter.fit.solver import Available, PlacementChoice, excess
from fitter.ggml.backends.base import Backend
from fitter.gguf.reader import GGUFHeader
from fitter.llama.cparams import ConfigError, Frontend, RunConfig
from fitter.llama.hparams import ModelSpec
from fitter.llama_builds import PINNED, LlamaBuild
from fitter.record import Record
from fitter.speed.hardware import HardwareProfile
from fitter.speed.predict import DEFAULT_GEN, SpeedPrediction, predict_speed

UBATCHES = (512, 1024, 2048)
SPAN = 4  # lever steps beyond the choice


class SpeedOption(Record):
    """One placement that fits, with its predicted rates."""

    update: dict[str, int]  # RunConfig fields: n_cpu_moe / n_gpu_layers, n_ubatch
    flags: list[str]
    headroom_bytes: int
    device_bytes: int
    host_bytes: int
    speed: SpeedPrediction
    seconds: float  # one request: the prompt, then n_gen decoded tokens

    def line(self, best: SpeedOption) -> str:
        slower = self.seconds / best.seconds - 1
        cost = "fastest" if self is best else f"{slower * 100:+.1f}% time"
        return (f"{' '.join(self.flags):32s} prefill {self.speed.prefill_tps:9,.0f} tok/s  decode "
                f"{self.speed.decode_tps:7,.1f} tok/s  ({cost}; headroom {self.headroom_bytes / 2**20:,.0f} MiB)")


def _levers(choice: PlacementChoice, spec: ModelSpec) -> list[int]:
    if choice.lever == "n_cpu_moe":
        return [v for v in range(choice.value, choice.value + SPAN + 1) if v <= spec.n_layer]
    return [v for v in range(choice.value, choice.value - SPAN - 1, -1) if v >= 0]


def _flags(lever: str, value: int, ub: int, n_cpu_moe: int) -> list[str]:
    if lever == "n_cpu_moe":
        return ["--n-cpu-moe", str(value), "-ub", str(ub)]
    return (["--n-cpu-moe", str(n_cpu_moe)] if n_cpu_moe else []) + ["-ngl", str(value), "-ub", str(ub)]


def fastest_placements(header: GGUFHeader, spec: ModelSpec, base: RunConfig, backend: Backend, frontend: Frontend,
                       available: Available, host_available: int | None, choice: PlacementChoice,
                       hw: HardwareProfile, *, prompt: int, depth: int = 0, threads: int = 8,
                       n_gen: int = DEFAULT_GEN, scale: dict[str, float] | None = None, ubatch_fixed: bool = False,
                       draft: tuple[GGUFHeader, ModelSpec] | None = None, n_gpus: int = 1,
                       build: LlamaBuild = PINNED) -> list[SpeedOption]:
    """Every neighbour of `choice` that fits (device and host), fastest first. `ubatch_fixed`: the user gave -ub."""
    ubs = (base.n_ubatch,) if ubatch_fixed and base.n_ubatch else UBATCHES
    n_batch = base.n_batch or 2048
    out: list[SpeedOption] = []
    for value in _levers(choice, spec):
        for ub in ubs:
            if ub > n_batch:
                continue
            upd = {choice.lever: value, "n_ubatch": ub}
            if choice.lever == "n_gpu_layers" and choice.n_cpu_moe:
                upd["n_cpu_moe"] = choice.n_cpu_moe
            cfg = base.model_copy(update=upd)
            try:
                p = predict(header, spec, cfg, backend, frontend, draft, build=build, n_gpus=n_gpus, terms=False)
            except ConfigError:
                continue
            if excess(p, available) > 0 or (host_available is not None and p.host_bytes > host_available):
                continue
            sp = predict_speed(header, spec, cfg, backend, hw, prompt=prompt, depth=depth, threads=threads,
                               n_gpus=n_gpus, scale=scale)
            if sp.prefill_tps <= 0 or sp.decode_tps <= 0:
                continue
            out.append(SpeedOption(update=upd, flags=_flags(choice.lever, value, ub, choice.n_cpu_moe),
                                   headroom_bytes=-excess(p, available), device_bytes=p.total_device_bytes,
                                   host_bytes=p.host_bytes, speed=sp, seconds=sp.seconds(n_gen)))
    return sorted(out, key=lambda o: o.seconds)
