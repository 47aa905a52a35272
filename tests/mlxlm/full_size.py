"""Full-size MLX checkpoints as header-only safetensors (the data is a hole: nothing is written).

The tensor names, shapes and dtypes are those mlx-lm itself produces: its model class is built
lazily from the published config.json (nothing is evaluated) and quantized with its own
`quantize_model`; the MTP head (`mtp.*`, one full-attention decoder layer plus the fc that joins
the hidden state and the next token's embedding) is built from the same layer class and quantized
alike. Qwen3.8-27B's text config is the published one (Qwen3_5ForConditionalGeneration); the
vision tower is not written (mlx-lm drops it), so "on disk" here is text + MTP only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

QWEN38_27B = {
    "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 262144, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
        "attn_output_gate": True, "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10]},
    },
}
# Qwen3.6-35B-A3B (tests/synth/shapes.py "qwen36-35b-a3b": the GGUF's hyperparameters)
QWEN36_35B_A3B = {
    "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 262144, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
        "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10]},
    },
}
CONFIGS = {"qwen3.8-27b": QWEN38_27B, "qwen3.6-35b-a3b": QWEN36_35B_A3B}
_DT = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint32": "U32"}


def _bf16(module):
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    module.update(tree_map_with_path(lambda p, x: x if p.endswith("A_log") else x.astype(mx.bfloat16),
                                     module.parameters()))
    return module


def _tensors(config: dict, bits: int, group_size: int) -> tuple[dict, dict]:
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5
    from mlx_lm.utils import _get_classes, quantize_model

    model_class, args_class = _get_classes(config)
    model = _bf16(model_class(args_class.from_dict(config)))
    model, qconfig = quantize_model(model, config, group_size, bits)
    out = {k: (v.dtype, v.shape) for k, v in tree_flatten(model.parameters())}
    tc = qwen3_5.TextModelArgs.from_dict(config["text_config"])

    class _Mtp(nn.Module):  # the MTP head's tensors (names as in the released checkpoints)
        def __init__(self):
            super().__init__()
            self.layers = [qwen3_5.DecoderLayer(tc, tc.full_attention_interval - 1)]
            self.fc = nn.Linear(2 * tc.hidden_size, tc.hidden_size, bias=False)
            self.pre_fc_norm_hidden = nn.RMSNorm(tc.hidden_size)
            self.pre_fc_norm_embedding = nn.RMSNorm(tc.hidden_size)
            self.norm = nn.RMSNorm(tc.hidden_size)

    mtp = _bf16(_Mtp())
    nn.quantize(mtp, group_size=group_size, bits=bits,
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    out |= {f"mtp.{k}": (v.dtype, v.shape) for k, v in tree_flatten(mtp.parameters())}
    return out, qconfig


def write(name: str, bits: int, dest: Path, group_size: int = 64) -> Path:
    """A model directory: config.json and a header-only model.safetensors (sparse: its data is a hole)."""
    from mlx.core import Dtype  # noqa: F401  (mlx must be importable)

    d = dest / f"{name}-{bits}bit"
    d.mkdir(parents=True, exist_ok=True)
    tensors, qconfig = _tensors(CONFIGS[name], bits, group_size)
    header: dict = {}
    off = 0
    for k in sorted(tensors):
        dtype, shape = tensors[k]
        n = int(dtype.size) * int(__import__("math").prod(shape))
        header[k] = {"dtype": _DT[str(dtype).split(".")[-1]], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    (d / "config.json").write_text(json.dumps(qconfig))
    return d
