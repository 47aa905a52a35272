"""The speed model's entry: llama-bench's prefill and decode rates of a config (fitter.speed has the parts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitter.ggml.backends.base import Backend
from fitter.gguf.reader import GGUFHeader
from fitter.llama.cparams import DEFAULT_N_BATCH, RunConfig
from fitter.llama.hparams import ModelSpec
from fitter.speed import factors
from fitter.speed.hardware import HardwareProfile
from fitter.speed.model import (
    MEASURED,
    Rates,
    SpeedPrediction,
    bound_of,
    decode_terms,
    finite,
    prefill_terms,
    seconds,
    spread,
)
from fitter.speed.work import CLASSES, work_of

if TYPE_CHECKING:
    from fitter.speed.network import Network

DEFAULT_PROMPT = 512  # llama-bench -p
DEFAULT_GEN = 128  # llama-bench -n
DEFAULT_UBATCH = 512  # llama_context_default_params n_ubatch


def coefficients(backend: Backend, scale: dict[str, float] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """The fitted coefficients (decode, prefill) of a backend, times a calibration's scales (time per measured)."""
    co = factors.COEFFICIENTS.get(backend.value, {})
    measured = {f"{MEASURED}.{c}": 1.0 for c in (*CLASSES, "attn")}  # at this CPU's measured rate: 1, scaled as the rest
    dec, pre = {**measured, **co.get("decode", {})}, {**measured, **co.get("prefill", {})}
    if scale:
        dec = {k: v * scale.get("decode", 1.0) for k, v in dec.items()}
        pre = {k: v * scale.get("prefill", 1.0) for k, v in pre.items()}
    return dec, pre


def profile_scale(hw: HardwareProfile, backend: Backend) -> dict[str, float] | None:
    """The scales the speed model's truth set gives this profile (factors.PROFILE_SCALE: measured / predicted seconds
    over its llama-bench training rows, as `calibrate --bench` gives a user's machine), on the profile's own backend."""
    return factors.PROFILE_SCALE.get(hw.name) if backend == hw.backend else None


def predict_speed(header: GGUFHeader, spec: ModelSpec, config: RunConfig, backend: Backend, hw: HardwareProfile, *,
                  prompt: int = DEFAULT_PROMPT, depth: int = 0, threads: int = 8, n_gpus: int = 1,
                  scale: dict[str, float] | None = None, calibrated: str = "",
                  network: Network | None = None) -> SpeedPrediction:
    """llama-bench's pp<prompt> (at the config's -ub) and tg rates after `depth` tokens, for this placement;
    `scale`: a calibration's (None: the profile's own from the truth set, `profile_scale`); `network`: the
    devices are behind RPC (fitter.speed.network), its terms added in seconds."""
    work = work_of(header, spec, config, backend, n_gpus)
    n_ubatch = min(config.n_ubatch or DEFAULT_UBATCH, config.n_batch or DEFAULT_N_BATCH)
    dec_co, pre_co = coefficients(backend, profile_scale(hw, backend) if scale is None else scale)
    dt = decode_terms(work, hw, backend, depth + DEFAULT_GEN // 2, threads)  # llama-bench tg128 runs d .. d + 128
    pt = prefill_terms(work, hw, backend, prompt, n_ubatch, depth, threads, op_offload=not config.no_op_offload)
    if network is not None:  # seconds already: coefficient 1, never fitted
        dt.update(network.decode_terms(depth + DEFAULT_GEN // 2))
        pt.update(network.prefill_terms(prompt, n_ubatch, depth))
        dec_co, pre_co = {**dec_co, "net": 1.0}, {**pre_co, "net": 1.0}
    s_dec, s_pre = seconds(dt, dec_co), seconds(pt, pre_co)
    decode = finite(1.0 / s_dec) if s_dec > 0 else 0.0
    prefill = finite(prompt / s_pre) if s_pre > 0 else 0.0
    d_lo, d_hi = spread(decode, factors.SPREAD.get("decode", 0.3))
    p_lo, p_hi = spread(prefill, factors.SPREAD.get("prefill", 0.4))
    return SpeedPrediction(
        prefill_tps=prefill, decode_tps=decode, prompt_tokens=prompt, depth=depth, n_ubatch=n_ubatch,
        hardware=hw.name, low=Rates(prefill_tps=p_lo, decode_tps=d_lo), high=Rates(prefill_tps=p_hi, decode_tps=d_hi),
        bound={"prefill": bound_of(pt, pre_co, backend, work), "decode": bound_of(dt, dec_co, backend, work)},
        calibrated=calibrated)


__all__ = ["DEFAULT_GEN", "DEFAULT_PROMPT", "DEFAULT_UBATCH", "Rates", "SpeedPrediction", "coefficients",
           "predict_speed", "profile_scale"]
