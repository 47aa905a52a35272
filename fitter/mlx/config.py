"""An MLX model directory (config.json plus safetensors, local or over HTTP) -> a typed `MlxSpec`.

Mirrors mlx_lm.utils.load_model (config.json, then every `model*.safetensors`) and the ModelArgs of
mlx_lm/models/{llama,qwen2,qwen3,qwen3_moe,qwen3_next,qwen3_5,qwen3_5_moe}.py.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fitter.errors import GGFitError, SourceError, UnsupportedModelError
from fitter.mlx import MLX_LM_VERSION
from fitter.mlx.safetensors import TensorInfo, read_safetensors

_MAX_JSON = 16 * 2**20  # config.json and the shard index are small; a bigger one is not a model's
FLAT = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")  # no make_cache: --max-kv-size gives RotatingKVCache
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # make_cache: ArraysCache (gated delta net) + KVCache
LayerKind = Literal["attention", "linear"]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class MlxSpec:
    model_type: str
    n_layers: int
    layers: tuple[LayerKind, ...]
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    act_dtype: str  # the activations' (and KV cache's) dtype: the embedding's, or its scales' when quantized
    has_make_cache: bool  # the model builds its own cache (max_kv_size is then ignored: make_prompt_cache)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 0
    quant_bits: int | None = None
    quant_group_size: int | None = None
    max_position_embeddings: int = 0
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.act_dtype]

    @property
    def n_attention(self) -> int:
        return sum(k == "attention" for k in self.layers)


@dataclass(frozen=True)
class MlxModel:
    location: str
    spec: MlxSpec
    tensors: dict[str, TensorInfo]
    files: tuple[str, ...]
    file_bytes: int  # the safetensors files' sizes on disk, headers included


def _fetch_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "ggfit"}), timeout=30) as r:
            data = r.read(_MAX_JSON + 1)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise SourceError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SourceError(f"{url}: cannot fetch ({e})") from None
    if len(data) > _MAX_JSON:
        raise SourceError(f"{url}: more than {_MAX_JSON} bytes: not a model's JSON file")
    return _loads(url, data)


def _loads(name: str, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise GGFitError(f"{name}: not valid JSON ({e.__class__.__name__})") from None


def _read_json(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_JSON + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > _MAX_JSON:
        raise SourceError(f"{path}: more than {_MAX_JSON} bytes: not a model's JSON file")
    return _loads(str(path), data)


def load_mlx_model(location: str) -> MlxModel:
    """config.json and every safetensors header of an MLX model directory or its URL (headers only)."""
    remote = location.startswith(("http://", "https://"))
    base = location.rstrip("/")
    if remote:
        config = _fetch_json(base + "/config.json")
        index = _fetch_json(base + "/model.safetensors.index.json")
        names = sorted(set(index["weight_map"].values())) if isinstance(index, dict) and "weight_map" in index \
            else ["model.safetensors"]
        files = [f"{base}/{n}" for n in names]
    else:
        d = Path(location)
        if not d.is_dir():
            raise SourceError(f"{location}: not an MLX model directory (config.json and *.safetensors)")
        config = _read_json(d / "config.json")
        files = sorted(str(p) for p in d.glob("model*.safetensors"))  # mlx_lm.utils.load_model's glob
    if not isinstance(config, dict):
        raise SourceError(f"{location}: no usable config.json (an MLX model directory has one)")
    if not files:
        raise SourceError(f"{location}: no model*.safetensors files")
    tensors: dict[str, TensorInfo] = {}
    size = 0
    for f in files:
        shard, n = read_safetensors(f)
        tensors.update(shard)
        size += n
    return MlxModel(location, spec_from_config(config, tensors, where=location), tensors, tuple(files), size)


def _kind(linear: bool) -> LayerKind:
    return "linear" if linear else "attention"


_MAX = {"num_hidden_layers": 10_000}  # a layer list is built: no hostile count may size it


def _int(cfg: dict, key: str, where: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if type(v) is not int or not 0 <= v <= _MAX.get(key, 2**40):
        raise GGFitError(f"{where}: config.json: {key} = {str(v)[:40]!r} (want an integer from 0 to {_MAX.get(key, 2**40)})")
    return v


def spec_from_config(config: dict, tensors: dict[str, TensorInfo] | None = None, *, where: str = "config.json") -> MlxSpec:
    mt = config.get("model_type")
    if mt == "qwen3_5_mtp":  # mlx-vlm's speculative/drafters/qwen3_5_mtp (split out of a qwen3_5 checkpoint)
        raise UnsupportedModelError(f"{where}: an MTP drafter (model_type qwen3_5_mtp, mlx_vlm.server --draft-kind "
                                    f"mtp): mlx_lm.server {MLX_LM_VERSION} cannot load it as --draft-model")
    if mt not in FLAT + HYBRID:
        raise UnsupportedModelError(f"{where}: model_type {mt!r}: ggfit models MLX {', '.join(FLAT + HYBRID)}")
    # qwen3_5's ModelArgs.from_dict: the text model's fields under text_config, or the whole config
    cfg = config.get("text_config", config) if mt in ("qwen3_5", "qwen3_5_moe") else config
    if not isinstance(cfg, dict):
        raise GGFitError(f"{where}: config.json: text_config is not an object")
    n_layers = _int(cfg, "num_hidden_layers", where)
    hidden = _int(cfg, "hidden_size", where)
    n_heads = _int(cfg, "num_attention_heads", where)
    n_kv = _int(cfg, "num_key_value_heads", where, n_heads)
    if n_heads == 0 or n_layers == 0 or hidden == 0:
        raise GGFitError(f"{where}: config.json: zero layers, heads or hidden size")
    head_dim = _int(cfg, "head_dim", where, 0) if cfg.get("head_dim") is not None else 0
    head_dim = head_dim or hidden // n_heads
    if mt in HYBRID:
        interval = _int(cfg, "full_attention_interval", where, 4)
        # DecoderLayer: is_linear = (layer_idx + 1) % full_attention_interval != 0
        kinds: tuple[LayerKind, ...] = tuple(_kind((i + 1) % max(1, interval) != 0) for i in range(n_layers))
    else:
        kinds = tuple(_kind(False) for _ in range(n_layers))
    q = config.get("quantization") or cfg.get("quantization") or {}
    if not isinstance(q, dict) or not all(type(q.get(k, 0)) is int for k in ("bits", "group_size")):
        raise GGFitError(f"{where}: config.json: quantization = {str(q)[:60]!r} (want bits and group_size integers)")
    tie = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", mt in HYBRID)))
    act = _act_dtype(tensors or {}, config)
    return MlxSpec(
        model_type=mt, n_layers=n_layers, layers=kinds, hidden_size=hidden, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=int(head_dim), vocab_size=_int(cfg, "vocab_size", where), intermediate_size=_int(cfg, "intermediate_size", where, 0),
        tie_word_embeddings=tie, act_dtype=act, has_make_cache=mt in HYBRID,
        num_experts=_int(cfg, "num_experts", where, 0), num_experts_per_tok=_int(cfg, "num_experts_per_tok", where, 0),
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", where, 0),
        linear_num_k_heads=_int(cfg, "linear_num_key_heads", where, 0), linear_num_v_heads=_int(cfg, "linear_num_value_heads", where, 0),
        linear_k_head_dim=_int(cfg, "linear_key_head_dim", where, 0), linear_v_head_dim=_int(cfg, "linear_value_head_dim", where, 0),
        linear_conv_kernel=_int(cfg, "linear_conv_kernel_dim", where, 4 if mt in HYBRID else 0),
        quant_bits=q.get("bits") if isinstance(q, dict) else None, quant_group_size=q.get("group_size") if isinstance(q, dict) else None,
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, 0), config=config,
    )


_ST_TO_MX = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _act_dtype(tensors: dict[str, TensorInfo], config: dict) -> str:
    """The hidden states' dtype: nn.Embedding returns its weight's dtype; QuantizedEmbedding its scales'."""
    for name, t in tensors.items():
        if name.endswith("embed_tokens.scales") or (name.endswith("embed_tokens.weight") and t.dtype != "U32"):
            if t.dtype in _ST_TO_MX:
                return _ST_TO_MX[t.dtype]
    td = config.get("torch_dtype") or config.get("text_config", {}).get("torch_dtype") or "bfloat16"
    return td if td in DTYPE_BYTES else "bfloat16"
