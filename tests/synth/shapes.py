"""Full-size shapes of real models, written as sparse header-only GGUFs (no tensor data on disk).

For ggfit's predictions and llama.cpp's dry runs at real scale (never for loading weights). The
hyperparameters are those of the published models; the tensor types come from `tensor_types`
(e.g. a Q4_K_M-like mix from fitter.quants), F16 by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.synth.common import build

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen3.6-35B-A3B: 40 layers, hidden 2048, 256 experts (8 used) of 512, shared expert 512, full
    # attention every 4th layer (16 heads, 2 KV heads of 256), gated delta net with 16 key and 32 value
    # heads of 128, conv kernel 4, vocab 248,320, one MTP layer
    "qwen36-35b-a3b": ("qwen35moe", dict(
        n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_rot=64, n_ff=512, n_ff_exp=512,
        n_ff_shexp=512, n_expert=256, n_expert_used=8, full_attention_interval=4, ssm_d_conv=4,
        ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32, n_vocab=248320, n_ctx_train=262144, n_nextn=1,
    )),
    # Llama 3.1 8B
    "llama-8b": ("llama", dict(
        n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256, n_ctx_train=131072,
    )),
}


def build_shape(name: str, **overrides: Any) -> Path:
    arch, params = SHAPES[name]
    return build(arch, **{**params, "sparse": True, **overrides})


def q4_k_m_types(name: str) -> dict[str, str]:
    """Per-tensor types of the shape quantized to Q4_K_M, as fitter.quants predicts llama-quantize
    would choose them from the F16 header (the header of a real Q4_K_M file of the model)."""
    from fitter.gguf_reader import read_header
    from fitter.quants import predict_quant

    pred = predict_quant(read_header(build_shape(name)), "Q4_K_M")
    return {t.name: t.type_name.lower() for t in pred.tensors}
