"""Full-size MLX checkpoints as header-only safetensors (the data is a hole: nothing is written).

Laid out as the published mlx-community conversions are: `mlx_vlm.convert` (mlx-vlm 0.6.15, which
made mlx-community/Qwen3.8-27B-{4,8}bit) loads the whole Qwen3_5ForConditionalGeneration, quantizes
the text model and keeps the vision tower in bf16 (convert.base_quant_predicate: skip_multimodal_module),
and drops the MTP head (qwen3_5.Model.sanitize: "mtp." keys). The MTP head ships as its own drafter
directory (mlx-community/Qwen3.8-27B-MTP-4bit), written by mlx-vlm's Qwen3_5MTPSplitter.

The tensors come from the libraries' own classes, built lazily (nothing is evaluated): the text model
is mlx-lm's, from the published text_config, quantized by mlx-lm's `quantize_model` (the same
predicate as mlx-vlm's for these models, the MoE router gates' 8-bit override included); the vision
tower's parameter tree mirrors mlx-vlm's qwen3_vl.VisionModel (mlx-vlm is not a test dependency); the
MTP head is mlx-lm's full-attention DecoderLayer plus the fc that joins the hidden state and the next
token's embedding, named and quantized as the splitter writes it.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

# the published vision_config of Qwen3.8-27B (Qwen3_5ForConditionalGeneration)
VISION_27B = {
    "model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "num_position_embeddings": 2304, "out_hidden_size": 5120, "deepstack_visual_indexes": [],
}
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
    "vision_config": VISION_27B,
}
# Qwen3.6-35B-A3B (tests/synth/shapes.py "qwen36-35b-a3b": the GGUF's hyperparameters); its vision
# tower is the 27B's projected to the MoE's 2048 (vision_config.out_hidden_size)
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
    "vision_config": VISION_27B | {"model_type": "qwen3_5_moe", "out_hidden_size": 2048},
}
CONFIGS = {"qwen3.8-27b": QWEN38_27B, "qwen3.6-35b-a3b": QWEN36_35B_A3B}
_DT = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint32": "U32"}


def _bf16(module):
    """mlx_vlm.convert casts every floating parameter to the model's dtype but A_log (cast_predicate)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    module.update(tree_map_with_path(lambda p, x: x if p.endswith("A_log") else x.astype(mx.bfloat16),
                                     module.parameters()))
    return module


def _module(**children):
    import mlx.nn as nn

    m = nn.Module()
    for k, v in children.items():
        setattr(m, k, v)
    return m


def _vision_tower(vc: dict):
    """mlx-vlm 0.6.15 models/qwen3_vl/vision.py VisionModel's parameters (PatchEmbed, pos_embed, blocks of
    LayerNorm + Attention(qkv, proj) + MLP(linear_fc1, linear_fc2), PatchMerger; no deepstack mergers)."""
    import mlx.nn as nn

    h, f, k = vc["hidden_size"], vc["intermediate_size"], (vc["temporal_patch_size"], vc["patch_size"], vc["patch_size"])
    merged = h * vc["spatial_merge_size"] ** 2
    block = lambda: _module(  # noqa: E731
        norm1=nn.LayerNorm(h), norm2=nn.LayerNorm(h),
        attn=_module(qkv=nn.Linear(h, 3 * h, bias=True), proj=nn.Linear(h, h)),
        mlp=_module(linear_fc1=nn.Linear(h, f, bias=True), linear_fc2=nn.Linear(f, h, bias=True)))
    return _module(
        patch_embed=_module(proj=nn.Conv3d(vc["in_channels"], h, kernel_size=k, stride=k, bias=True)),
        pos_embed=nn.Embedding(vc["num_position_embeddings"], h),
        blocks=[block() for _ in range(vc["depth"])],
        merger=_module(norm=nn.LayerNorm(h), linear_fc1=nn.Linear(merged, merged),
                       linear_fc2=nn.Linear(merged, vc["out_hidden_size"])))


def _shapes(module) -> dict:
    from mlx.utils import tree_flatten

    return {k: (v.dtype, v.shape) for k, v in tree_flatten(module.parameters())}


def _target(config: dict, bits: int, group_size: int) -> tuple[dict, dict]:
    from mlx_lm.utils import _get_classes, quantize_model

    model_class, args_class = _get_classes(config)
    model = _bf16(model_class(args_class.from_dict(config)))
    model, qconfig = quantize_model(model, config, group_size, bits)
    out = _shapes(model)
    out |= {f"vision_tower.{k}": v for k, v in _shapes(_bf16(_vision_tower(config["vision_config"]))).items()}
    return out, qconfig


def _mtp(config: dict, bits: int, group_size: int) -> dict:
    """The drafter's tensors: mtp_split.Qwen3_5MTPSplitter drops the "mtp." prefix and, asked for `bits`,
    quantizes every 2-D `.weight` whose rows divide into groups (MTPSplitter._affine_quantize)."""
    import mlx.nn as nn
    from mlx_lm.models import qwen3_5

    tc = qwen3_5.TextModelArgs.from_dict(config["text_config"])
    mtp = _bf16(_module(
        layers=[qwen3_5.DecoderLayer(tc, tc.full_attention_interval - 1)],  # a full-attention layer
        fc=nn.Linear(2 * tc.hidden_size, tc.hidden_size, bias=False),
        pre_fc_norm_hidden=nn.RMSNorm(tc.hidden_size), pre_fc_norm_embedding=nn.RMSNorm(tc.hidden_size),
        norm=nn.RMSNorm(tc.hidden_size)))
    nn.quantize(mtp, group_size=group_size, bits=bits,
                class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0)
    return _shapes(mtp)


def _write_safetensors(path: Path, tensors: dict) -> None:
    header: dict = {"__metadata__": {"format": "mlx"}}
    off = 0
    for k in sorted(tensors):
        dtype, shape = tensors[k]
        n = int(dtype.size) * math.prod(shape)
        header[k] = {"dtype": _DT[str(dtype).split(".")[-1]], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)


def write(name: str, bits: int, dest: Path, group_size: int = 64) -> Path:
    """The converted model's directory: config.json and a header-only model.safetensors (sparse)."""
    d = dest / f"{name}-{bits}bit"
    d.mkdir(parents=True, exist_ok=True)
    tensors, qconfig = _target(CONFIGS[name], bits, group_size)
    _write_safetensors(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps(qconfig))
    return d


def write_drafter(name: str, bits: int, dest: Path, group_size: int = 64) -> Path:
    """The MTP drafter's directory, as MTPSplitter.split writes it (model_type qwen3_5_mtp)."""
    d = dest / f"{name}-MTP-{bits}bit"
    d.mkdir(parents=True, exist_ok=True)
    config = CONFIGS[name]
    _write_safetensors(d / "model.safetensors", _mtp(config, bits, group_size))
    q = {"group_size": group_size, "bits": bits, "mode": "affine"}
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_mtp", "text_config": config["text_config"], "block_size": 3,
        "tie_word_embeddings": False, "quantization": q, "quantization_config": q}))
    return d
