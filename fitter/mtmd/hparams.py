"""An mmproj GGUF's vision hparams, as tools/mtmd/clip.cpp clip_model_loader::load_hparams reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fitter.errors import GGFitError
from fitter.gguf.reader import GGUFHeader, TensorInfo

# clip-impl.h PROJECTOR_TYPE_NAMES of the projector types whose graph builder fitter.mtmd.models mirrors
GEMMA3, QWEN2VL, QWEN25VL, QWEN3VL = "gemma3", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger"
GEMMA4V, PIXTRAL = "gemma4v", "pixtral"
# Gemma 4's per-weight clamp scalars: clip reads them from the file (get_scalar), never into the weight buffer
CLAMP_SUFFIXES = (".input_max", ".input_min", ".output_max", ".output_min")
FFN_GELU, FFN_SILU, FFN_GELU_QUICK = "gelu", "silu", "gelu_quick"


class MmprojError(GGFitError):
    """An --mmproj file clip.cpp would refuse (not a projector, a key missing)."""


@dataclass
class ClipHparams:
    path: str
    proj_type: str
    n_embd: int
    n_head: int
    n_head_kv: int
    d_head: int
    n_ff: int
    n_layer: int
    projection_dim: int
    image_size: int
    patch_size: int
    eps: float
    ffn_op: str
    n_merge: int = 1
    n_wa_pattern: int = 0
    warmup_image_size: int = 0
    largest_image_size: int = 0  # the side of the largest square image the preprocessor makes (0: the warmup's)
    deepstack_layers: list[int] = field(default_factory=list)
    has_audio: bool = False  # clip.has_audio_encoder: mtmd makes a second clip context for it
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.tensors


# the largest clip.vision.image_size taken as a projector's (released ones: 224 to 1540); beyond, the header is hostile
_MAX_IMAGE_SIZE = 1 << 16


def _get(md: dict, key: str, path: str, required: bool = True, default: object = None) -> object:
    if key in md:
        return md[key]
    if required:  # clip_model_loader::get_u32 / get_string: "key not found in model"
        raise MmprojError(f"--mmproj {path}: key {key} not found (not a vision projector clip.cpp can load)")
    return default


def _check_sizes(hp: ClipHparams, path: str) -> None:
    """The sizes clip.cpp builds the warmup graph from must be those of the file's tensors: otherwise clip.cpp divides
    by zero (d_head = n_embd / n_head), aborts on a reshape, or fails the load ("unable to find tensor")."""
    for key, v in (("clip.vision.attention.head_count", hp.n_head), ("clip.vision.embedding_length", hp.n_embd),
                   ("clip.vision.block_count", hp.n_layer)):
        if v <= 0:
            raise MmprojError(f"--mmproj {path}: {key} {v}: must be positive")
    patch = hp.tensors.get("v.patch_embd.weight")
    if patch is not None and patch.shape[-1] != hp.n_embd:
        raise MmprojError(f"--mmproj {path}: clip.vision.embedding_length {hp.n_embd} is not the patch embedding's "
                          f"width ({patch.shape[-1]})")
    merger = hp.tensors.get("mm.2.weight")  # the Qwen-VL merger's output: clip.cpp reshapes to projection_dim
    if hp.proj_type == QWEN25VL and merger is not None and merger.shape[1] != hp.projection_dim:
        raise MmprojError(f"--mmproj {path}: clip.vision.projection_dim {hp.projection_dim} is not the merger's "
                          f"output width ({merger.shape[1]})")
    missing = next((il for il in range(hp.n_layer) if not any(n.startswith(f"v.blk.{il}.") for n in hp.tensors)), None)
    if missing is not None:
        raise MmprojError(f"--mmproj {path}: clip.vision.block_count {hp.n_layer}, but no tensor of layer {missing} "
                          "(clip.cpp: unable to find tensor)")


# long because clip_model_loader::load_hparams (tools/mtmd/clip.cpp, 878 lines), in its order
def load_clip_hparams(header: GGUFHeader, path: str) -> ClipHparams:
    """clip_model_loader::load_hparams for the vision modality (the projector type, sizes, the warmup image size)."""
    md = header.metadata
    if header.architecture != "clip":
        raise MmprojError(f"--mmproj {path}: general.architecture is {header.architecture!r}, not 'clip' "
                          "(an mmproj file holds the vision projector, not the text model)")
    if not md.get("clip.has_vision_encoder", False):
        raise MmprojError(f"--mmproj {path}: no vision encoder (clip.has_vision_encoder); audio projectors are "
                          "not modelled")
    proj = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    if not isinstance(proj, str):
        raise MmprojError(f"--mmproj {path}: key clip.projector_type not found")
    if proj == "qwen2.5o":  # clip_model_loader: the legacy omni type is QWEN25VL for vision
        proj = QWEN25VL
    n_embd = int(_get(md, "clip.vision.embedding_length", path))  # type: ignore[call-overload]
    n_head = int(_get(md, "clip.vision.attention.head_count", path))  # type: ignore[call-overload]
    d_head = int(md.get("clip.vision.attention.head_dim", 0)) or (n_embd // n_head if n_head else 0)
    use_gelu, use_silu = bool(md.get("clip.use_gelu", False)), bool(md.get("clip.use_silu", False))
    hp = ClipHparams(
        path=path, proj_type=proj, n_embd=n_embd, n_head=n_head,
        n_head_kv=int(md.get("clip.vision.attention.head_count_kv", n_head)), d_head=d_head,
        n_ff=int(_get(md, "clip.vision.feed_forward_length", path)),  # type: ignore[call-overload]
        n_layer=int(_get(md, "clip.vision.block_count", path)),  # type: ignore[call-overload]
        projection_dim=int(_get(md, "clip.vision.projection_dim", path)),  # type: ignore[call-overload]
        image_size=int(_get(md, "clip.vision.image_size", path)),  # type: ignore[call-overload]
        patch_size=int(_get(md, "clip.vision.patch_size", path)),  # type: ignore[call-overload]
        eps=float(_get(md, "clip.vision.attention.layer_norm_epsilon", path)),  # type: ignore[arg-type]
        ffn_op=FFN_GELU if use_gelu else FFN_SILU if use_silu else FFN_GELU_QUICK,
        tensors={t.name: t for t in header.tensors if not t.name.endswith(CLAMP_SUFFIXES)},
    )
    hp.has_audio = bool(md.get("clip.has_audio_encoder", False))
    _check_sizes(hp, path)
    if hp.patch_size <= 0:
        raise MmprojError(f"--mmproj {path}: clip.vision.patch_size {hp.patch_size}: must be positive")
    if not hp.patch_size <= hp.image_size <= _MAX_IMAGE_SIZE:
        raise MmprojError(f"--mmproj {path}: clip.vision.image_size {hp.image_size}: must be at least the patch size "
                          f"({hp.patch_size}) and at most {_MAX_IMAGE_SIZE} (not a projector clip.cpp can warm up)")
    hp.warmup_image_size = hp.image_size  # load_hparams: "default warmup value"
    if proj == GEMMA3:
        hp.n_merge = int(md.get("clip.vision.projector.scale_factor", 4))
    elif proj in (QWEN2VL, QWEN25VL, QWEN3VL):
        hp.n_merge = int(md.get("clip.vision.spatial_merge_size", 2))
        if proj == QWEN25VL and "clip.vision.n_wa_pattern" not in md:
            raise MmprojError(f"--mmproj {path}: key clip.vision.n_wa_pattern not found")
        hp.n_wa_pattern = int(md.get("clip.vision.n_wa_pattern", 0))
        # set_limit_image_tokens(8, 4096) then set_warmup_n_tokens(46*46): the warmup image is 46 merged tokens a side
        side = int(math.isqrt(46 * 46))
        hp.warmup_image_size = side * hp.patch_size * hp.n_merge
        # image_max_pixels = 4096 tokens x patch_area: an image can be larger than the warmup's (clip_encode then
        # grows the compute buffer: ggml_backend_sched_alloc_graph)
        hp.largest_image_size = int(math.isqrt(4096)) * hp.patch_size * hp.n_merge
    elif proj == GEMMA4V:
        hp.n_merge = int(md.get("clip.vision.projector.scale_factor", 3))  # pooling_kernel_size
        # set_limit_image_tokens(70, 1120) then set_warmup_n_tokens(256): 16 pooled tokens a side
        hp.warmup_image_size = 16 * hp.patch_size * hp.n_merge
        hp.largest_image_size = int(math.isqrt(1120)) * hp.patch_size * hp.n_merge
    elif proj == PIXTRAL:
        hp.n_merge = int(md.get("clip.vision.spatial_merge_size", 1))  # the original Pixtral does not merge patches
        # set_limit_image_tokens(8, 1024) then set_warmup_n_tokens(256)
        hp.warmup_image_size = 16 * hp.patch_size * hp.n_merge
        hp.largest_image_size = int(math.isqrt(1024)) * hp.patch_size * hp.n_merge
    if proj == QWEN3VL:
        hp.deepstack_layers = [il for il in range(hp.n_layer) if f"v.deepstack.{il}.fc1.weight" in hp.tensors]
    return hp


# clip.cpp clip_n_mmproj_embd: the width of the embeddings a projector type hands the text model, as (the tensor
# load_tensors reads for it, the ggml dimension); the vision types whose tensor names are certain here
_MMPROJ_EMBD: dict[str, tuple[str, int]] = {
    "mlp": ("mm.2.weight", 1), PIXTRAL: ("mm.2.weight", 1), "lightonocr": ("mm.2.weight", 1),
    "lfm2": ("mm.2.weight", 1), "kimivl": ("mm.2.weight", 1), "mlp_norm": ("mm.3.bias", 0),
    QWEN2VL: ("mm.2.bias", 0), QWEN25VL: ("mm.2.bias", 0), QWEN3VL: ("mm.2.bias", 0),  # mm_1_b is mm.2.bias
    GEMMA3: ("mm.input_projection.weight", 0), "gemma3nv": ("mm.input_projection.weight", 0),
    GEMMA4V: ("mm.input_projection.weight", 1), "idefics3": ("mm.model.fc.weight", 1),
    "internvl": ("mm.model.mlp.3.weight", 1),
}


def mmproj_n_embd(hp: ClipHparams) -> int | None:
    """clip_n_mmproj_embd (clip.cpp): None for a type not in the table above (not checked)."""
    where = _MMPROJ_EMBD.get(hp.proj_type)
    t = hp.tensors.get(where[0]) if where else None
    if where is None or t is None or len(t.shape) <= where[1]:
        return None
    n = int(t.shape[where[1]])
    return n * (1 + len(hp.deepstack_layers)) if hp.proj_type == QWEN3VL else n  # main path + deepstack paths


def check_text_model(hp: ClipHparams, n_embd_text: int) -> None:
    """mtmd_context::mtmd_context (mtmd.cpp): the projector's width must be the text model's input width
    (llama_model_n_embd_inp), else it throws; llama-server then fails to load the multimodal model."""
    n_embd_clip = mmproj_n_embd(hp)
    if n_embd_clip is not None and n_embd_text > 0 and n_embd_text != n_embd_clip:
        raise MmprojError(f"--mmproj {hp.path}: mismatch between text model (n_embd = {n_embd_text}) and mmproj "
                          f"(n_embd = {n_embd_clip}); llama.cpp refuses the pair (you may be using the wrong mmproj)")

