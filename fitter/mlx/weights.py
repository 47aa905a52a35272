"""The weights mlx-lm keeps resident: every safetensors tensor its model's `sanitize` keeps.

Quantized layers are stored as `weight` (uint32, packed), `scales` and `biases` (the model dtype,
one per group): their bytes are the header's. What sanitize drops never reaches memory: on disk and
resident differ by it (mlx_lm.utils.load_model: model.sanitize, then model.load_weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitter.mlx.config import HYBRID, MlxSpec
from fitter.mlx.safetensors import TensorInfo


@dataclass(frozen=True)
class WeightBytes:
    resident: int  # what mlx_lm.load keeps (the arrays' nbytes)
    n_tensors: int
    dropped: int  # in the files, dropped by sanitize (lm_head of a tied model, vision tower)
    mtp: int  # the MTP head (mtp.*): in the files, dropped by mlx-lm, loaded by mlx-vlm's MTP decoding
    vision: int = 0  # the part of `dropped` that is a vision tower (mlx-vlm loads it)

    @property
    def on_disk(self) -> int:
        """Every tensor in the safetensors files (their headers aside)."""
        return self.resident + self.dropped + self.mtp


def _is_vision(spec: MlxSpec, name: str) -> bool:
    return spec.model_type in ("qwen3_5", "qwen3_5_moe") and name.startswith(("vision_tower", "model.visual"))  # qwen3_5.Model.sanitize


def _dropped(spec: MlxSpec, name: str) -> bool:
    if spec.tie_word_embeddings and name.endswith("lm_head.weight"):
        return True  # Model.sanitize: weights.pop("lm_head.weight") when tied
    return _is_vision(spec, name)


def _is_mtp(spec: MlxSpec, name: str) -> bool:
    return spec.model_type in HYBRID and "mtp." in name  # qwen3_5/qwen3_next sanitize: "mtp." not in k


def weight_bytes(spec: MlxSpec, tensors: dict[str, TensorInfo]) -> WeightBytes:
    resident = dropped = mtp = vision = n = 0
    for name, t in tensors.items():
        if _is_mtp(spec, name):
            mtp += t.nbytes
        elif _dropped(spec, name):
            dropped += t.nbytes
            vision += t.nbytes if _is_vision(spec, name) else 0
        else:
            resident += t.nbytes
            n += 1
    return WeightBytes(resident=resident, n_tensors=n, dropped=dropped, mtp=mtp, vision=vision)
