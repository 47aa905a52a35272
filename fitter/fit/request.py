"""What a command asks of the fitter (issue 45): the model, llama.cpp's flags (a RunConfig), the engine's build, the
budgets and the speed settings, in one record. `ggfit fit` parses its flags into a FitRequest and hands it to
fitter.fit.plan.plan; `ggfit quants` hands the same record to fitter.fit.plan.plan_quants (fitter/README.md has the
flow).

The budget arithmetic every command shares (--budget per GPU, less --margin; --host-budget less the host margin) is
`Budgets`' alone. The speed settings (issue 46: --hardware, --host-bandwidth, -t, --speed-prompt, --speed-depth,
--no-speed) are `Speed`, resolved once per request: `Speed.predict` gives a config's rates to plan() and quants.
`--hardware auto` must not slow `fit`: this machine is detected once, and its host memory bandwidth is measured (once,
then cached by fitter.speed.hardware) only where a prediction needs it: weights on the CPU beside a GPU backend, or
the CPU backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

from fitter.fit import budget as budget_
from fitter.fit.margin import default_host_margin, device_margins
from fitter.ggml import backends
from fitter.llama.cparams import ConfigError
from fitter.record import Record

if TYPE_CHECKING:
    from pathlib import Path

    from fitter.fit.sizes import Budget
    from fitter.ggml.backends.base import Backend
    from fitter.gguf.reader import GGUFHeader
    from fitter.llama.cparams import Frontend, RunConfig
    from fitter.llama.hparams import ModelSpec
    from fitter.llama_builds import LlamaBuild
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
                 prompt: int = 512, depth: int = 0, *, off: bool = False, build: LlamaBuild | None = None,
                 rpc_bandwidth: str | None = None, rpc_latency: str | None = None) -> None:
        from fitter.llama_builds import PINNED
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
        # -t checked as given; llama.cpp's default (the physical cores, read from /sys) only where a rate will use it
        self.threads = resolve_threads(threads) if threads is not None or not off else 0
        self.prompt, self.depth, self.build = prompt, depth, build or PINNED
        # --rpc-bandwidth, --rpc-latency: checked as given (fitter.speed.network), used with --rpc's servers
        self.rpc_bandwidth, self.rpc_latency = rpc_bandwidth, rpc_latency
        if rpc_bandwidth is not None or rpc_latency is not None:
            from fitter.speed import network

            if rpc_bandwidth is not None:
                network.parse_bandwidth(rpc_bandwidth)
            if rpc_latency is not None:
                network.parse_latency(rpc_latency)
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

    def cpu_rate(self, hw: HardwareProfile, threads: int, needed: bool) -> HardwareProfile:
        """The profile with this CPU's matrix rates at -t `threads` where the CPU backend runs the model on this
        machine (measured once per thread count, then cached: fitter.speed.cpu_rate)."""
        from fitter.speed.machine import with_cpu_rate

        return with_cpu_rate(hw, threads, needed and self._this_machine())

    def calibration(self) -> SpeedCalibration | None:
        if self._cal is False:
            from fitter.speed import calibration

            self._cal = calibration.load(self.profile.name, self.build) if self.profile is not None else None
        return self._cal if not isinstance(self._cal, bool) else None

    def predict(self, header: GGUFHeader, spec: ModelSpec, config: RunConfig, backend: Backend, n_gpus: int = 1, *,
                bench: object = None, scale: dict[str, float] | None = None) -> SpeedResult | None:
        """The config's SpeedPrediction and the notes that go with it, or None (and `note`: why). `bench`: a
        llama-bench row's test (its prompt, depth and threads) with `scale` instead of the stored calibration."""
        p = self.profile
        if self.off or p is None:
            return None
        network = None
        if backends.get(backend).remote:  # the servers' devices compute as the profile's; the network between
            network, config, n_gpus = self._remote(spec, config, n_gpus)
            backend = p.backend
        gpu = backends.get(backend).is_gpu
        if gpu and backend != p.backend:
            on = f"this machine ({p.name})" if self.auto else f"{p.name} ({p.backend.value})"
            self.note = (f"speed not predicted: --backend {backend.value} on {on}; "
                         "--hardware NAME names the device whose rates to predict")
            return None
        from fitter.speed.machine import host_needed  # the model of rates only where it predicts
        from fitter.speed.predict import predict_speed

        needed = host_needed(header, spec, config, backend, n_gpus)
        hw = self.host(needed)
        cal = self.calibration() if bench is None else None
        prompt, depth, threads = ((max(getattr(bench, "n_prompt", 0) or 0, 1), getattr(bench, "n_depth", 0) or 0,
                                   getattr(bench, "n_threads", None) or self.threads)
                                  if bench is not None else (self.prompt, self.depth, self.threads))
        hw = self.cpu_rate(hw, threads, not gpu)
        sp = predict_speed(header, spec, config, backend, hw, prompt=prompt, depth=depth, threads=threads,
                           n_gpus=n_gpus, scale=cal.scale if cal else scale, calibrated=cal.label if cal else "",
                           network=network)
        notes = []
        if network is not None:
            notes.append(f"RPC devices as {p.name}; network {network.link.source}, "
                         f"{network.link.bandwidth_gbs * 1e3:,.0f} MB/s, {network.link.latency_ms:g} ms ping, "
                         f"{network.hops} round trip{'s' if network.hops != 1 else ''} per token")
        if gpu and not hw.memory_bandwidth_gbs:
            notes.append(ROUGH)
        if needed and not hw.host_bandwidth_gbs:
            notes.append(f"host bandwidth of {hw.name} unknown: a desktop's assumed (--host-bandwidth sets it)")
        return sp, notes

    def _remote(self, spec: ModelSpec, config: RunConfig, n_gpus: int) -> tuple[Any, RunConfig, int]:
        """--rpc: the network (fitter.speed.network) and the config and device count the servers compute with: each
        RPC device as a device of the --hardware profile (CPU rpc-servers: cpu; CUDA ones: an NVIDIA profile)."""
        from fitter.ggml.backends.rpc.protocol import parse_endpoints
        from fitter.speed.network import Network, layout_of, link_of

        assert self.profile is not None
        endpoints = parse_endpoints(config.rpc) if config.rpc else []
        n_dev = max(n_gpus, len(endpoints), 1)
        net = Network(layout_of(spec, config, n_dev), link_of(endpoints, self.rpc_bandwidth, self.rpc_latency))
        local = config.model_copy(update={"rpc": None})
        return net, local, n_dev if backends.get(self.profile.backend).is_gpu else 1

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


class Budgets(Record):
    """--budget (one value per GPU), --margin and --host-budget, parsed once.

    `main` is the budget of the device view (-sm none: -mg's GPU, else the first), `available` it less the margin;
    `per_device` holds each GPU's budget by llama.cpp's device name where there are several (None: one budget)."""

    devices: tuple[Budget, ...]
    main: Budget
    margin_bytes: int
    margin_default: bool  # --margin not given: the backend's own
    available: int
    per_device: dict[str, int] | None = None
    # the default margin of each device where they differ (--rpc: each device its own backend's, fitter.fit.margin
    # .device_margins); None: margin_bytes on every device
    margins: dict[str, int] | None = None
    host: Budget | None = None  # system RAM beside a GPU (None: the CPU backend, or unified memory without one given)
    host_margin: int = 0

    @classmethod
    def parse(cls, budget: str, margin: str | None, backend: Backend, *, host_budget: str | None = None,
              split_mode: str = "layer", main_gpu: int = 0, several: bool = True,
              devices: list[Budget] | None = None, remote: tuple[str, ...] = ()) -> Budgets:
        """The budgets of `fit` (several: one per GPU, and a host budget) or of `quants` (several=False: one device
        budget); `devices`: already one per device (--rpc's, asked of the servers; `remote`: each server's backend,
        RunConfig.rpc_backends, whose margin its device gets). A margin that leaves nothing is the user's error
        (BudgetError)."""
        impl = backends.get(backend)
        if devices is None:
            devices = (budget_.parse_budgets(budget, backend.value) if several
                       else [budget_.parse_budget(budget, backend.value)])
        i_main = main_gpu if split_mode == "none" and main_gpu < len(devices) else 0
        main = devices[i_main]
        margin_bytes = budget_.parse_margin(margin, backend.value)
        names = impl.device_names(len(devices))
        margins = device_margins(backend.value, len(devices), remote) if margin is None and impl.remote else None
        available = budget_.available_bytes(main, (margins or {}).get(names[i_main], margin_bytes))
        # one budget per GPU: each device within its own (the layers split by the budgets unless -ts says otherwise)
        per_device = (dict(zip(names, (b.bytes for b in devices)))
                      if len(devices) > 1 and split_mode != "none" else None)
        for name, b in zip(names[1:], devices[1:]):
            budget_.available_bytes(b, (margins or {}).get(name, margin_bytes))
        # system RAM next to the GPU (default: what is available now); on the CPU everything is the one budget, and a
        # Mac's unified memory is the device budget already (a host budget there only when given)
        host = None
        if several and impl.is_gpu and (host_budget or not impl.unified_memory):
            host = budget_.parse_host_budget(host_budget)
        return cls(devices=tuple(devices), main=main, margin_bytes=margin_bytes, margin_default=margin is None,
                   available=available, per_device=per_device, host=host,
                   host_margin=default_host_margin(backend.value), margins=margins if per_device else None)

    @classmethod
    def held(cls, avail: int, per_device: dict[str, int] | None = None) -> Budgets:
        """A study's budgets, margins already taken: `avail` the bytes its trials may use (the first device's with
        several), `per_device` what each device may hold (optimise --rpc)."""
        from fitter.fit.sizes import Budget

        b = Budget(bytes=avail, source="the study's available bytes")
        devices = tuple(Budget(bytes=a, source=name) for name, a in per_device.items()) if per_device else (b,)
        return cls(devices=devices, main=devices[0], margin_bytes=0, margin_default=False, available=avail,
                   per_device=per_device)

    def margin_of(self, device: str) -> int:
        """The margin a device's budget leaves: its own backend's (margins), else margin_bytes."""
        return (self.margins or {}).get(device, self.margin_bytes)

    @property
    def avail(self) -> int | dict[str, int]:
        """What the prediction may use: the available bytes, or per GPU (each budget less its margin)."""
        if self.per_device:
            return {name: b - self.margin_of(name) for name, b in self.per_device.items()}
        return self.available

    @property
    def host_avail(self) -> int | None:
        """What the predicted host bytes may use: the host budget less the host margin (None: no host budget)."""
        return None if self.host is None else self.host.bytes - self.host_margin


class FitRequest(Record):
    """One request: a model and llama.cpp's flags for it (`config`, as llama.cpp reads them), on a backend, under
    budgets, with a build's rules and the speed settings. `solve_ctx`: -c not given, solve for the largest context."""

    model: str  # as given: a path, a URL or a bundled name (resolved by plan)
    config: RunConfig
    backend: Backend
    frontend: Frontend
    build: LlamaBuild
    budgets: Budgets
    speed: Speed | None = None  # None: no rates asked for at all
    model_draft: str | None = None
    solve_ctx: bool = False
    asked_batch: int | None = None  # -b as given (None: not given)
    asked_ubatch: int | None = None  # -ub as given
    kv_given: bool = False  # -ctk or -ctv given: the table keeps that pair
    check: bool = False  # --check: llama.cpp's own dry run (or llama-fit-params) beside the prediction
    fit_params: Path | None = None  # --llama-bin's llama-fit-params, for --check
    # issue 48: the session `fit` shows (fitter.session.fit.SessionAsk: llama-server's cache flags, N requests of
    # P + G tokens); plan() adds what llama-server holds over it (Plan.session). None: none asked
    session: Any = None

    @classmethod
    def trial(cls, model: str, config: RunConfig, backend: Backend, frontend: Frontend, build: LlamaBuild,
              budgets: Budgets) -> FitRequest:
        """One config as given, as a study's trial or compare-engines runs it (fitter.fit.plan.predict_plan):
        `model` a resolved path, its draft the config's, `budgets` the study's (Budgets.held)."""
        draft = config.draft_model if config.spec_type == "draft-simple" else None
        return cls(model=model, config=config, backend=backend, frontend=frontend, build=build, budgets=budgets,
                   model_draft=draft)

    @property
    def n_gpus(self) -> int:
        return len(self.budgets.devices)


class QuantsRequest(Record):
    """`ggfit quants`: a FitRequest's model, flags, budgets and speed, every quant of the model evaluated with them
    (fitter.fit.plan.plan_quants: one answer per ftype)."""

    fit: FitRequest
    candidates: tuple[str, ...] = ()  # --candidate NAME=PATH_OR_URL or NAME=SIZE
    include_imatrix: bool = True
