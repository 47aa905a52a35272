"""compare-engines' prediction before any probe (issue 46): MLX's decode rate over llama.cpp's, from one bandwidth
model.

llama.cpp's side is `fitter.speed.predict.predict_speed` (its coefficients fitted on measured llama-bench rates; backend
metal on an Apple profile, cuda or cpu otherwise). MLX's side is the bytes mlx-lm reads per decoded token (its
resident weights, fitter.mlx.weights; of an MoE's expert tensors only num_experts_per_tok / num_experts; the token
embedding only when it is also the output head) over the profile's memory bandwidth times MLX_DECODE_EFFICIENCY,
plus the fixed costs llama.cpp's fitted model charges per token and per layer on that backend (launches, syncs):
without them a small model's MLX rate would grow without bound.

MLX_DECODE_EFFICIENCY is an ASSUMPTION, not a fit: the truth set (benchmarks/speed_model.py) has no MLX
measurement on Apple, so the share of the memory bandwidth mlx-lm's decode reaches is a round guess, and MLX paying
llama.cpp's fixed per-token costs is an assumption too. The KV cache read
at the study's short prompt is left out on both sides (decode at depth 0).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import RunConfig
from fitter.mlx.weights import weight_bytes
from fitter.speed.hardware import HardwareProfile
from fitter.speed.predict import coefficients, predict_speed

MLX_DECODE_EFFICIENCY = 0.65  # share of memory bandwidth mlx-lm's decode reaches: assumed, not fitted (no MLX truth)
_EXPERTS = ("switch_mlp.", ".experts.")  # mlx-lm's stacked MoE experts (SwitchGLU), gpt-oss's experts


class EnginePrediction(BaseModel):
    """The predicted decode rates of both engines on one hardware profile, and MLX's over llama.cpp's."""

    hardware: str
    llama_decode_tps: float
    mlx_decode_tps: float
    ratio: float  # MLX / llama.cpp
    mlx_bytes_per_token: int
    mlx_efficiency: float = MLX_DECODE_EFFICIENCY
    note: str = ("MLX's side assumes it reads its weights at "
                 f"{MLX_DECODE_EFFICIENCY:g} x the memory bandwidth (not fitted: no MLX measurement in the truth set)")

    def line(self) -> str:
        return (f"predicted before any probe ({self.hardware}, bandwidth model): MLX decode {self.mlx_decode_tps:,.1f} "
                f"tok/s vs llama.cpp {self.llama_decode_tps:,.1f} tok/s: MLX/llama.cpp {self.ratio:.2f}x "
                f"(MLX at an assumed {self.mlx_efficiency:g} of the memory bandwidth, not fitted)")


def mlx_bytes_per_token(mlx_model: Any) -> int:
    """The bytes mlx-lm reads to decode one token: every resident weight, MoE experts by the share a token uses."""
    spec = mlx_model.spec
    share = spec.num_experts_per_tok / spec.num_experts if spec.num_experts else 1.0
    resident = weight_bytes(spec, mlx_model.tensors).resident
    skip = 0.0
    for name, t in mlx_model.tensors.items():
        if any(e in name for e in _EXPERTS):
            skip += t.nbytes * (1.0 - share)
        elif "embed_tokens" in name and not spec.tie_word_embeddings:
            skip += t.nbytes  # one row per token (the output head is lm_head)
    return max(1, int(resident - skip))


def predict_engines(header: Any, spec: Any, mlx_model: Any, hw: HardwareProfile, *, n_ctx: int,
                    threads: int = 8) -> EnginePrediction | None:
    """Both engines' decode on `hw` (None when the profile has no memory bandwidth to divide by)."""
    bw = hw.memory_bandwidth_gbs or hw.host_bandwidth_gbs
    if not bw:
        return None
    backend = Backend.METAL if hw.name.startswith("apple") else hw.backend
    cfg = RunConfig(n_ctx=n_ctx, n_parallel=1)
    llama = predict_speed(header, spec, cfg, backend, hw, depth=0, threads=threads).decode_tps
    nbytes = mlx_bytes_per_token(mlx_model)
    dec = coefficients(backend)[0]
    fixed = dec.get("token", 0.0) + dec.get("layer", 0.0) * mlx_model.spec.n_layers
    mlx = 1.0 / (nbytes / (MLX_DECODE_EFFICIENCY * bw * 1e9) + fixed)
    if llama <= 0:
        return None
    return EnginePrediction(hardware=hw.name, llama_decode_tps=round(llama, 2), mlx_decode_tps=round(mlx, 2),
                            ratio=round(mlx / llama, 3), mlx_bytes_per_token=nbytes)
