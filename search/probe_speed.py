"""What the speed model predicts for a probe (issue 46): the prefill and decode rates of its config on this machine
(fitter.speed with --hardware auto), recorded next to the rates the probe measured.

A probe's prefill is a prompt of `prompt_tokens` from an empty context (llama-bench's pp<N>), its decode the tokens
after that prompt (tg at depth N). The backend is this machine's, unless the build the probe ran says it has no GPU
backend (llama-cpp-python's CPU wheel on a GPU machine)."""

from __future__ import annotations

import os
from typing import Any

from fitter.errors import GGFitError
from fitter.ggml import backends
from fitter.ggml.backends.base import Backend
from fitter.llama.model import load_model_spec


def _backend(profile: Any, system_info: str | None) -> Backend:
    gpu = Backend(profile.backend)
    impl = backends.get(gpu)
    if impl.is_gpu and system_info and not impl.named_in(system_info):
        return Backend.CPU
    return gpu


def predicted_rates(model_path: str | os.PathLike[str], config: Any, prompt_tokens: int, *, threads: int,
                    system_info: str | None = None, build_commit: str | None = None) -> dict[str, Any] | None:
    """{"prefill_tps", "decode_tps", "prompt_tokens", "depth", "hardware", "backend", "calibrated"} for the probe's
    config, or None where the model cannot say (an unknown architecture, a config it refuses): the probe's own
    result stands whatever the speed model makes of it."""
    from fitter.speed import calibration
    from fitter.speed.machine import detect, host_needed, with_cpu_rate, with_host
    from fitter.speed.predict import predict_speed

    try:
        header, spec = load_model_spec(os.fspath(model_path))
        p = detect()
        be = _backend(p, system_info)
        cfg = config.model_copy(update={"n_parallel": 1})
        hw = with_cpu_rate(with_host(p, host_needed(header, spec, cfg, be)), threads, not backends.get(be).is_gpu)
        cal = None
        if build_commit:
            from fitter.llama_builds import resolve_build

            cal = calibration.load(hw.name, resolve_build(build_commit.split("-")[0]))
        kw: dict[str, Any] = dict(threads=threads, scale=cal.scale if cal else None,
                                  calibrated=cal.label if cal else "")
        n = max(int(prompt_tokens), 1)
        pre = predict_speed(header, spec, cfg, be, hw, prompt=n, depth=0, **kw)
        dec = predict_speed(header, spec, cfg, be, hw, prompt=n, depth=n, **kw)
    except GGFitError:
        return None
    except Exception:  # a prediction never fails a probe that ran  # noqa: BLE001
        return None
    return {"prefill_tps": pre.prefill_tps, "decode_tps": dec.decode_tps, "prompt_tokens": n, "depth": n,
            "hardware": hw.name, "backend": be.value, "calibrated": pre.calibrated or None}
