"""The speed settings of one request (issue 46): --hardware, --host-bandwidth, -t, --speed-prompt, --speed-depth and
--no-speed, resolved once; `Speed.predict` gives a config's rates for fitter.fit.plan (fit) and quants.

`--hardware auto` must not slow `fit`: this machine is detected once, and its host memory bandwidth is measured (once,
then cached by fitter.speed.hardware) only where a prediction needs it: weights on the CPU beside a GPU backend, or
the CPU backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Union

from fitter.ggml import backends
from fitter.llama.cparams import ConfigError

if TYPE_CHECKING:
    from fitter.build import LlamaBuild
    from fitter.ggml.backends.base import Backend
    from fitter.gguf.reader import GGUFHeader
    from fitter.llama.cparams import RunConfig
    from fitter.llama.hparams import ModelSpec
    from fitter.speed.calibration import SpeedCalibration
    from fitter.speed.hardware import HardwareProfile
    from fitter.speed.model import SpeedPrediction

ROUGH = "no published figures for this GPU: rough"

# a config's rates and the notes that go with them (None where none can be said: Speed.note says why)
SpeedResult = tuple["SpeedPrediction", list[str]]
# quant_fit.evaluate's `rate` hook: (name, header, spec, config) of each fitting quant
RateHook = Callable[[str, "GGUFHeader", "ModelSpec", "RunConfig"], None]


def resolve_threads(threads: int | None) -> int:
    """-t N, or llama.cpp's default (the physical cores); 0 or less is one line, as llama.cpp's own -t needs one."""
    from fitter.speed.hardware import default_threads

    if threads is None:
        return default_threads()
    if threads < 1:
        raise ConfigError(f"-t {threads}: use 1 or more threads")
    return threads


def _detect() -> HardwareProfile:
    from fitter.speed.hardware import detect

    return detect()


class Speed:
    """--hardware, --host-bandwidth, -t, --speed-prompt, --speed-depth and --no-speed, resolved once per command;
    `predict` gives a config's rates (None where none can be said: `note` says why)."""

    def __init__(self, hardware: str = "auto", host_bandwidth: str | None = None, threads: int | None = None,
                 prompt: int = 512, depth: int = 0, *, off: bool = False, build: LlamaBuild | None = None) -> None:
        from fitter.build import PINNED
        from fitter.speed.hardware import get_profile, parse_bandwidth

        if prompt < 1:
            raise ConfigError(f"--speed-prompt {prompt}: use 1 or more tokens")
        if depth < 0:
            raise ConfigError(f"--speed-depth {depth}: use 0 or more tokens")
        self.auto = hardware.strip().lower() == "auto"
        self.off = off
        self.host_gbs = parse_bandwidth(host_bandwidth) if host_bandwidth is not None else None
        self.host_flag = host_bandwidth
        # a named profile is checked even with --no-speed (a mistyped name is one line); auto is detected only for use
        self.profile: HardwareProfile | None = (None if self.auto and off else get_profile(hardware) if not self.auto
                                                else _detect())
        self.threads = resolve_threads(threads)
        self.prompt, self.depth, self.build = prompt, depth, build or PINNED
        self.note = ""
        self.notes: list[str] = []  # quants: the notes of its rates
        self.rated: dict[str, tuple[float, float]] = {}  # quants: (prefill, decode) by candidate name
        self.calibrated = ""
        self._cal: Union[SpeedCalibration, None, bool] = False  # False: not looked up yet

    @property
    def on(self) -> bool:
        """Whether rates are predicted at all (not --no-speed, and a profile to predict them for)."""
        return not self.off and self.profile is not None

    def _this_machine(self) -> bool:
        return self.auto or (self.profile is not None and _detect().name == self.profile.name)

    def host(self, needed: bool) -> HardwareProfile:
        """The profile with its host bandwidth: --host-bandwidth, else on unified memory the chip's own, else (needed,
        this machine) measured once; else unknown (the model assumes a desktop's)."""
        from fitter.speed.machine import with_host

        p = self.profile
        assert p is not None
        if self.host_gbs is not None:
            return p.model_copy(update={"host_bandwidth_gbs": self.host_gbs,
                                        "host_bandwidth_source": f"--host-bandwidth {self.host_flag}"})
        p = with_host(p, needed and self._this_machine())
        if p.host_bandwidth_gbs:
            self.profile = p  # measured once per command
        return p

    def calibration(self) -> SpeedCalibration | None:
        if self._cal is False:
            from fitter.speed import calibration

            self._cal = calibration.load(self.profile.name, self.build) if self.profile is not None else None
        return self._cal if not isinstance(self._cal, bool) else None

    def predict(self, header: GGUFHeader, spec: ModelSpec, config: RunConfig, backend: Backend, n_gpus: int = 1, *,
                bench: object = None, scale: dict[str, float] | None = None) -> SpeedResult | None:
        """The config's SpeedPrediction and the notes that go with it, or None (and `note`: why). `bench`: a
        llama-bench row's test (its prompt, depth and threads) with `scale` instead of the stored calibration."""
        from fitter.speed import predict_speed
        from fitter.speed.machine import host_needed

        p = self.profile
        if self.off or p is None:
            return None
        gpu = backends.get(backend).is_gpu
        if gpu and backend != p.backend:
            on = f"this machine ({p.name})" if self.auto else f"{p.name} ({p.backend.value})"
            self.note = (f"speed not predicted: --backend {backend.value} on {on}; "
                         "--hardware NAME names the device whose rates to predict")
            return None
        needed = host_needed(header, spec, config, backend, n_gpus)
        hw = self.host(needed)
        cal = self.calibration() if bench is None else None
        prompt, depth, threads = ((max(getattr(bench, "n_prompt", 0) or 0, 1), getattr(bench, "n_depth", 0) or 0,
                                   getattr(bench, "n_threads", None) or self.threads)
                                  if bench is not None else (self.prompt, self.depth, self.threads))
        sp = predict_speed(header, spec, config, backend, hw, prompt=prompt, depth=depth, threads=threads,
                           n_gpus=n_gpus, scale=cal.scale if cal else scale, calibrated=cal.label if cal else "")
        notes = []
        if gpu and not hw.memory_bandwidth_gbs:
            notes.append(ROUGH)
        if needed and not hw.host_bandwidth_gbs:
            notes.append(f"host bandwidth of {hw.name} unknown: a desktop's assumed (--host-bandwidth sets it)")
        return sp, notes

    def rates(self, backend: Backend) -> RateHook | None:
        """quant_fit.evaluate's `rate`: each fitting quant's (prefill, decode) rates, kept in `rated` by name."""
        if not self.on:
            return None

        def rate(name: str, header: GGUFHeader, spec: ModelSpec, config: RunConfig) -> None:
            res = self.predict(header, spec, config, backend)
            if res is not None:
                self.notes = list(dict.fromkeys([*self.notes, *res[1]]))
                self.calibrated = res[0].calibrated
                self.rated[name] = (res[0].prefill_tps, res[0].decode_tps)
        return rate
