"""Synthetic multimodal projector (mmproj) GGUFs: random weights, clip.cpp's own keys and tensor names.

Kept apart from the text-model REGISTRY (tests that load every registered architecture with llama.cpp would
take a projector for a model). ``build_mmproj("gemma3", image_size=224)`` returns a cached path, built on first
use under ``${GGFIT_CACHE:-~/.cache/ggfit}/synth/`` like ``tests.synth.build``.

Keys and names: tools/mtmd/clip-impl.h (KEY_*, TN_*); which tensors each projector type loads:
clip.cpp clip_model_loader::load_tensors; shapes as clip's graph builders read them (ggml order).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path
from typing import Any, Callable

from tests.synth.common import GGUF_VERSION, SYNTH_VERSION, cache_dir, make_vocab, options, write_gguf, write_once

_MMPROJ: dict[str, Callable[..., Path]] = {}


def _register(name: str) -> Callable[[Callable[..., Path]], Callable[..., Path]]:
    def deco(fn: Callable[..., Path]) -> Callable[..., Path]:
        _MMPROJ[name] = fn
        return fn
    return deco


# The vision towers of released models (their HF configs), for full-size headers: write them with sparse=True
# (no data: the file is a hole of the right size; clip reads zeros)
FULL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # Gemma 3 4B-27B: SigLIP-So400m at 896 px, projected to Gemma 3 27B's 5376
    "gemma3-27b": ("gemma3", dict(n_layer=27, n_embd=1152, n_ff=4304, n_head=16, proj_dim=5376, image_size=896)),
    # Qwen2.5-VL-7B: 32 layers, full attention every 8th (fullatt_block_indexes 7, 15, 23, 31)
    "qwen25vl-7b": ("qwen25vl", dict(n_layer=32, n_embd=1280, n_ff=3420, n_head=16, proj_dim=3584, n_wa_pattern=8)),
    # Qwen3-VL-8B: 27 layers, 48x48 learned positions, deepstack after layers 8, 16, 24
    "qwen3vl-8b": ("qwen3vl", dict(n_layer=27, n_embd=1152, n_ff=4304, n_head=16, proj_dim=4096,
                                   deepstack=(8, 16, 24))),
}


def build_mmproj(kind: str, **overrides: Any) -> Path:
    """Path of the cached mmproj GGUF of projector `kind` with `overrides`; built on first use."""
    src = hashlib.sha256(Path(inspect.getsourcefile(build_mmproj) or __file__).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps({"kind": kind, "o": overrides, "v": SYNTH_VERSION, "gguf": GGUF_VERSION,
                                     "src": src}, sort_keys=True, default=repr).encode()).hexdigest()[:16]
    return write_once(cache_dir() / f"mmproj-{kind}-{key}.gguf", lambda tmp: _MMPROJ[kind](tmp, **overrides))


def _common_keys(proj: str, o: dict[str, Any]) -> dict[str, Any]:
    return {
        "clip.projector_type": proj,
        "clip.has_vision_encoder": True,
        "clip.vision.embedding_length": o["n_embd"],
        "clip.vision.feed_forward_length": o["n_ff"],
        "clip.vision.block_count": o["n_layer"],
        "clip.vision.projection_dim": o["proj_dim"],
        "clip.vision.attention.head_count": o["n_head"],
        "clip.vision.attention.layer_norm_epsilon": 1e-6,
        "clip.vision.image_size": o["image_size"],
        "clip.vision.patch_size": o["patch_size"],
        "clip.vision.image_mean": [0.5, 0.5, 0.5],
        "clip.vision.image_std": [0.5, 0.5, 0.5],
    }


def _vit_layers(o: dict[str, Any], *, ln_bias: bool, gate: bool, ffn_bias: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    e, f = o["n_embd"], o["n_ff"]
    t: list[tuple[str, tuple[int, ...]]] = []
    for i in range(o["n_layer"]):
        p = f"v.blk.{i}."
        for w in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t += [(p + w + ".weight", (e, e)), (p + w + ".bias", (e,))]
        for n in ("ln1", "ln2"):
            t.append((p + n + ".weight", (e,)))
            if ln_bias:
                t.append((p + n + ".bias", (e,)))
        t.append((p + "ffn_up.weight", (e, f)))
        if gate:
            t.append((p + "ffn_gate.weight", (e, f)))
        t.append((p + "ffn_down.weight", (f, e)))
        if ffn_bias:
            t += [(p + "ffn_up.bias", (f,)), (p + "ffn_down.bias", (e,))]
            if gate:
                t.append((p + "ffn_gate.bias", (f,)))
    return t


@_register("gemma3")
def _gemma3(path: Path, **overrides: Any) -> Path:
    """SigLIP + the Gemma 3 projector (PROJECTOR_TYPE_GEMMA3: siglip.cpp, avg-pool by n_merge, soft-emb norm)."""
    o = options(dict(n_layer=2, n_embd=64, n_ff=160, n_head=4, proj_dim=96, image_size=224, patch_size=14,
                     n_merge=None, projector_type="gemma3", pos_f32=False, ftype="f16", seed=0, sparse=False), overrides)
    e, ps = o["n_embd"], o["patch_size"]
    hp = _common_keys(o["projector_type"], o) | {"clip.use_gelu": True}
    if o["n_merge"] is not None:
        hp["clip.vision.projector.scale_factor"] = o["n_merge"]
    n_pos = (o["image_size"] // ps) ** 2
    t = [("v.patch_embd.weight", (ps, ps, 3, e)), ("v.patch_embd.bias", (e,)), ("v.position_embd.weight", (e, n_pos))]
    t += _vit_layers(o, ln_bias=True, gate=False)
    t += [("v.post_ln.weight", (e,)), ("v.post_ln.bias", (e,)),
          ("mm.input_projection.weight", (o["proj_dim"], e)), ("mm.soft_emb_norm.weight", (e,))]
    return write_gguf(path, "clip", hp, t, ftype=o["ftype"], seed=o["seed"], vocab=make_vocab("gpt2", 260),
                      name="synthetic gemma3 mmproj", sparse=o["sparse"],
                      # released files keep it f32; an f16 one loads and reserves, but the CPU cannot add it
                      tensor_types={"v.position_embd.weight": "f32"} if o["pos_f32"] else None)


@_register("qwen25vl")
def _qwen25vl(path: Path, **overrides: Any) -> Path:
    """The Qwen2.5-VL vision tower and merger (PROJECTOR_TYPE_QWEN25VL: qwen2vl.cpp, window attention, RMS norm,
    SwiGLU); with v2=True, Qwen2-VL's (PROJECTOR_TYPE_QWEN2VL: layer norm with bias, quick GELU, no gate)."""
    o = options(dict(n_layer=4, n_embd=64, n_ff=160, n_head=4, proj_dim=96, image_size=560, patch_size=14,
                     n_wa_pattern=2, v2=False, ftype="f16", seed=0, sparse=False), overrides)
    e, ps, v2 = o["n_embd"], o["patch_size"], o["v2"]
    hp = _common_keys("qwen2vl_merger" if v2 else "qwen2.5vl_merger", o) | {"clip.vision.spatial_merge_size": 2}
    if not v2:
        hp |= {"clip.use_silu": True, "clip.vision.n_wa_pattern": o["n_wa_pattern"]}
    t = [("v.patch_embd.weight", (ps, ps, 3, e)), ("v.patch_embd.weight.1", (ps, ps, 3, e))]
    t += _vit_layers(o, ln_bias=v2, gate=not v2)
    t += [("v.post_ln.weight", (e,))] + ([("v.post_ln.bias", (e,))] if v2 else []) + [
          ("mm.0.weight", (4 * e, 4 * e)), ("mm.0.bias", (4 * e,)),
          ("mm.2.weight", (4 * e, o["proj_dim"])), ("mm.2.bias", (o["proj_dim"],))]
    return write_gguf(path, "clip", hp, t, ftype=o["ftype"], seed=o["seed"], vocab=make_vocab("gpt2", 260),
                      name="synthetic qwen2.5-vl mmproj", sparse=o["sparse"])


@_register("qwen3vl")
def _qwen3vl(path: Path, **overrides: Any) -> Path:
    """The Qwen3-VL vision tower (PROJECTOR_TYPE_QWEN3VL: qwen3vl.cpp, fused QKV, learned positions, deepstack)."""
    o = options(dict(n_layer=4, n_embd=64, n_ff=160, n_head=4, proj_dim=96, image_size=768, patch_size=16,
                     n_pos_side=48, deepstack=(1, 2), ftype="f16", seed=0, sparse=False), overrides)
    e, ps = o["n_embd"], o["patch_size"]
    hp = _common_keys("qwen3vl_merger", o) | {"clip.use_gelu": True, "clip.vision.spatial_merge_size": 2}
    t = [("v.patch_embd.weight", (ps, ps, 3, e)), ("v.patch_embd.weight.1", (ps, ps, 3, e)),
         ("v.patch_embd.bias", (e,)), ("v.position_embd.weight", (e, o["n_pos_side"] ** 2))]
    for i in range(o["n_layer"]):
        p = f"v.blk.{i}."
        t += [(p + "attn_qkv.weight", (e, 3 * e)), (p + "attn_qkv.bias", (3 * e,)),
              (p + "attn_out.weight", (e, e)), (p + "attn_out.bias", (e,)),
              (p + "ln1.weight", (e,)), (p + "ln1.bias", (e,)), (p + "ln2.weight", (e,)), (p + "ln2.bias", (e,)),
              (p + "ffn_up.weight", (e, o["n_ff"])), (p + "ffn_up.bias", (o["n_ff"],)),
              (p + "ffn_down.weight", (o["n_ff"], e)), (p + "ffn_down.bias", (e,))]
    for i in o["deepstack"]:
        p = f"v.deepstack.{i}."
        t += [(p + "norm.weight", (4 * e,)), (p + "norm.bias", (4 * e,)), (p + "fc1.weight", (4 * e, 4 * e)),
              (p + "fc1.bias", (4 * e,)), (p + "fc2.weight", (4 * e, o["proj_dim"])), (p + "fc2.bias", (o["proj_dim"],))]
    t += [("v.post_ln.weight", (e,)), ("v.post_ln.bias", (e,)),
          ("mm.0.weight", (4 * e, 4 * e)), ("mm.0.bias", (4 * e,)),
          ("mm.2.weight", (4 * e, o["proj_dim"])), ("mm.2.bias", (o["proj_dim"],))]
    return write_gguf(path, "clip", hp, t, ftype=o["ftype"], seed=o["seed"], vocab=make_vocab("gpt2", 260),
                      name="synthetic qwen3-vl mmproj", tensor_types={"v.position_embd.weight": "f32"},
                      sparse=o["sparse"])


@_register("gemma4v")
def _gemma4v(path: Path, **overrides: Any) -> Path:
    """Gemma 4's vision tower (PROJECTOR_TYPE_GEMMA4V: gemma4v.cpp): per-head Q/K norms, GeGLU, post norms, a layer
    scalar, 2-D position tables, clamp scalars next to some weights (read by clip, not loaded), std bias/scale."""
    o = options(dict(n_layer=2, n_embd=64, n_ff=160, n_head=4, proj_dim=96, image_size=224, patch_size=16,
                     pos_size=64, std=True, audio=False, ftype="f16", seed=0, sparse=False), overrides)
    e, ps, f, dh = o["n_embd"], o["patch_size"], o["n_ff"], o["n_embd"] // o["n_head"]
    hp = _common_keys("gemma4v", o) | {"clip.use_gelu": True}
    del hp["clip.projector_type"]
    hp["clip.vision.projector_type"] = "gemma4v"  # Gemma4VisionAudioModel: the per-modality key
    if o["audio"]:  # only the flag (not loadable by clip: no audio hparams or tensors)
        hp["clip.has_audio_encoder"] = True
    t = [("v.patch_embd.weight", (ps, ps, 3, e)), ("v.position_embd.weight", (e, o["pos_size"], 2))]
    for i in range(o["n_layer"]):
        p = f"v.blk.{i}."
        for w in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t.append((p + w + ".weight", (e, e)))
        t += [(p + "attn_q_norm.weight", (dh,)), (p + "attn_k_norm.weight", (dh,)), (p + "ln1.weight", (e,)),
              (p + "ln2.weight", (e,)), (p + "attn_post_norm.weight", (e,)), (p + "ffn_post_norm.weight", (e,)),
              (p + "ffn_gate.weight", (e, f)), (p + "ffn_up.weight", (e, f)), (p + "ffn_down.weight", (f, e)),
              (p + "out_scale.weight", (1,))]
        t += [(p + "attn_q" + s, (1,)) for s in (".input_max", ".input_min", ".output_max", ".output_min")]
    if o["std"]:
        t += [("v.std_bias", (e,)), ("v.std_scale", (e,))]
    t += [("mm.input_projection.weight", (e, o["proj_dim"]))]
    return write_gguf(path, "clip", hp, t, ftype=o["ftype"], seed=o["seed"], vocab=make_vocab("gpt2", 260),
                      name="synthetic gemma4 mmproj", sparse=o["sparse"],
                      tensor_values={"*.input_max": 1e4, "*.output_max": 1e4, "*.input_min": -1e4, "*.output_min": -1e4},
                      tensor_types={"v.position_embd.weight": "f32"})


@_register("pixtral")
def _pixtral(path: Path, **overrides: Any) -> Path:
    """Pixtral's vision tower (PROJECTOR_TYPE_PIXTRAL: pixtral.cpp); merger=True: Mistral Small 3.1's patch merger
    (spatial_merge_size 2)."""
    o = options(dict(n_layer=2, n_embd=64, n_ff=160, n_head=4, proj_dim=96, image_size=1024, patch_size=16,
                     merger=True, ftype="f16", seed=0, sparse=False), overrides)
    e, ps, f = o["n_embd"], o["patch_size"], o["n_ff"]
    hp = _common_keys("pixtral", o) | {"clip.use_silu": True}
    if o["merger"]:
        hp["clip.vision.spatial_merge_size"] = 2
    t = [("v.patch_embd.weight", (ps, ps, 3, e)), ("v.pre_ln.weight", (e,))]
    for i in range(o["n_layer"]):
        p = f"v.blk.{i}."
        t += [(p + w + ".weight", (e, e)) for w in ("attn_q", "attn_k", "attn_v", "attn_out")]
        t += [(p + "ln1.weight", (e,)), (p + "ln2.weight", (e,)), (p + "ffn_gate.weight", (e, f)),
              (p + "ffn_up.weight", (e, f)), (p + "ffn_down.weight", (f, e))]
    if o["merger"]:
        t += [("mm.input_norm.weight", (e,)), ("mm.patch_merger.weight", (e * 4, e))]
    t += [("mm.1.weight", (e, o["proj_dim"])), ("mm.1.bias", (o["proj_dim"],)),
          ("mm.2.weight", (o["proj_dim"], o["proj_dim"])), ("mm.2.bias", (o["proj_dim"],)),
          ("v.token_embd.img_break", (o["proj_dim"],))]
    return write_gguf(path, "clip", hp, t, ftype=o["ftype"], seed=o["seed"], vocab=make_vocab("gpt2", 260),
                      name="synthetic pixtral mmproj", sparse=o["sparse"])
