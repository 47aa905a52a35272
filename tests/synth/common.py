"""Synthetic GGUF models: random weights, real llama.cpp architectures.

Each builder writes a tiny GGUF with llama.cpp's real hparam keys, tensor names and tensor shapes,
so llama.cpp loads it and decodes tokens like any model (the logits are noise, but finite). They are
the test corpus for the header reader, ``ggfit inspect`` and the memory model.

Using them::

    from tests.synth import build
    path = build("gemma3", n_layer=8, n_ctx_train=8192)      # cached GGUF path

``build`` caches under ``${GGFIT_CACHE:-~/.cache/ggfit}/synth/``; the key hashes the builder name,
the overrides, ``SYNTH_VERSION``, the gguf-py version and the source of ``common.py`` plus the
builder's module, so editing a builder invalidates its models without manual cleanup.

Adding an architecture
----------------------
1. Read ``src/models/<arch>.cpp`` in the reference llama.cpp: ``load_arch_hparams`` tells which keys
   are required (``ml.get_key(..., required=true)`` is the default) and ``load_arch_tensors`` which
   tensors exist and their shapes. Every ``create_tensor`` without ``TENSOR_NOT_REQUIRED`` must be
   written; any tensor in the file that the model does not create makes the load fail ("wrong number
   of tensors"), so optional tensors are either written on purpose or not at all.
2. Write a builder in a module of this package and register it::

       @register("myarch")
       def build_myarch(path: Path, **overrides) -> Path:
           o = options(dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                            n_ctx_train=4096, n_vocab=DEFAULT_N_VOCAB, ftype="f16", seed=0), overrides)
           hp = {"context_length": o["n_ctx_train"], "block_count": o["n_layer"], ...}
           t = [("token_embd.weight", (o["n_embd"], o["n_vocab"])), ...]
           for i in range(o["n_layer"]):
               t += [(blk(i, "attn_q.weight"), (o["n_embd"], o["n_embd"])), ...]
           return write_gguf(path, "myarch", hp, t, ftype=o["ftype"], seed=o["seed"])

   Shapes are in ggml order, exactly as llama.cpp's ``create_tensor(name, {ne0, ne1, ...})``.
   Hparam keys may be relative to the architecture (``"attention.head_count_kv"`` becomes
   ``"myarch.attention.head_count_kv"``) or absolute (``general.*``, ``tokenizer.*``, or already
   prefixed). Python ``int`` is written as UINT32, ``float`` as FLOAT32, ``bool`` as BOOL, ``str``
   as STRING, a list of ints as an INT32 array (llama.cpp accepts INT32 or UINT32 arrays), a list
   of bools as a BOOL array, a list of floats as a FLOAT32 array; give ``(value, GGUFValueType)``
   for anything else (llama.cpp checks scalar types strictly).
3. Import the module in ``tests/synth/__init__.py`` so the builder lands in ``REGISTRY``;
   ``tests/test_synthetic_models.py`` then loads and decodes it with llama.cpp automatically.

Tensor data
-----------
* 1-D tensors, and 2-D+ tensors whose name matches ``F32_PATTERNS`` (norms, routers, SSM
  parameters) are F32; other tensors get ``ftype`` ('f32', 'f16', 'bf16', 'q8_0', 'q4_0', 'q4_1',
  'q5_0', 'q5_1', 'mxfp4', 'tq1_0', 'tq2_0' are quantized by ``gguf.quants``; 'q2_k' .. 'q6_k',
  'iq4_nl', 'iq4_xs' are written as random but valid blocks, since gguf-py cannot quantize them).
  A tensor whose row length is not a multiple of the type's block size falls back to F16, as
  llama-quantize falls back to a compatible type.
* ``tensor_types`` overrides per tensor: a mapping of fnmatch patterns to type names (first match
  wins) or a callable ``(name, shape) -> type | None``.
* Values: norms 1.0, everything else normal with std ``WEIGHT_STD``; ``tensor_values`` overrides per
  tensor (pattern -> constant, or pattern -> callable ``(rng, ggml_shape) -> np.ndarray``).
* The vocabulary is written by ``write_gguf`` too (see ``make_vocab``); its size defaults to
  ``token_embd.weight``'s ne1, so embeddings and output always agree with the tokenizer.
"""

from __future__ import annotations

import fnmatch
import hashlib
import inspect
import json
import os
from dataclasses import dataclass, field
from importlib.metadata import version as _pkg_version
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType, TokenType

__all__ = [
    "DEFAULT_N_VOCAB",
    "F32_PATTERNS",
    "REGISTRY",
    "SYNTH_VERSION",
    "Vocab",
    "WEIGHT_STD",
    "blk",
    "build",
    "cache_dir",
    "ggml_type_of",
    "make_vocab",
    "options",
    "register",
    "write_gguf",
]

SYNTH_VERSION = 1  # bump to invalidate every cached synthetic model
DEFAULT_N_VOCAB = 512
WEIGHT_STD = 0.02
GGUF_VERSION = _pkg_version("gguf")

# 2-D+ tensors kept in F32 whatever ftype says (llama-quantize / convert_hf_to_gguf keep these F32,
# and some ggml ops require F32 there, e.g. ggml_ssm_conv / ggml_ssm_scan).
F32_PATTERNS: tuple[str, ...] = (
    "*norm*",
    "*.ffn_gate_inp.*",
    "*.ffn_gate_inp_shexp.*",
    "*.exp_probs_b*",
    "*.ssm_a",
    "*.ssm_a.*",
    "*.ssm_d",
    "*.ssm_d.*",
    "*.ssm_conv1d.*",
    "*.ssm_dt.*",
    "*.time_mix_*",
    "*.channel_mix_*",
)

# fnmatch patterns whose tensors are initialised to 1.0 (norm weights; llama.cpp's gemma
# convention already includes the +1 in the stored weight).
ONES_PATTERNS: tuple[str, ...] = ("*norm.weight", "*norm_*.weight")

REGISTRY: dict[str, Callable[..., Path]] = {}


# --------------------------------------------------------------------------------------------
# registry and cache


def register(name: str) -> Callable[[Callable[..., Path]], Callable[..., Path]]:
    """Register ``fn(path, **overrides) -> Path`` (it writes the GGUF at ``path``) as ``name``."""

    def deco(fn: Callable[..., Path]) -> Callable[..., Path]:
        if name in REGISTRY and REGISTRY[name] is not fn:
            raise ValueError(f"synthetic model {name!r} registered twice")
        REGISTRY[name] = fn
        return fn

    return deco


def cache_dir() -> Path:
    base = os.environ.get("GGFIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ggfit")
    d = Path(base) / "synth"
    d.mkdir(parents=True, exist_ok=True)
    return d


_SOURCE_HASHES: dict[str, str] = {}


def _source_hash(fn: Callable[..., Any]) -> str:
    files = {__file__}
    try:
        src = inspect.getsourcefile(fn)
        if src:
            files.add(src)
    except TypeError:
        pass
    h = hashlib.sha256()
    for f in sorted(files):
        if f not in _SOURCE_HASHES:
            _SOURCE_HASHES[f] = hashlib.sha256(Path(f).read_bytes()).hexdigest()
        h.update(_SOURCE_HASHES[f].encode())
    return h.hexdigest()


def cache_key(name: str, overrides: Mapping[str, Any]) -> str:
    fn = REGISTRY[name]
    payload = json.dumps(
        {
            "name": name,
            "overrides": overrides,
            "synth_version": SYNTH_VERSION,
            "gguf": GGUF_VERSION,
            "source": _source_hash(fn),
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def build(name: str, **overrides: Any) -> Path:
    """Path of the cached GGUF of builder ``name`` with ``overrides``; built on first use."""
    if name not in REGISTRY:
        import tests.synth  # noqa: F401  (registers every builder)
    if name not in REGISTRY:
        raise KeyError(f"no synthetic model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return write_once(cache_dir() / f"{name}-{cache_key(name, overrides)}.gguf",
                      lambda tmp: REGISTRY[name](tmp, **overrides))


def write_once(path: Path, write: Callable[[Path], Any]) -> Path:
    """`path`, written by `write` (to a temporary name, then renamed) unless it is there already."""
    if path.exists():
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def options(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated by ``overrides``; an override the builder does not know is an error."""
    defaults = {**defaults, "sparse": False}  # every builder can write a header-only, full-size sparse file
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)}; known: {sorted(defaults)}")
    out = dict(defaults)
    out.update(overrides)
    return out


def blk(i: int, name: str) -> str:
    """llama.cpp's per-layer tensor name, e.g. ``blk(3, 'attn_q.weight')`` -> ``blk.3.attn_q.weight``."""
    return f"blk.{i}.{name}"


# --------------------------------------------------------------------------------------------
# vocabulary


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other tokenizer.ggml.* keys (absolute)

    def __len__(self) -> int:
        return len(self.tokens)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (what byte-level BPE vocabularies store)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"


def _merge_pieces(space: str, n: int) -> list[tuple[str, str]]:
    """``n`` (left, right) merges, each producing a new token from two existing ones: first
    space+letter, then letter pairs, then longer strings built on earlier merges (unbounded)."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    frontier = [space] + list(_LETTERS)  # level 2: space+letter and letter+letter, then longer pieces
    while len(out) < n:
        nxt: list[str] = []
        for a in frontier:
            for b in _LETTERS:
                if len(out) >= n:
                    return out
                tok = a + b
                if tok not in seen:
                    seen.add(tok)
                    out.append((a, b))
                    nxt.append(tok)
        frontier = nxt
    return out


def make_vocab(kind: str = "gpt2", n_vocab: int = DEFAULT_N_VOCAB, specials: Sequence[str] = ()) -> Vocab:
    """A tiny working tokenizer of exactly ``n_vocab`` tokens.

    ``gpt2``: byte-level BPE (256 byte tokens, merges, then <|bos|> <|endoftext|> <|pad|> as
    CONTROL), pre-tokenizer ``gpt-2``. ``spm``: SentencePiece 'llama' (<unk> <s> </s>, <0x00>..<0xFF>
    as BYTE, then ▁-prefixed pieces with descending scores), like Gemma's and Llama 2's
    vocabularies. ``specials``: more CONTROL tokens at the end (counted in ``n_vocab``).
    """
    specials = list(specials)
    if kind == "gpt2":
        n_special = 3 + len(specials)
        if n_vocab < 256 + n_special:
            raise ValueError(f"a gpt2 vocab needs at least {256 + n_special} tokens")
        b2u = _bytes_to_unicode()
        tokens = [b2u[b] for b in range(256)]
        merges = _merge_pieces(b2u[ord(" ")], n_vocab - 256 - n_special)
        tokens += [a + b for a, b in merges]
        tokens += ["<|bos|>", "<|endoftext|>", "<|pad|>"] + specials
        types = [TokenType.NORMAL] * (n_vocab - n_special) + [TokenType.CONTROL] * n_special
        return Vocab(
            model="gpt2",
            tokens=tokens,
            token_types=[int(t) for t in types],
            merges=[f"{a} {b}" for a, b in merges],
            pre="gpt-2",
            extra={
                "tokenizer.ggml.bos_token_id": 256 + len(merges),
                "tokenizer.ggml.eos_token_id": 256 + len(merges) + 1,
                "tokenizer.ggml.padding_token_id": 256 + len(merges) + 2,
                "tokenizer.ggml.add_bos_token": True,
            },
        )
    if kind == "spm":
        head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        if n_vocab < len(head) + 1 + len(specials):
            raise ValueError(f"an spm vocab needs at least {len(head) + 1 + len(specials)} tokens")
        space = "\u2581"
        pieces = [space] + [a + b for a, b in _merge_pieces(space, n_vocab - len(head) - 1 - len(specials))]
        tokens = head + pieces + specials
        types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
        types += [TokenType.NORMAL] * len(pieces) + [TokenType.CONTROL] * len(specials)
        scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))] + [0.0] * len(specials)
        return Vocab(
            model="llama",
            tokens=tokens,
            token_types=[int(t) for t in types],
            scores=scores,
            extra={
                "tokenizer.ggml.unknown_token_id": 0,
                "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.add_bos_token": True,
                "tokenizer.ggml.add_eos_token": False,
            },
        )
    raise ValueError(f"unknown vocab kind {kind!r} (gpt2, spm)")


# --------------------------------------------------------------------------------------------
# tensor types


_FILE_TYPES: dict[GGMLQuantizationType, LlamaFileType] = {
    GGMLQuantizationType.F32: LlamaFileType.ALL_F32,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    GGMLQuantizationType.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    GGMLQuantizationType.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    GGMLQuantizationType.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
    GGMLQuantizationType.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    GGMLQuantizationType.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
    GGMLQuantizationType.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    GGMLQuantizationType.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL,
    GGMLQuantizationType.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
    GGMLQuantizationType.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
    GGMLQuantizationType.TQ1_0: LlamaFileType.MOSTLY_TQ1_0,
    GGMLQuantizationType.TQ2_0: LlamaFileType.MOSTLY_TQ2_0,
}

# Byte offsets of the f16 scale fields in one block, for types written as random valid blocks
# (block layouts from ggml-common.h). Every other byte is random quant data.
_RANDOM_BLOCK_F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    GGMLQuantizationType.Q2_K: (80, 82),  # scales[16], qs[64], d, dmin
    GGMLQuantizationType.Q3_K: (108,),  # hmask[32], qs[64], scales[12], d
    GGMLQuantizationType.Q4_K: (0, 2),  # d, dmin, scales[12], qs[128]
    GGMLQuantizationType.Q5_K: (0, 2),  # d, dmin, scales[12], qh[32], qs[128]
    GGMLQuantizationType.Q6_K: (208,),  # ql[128], qh[64], scales[16], d
    GGMLQuantizationType.IQ4_NL: (0,),  # d, qs[16]
    GGMLQuantizationType.IQ4_XS: (0,),  # d, scales_h, scales_l[4], qs[128]
}
_RANDOM_BLOCK_SCALE = 2.0e-4


def ggml_type_of(t: str | int | GGMLQuantizationType) -> GGMLQuantizationType:
    if isinstance(t, GGMLQuantizationType):
        return t
    if isinstance(t, int):
        return GGMLQuantizationType(t)
    try:
        return GGMLQuantizationType[t.upper()]
    except KeyError:
        raise ValueError(f"unknown ggml type {t!r}") from None


def _can_write(qt: GGMLQuantizationType) -> bool:
    if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or qt in _RANDOM_BLOCK_F16_FIELDS:
        return True
    return gguf.quants._type_traits.get(qt) is not None  # noqa: SLF001


def _encode(data: np.ndarray, qt: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Tensor bytes (or a float array) of ``data`` (numpy order) as ``qt``."""
    if qt in _RANDOM_BLOCK_F16_FIELDS:
        block, size = GGML_QUANT_SIZES[qt]
        n_blocks = data.size // block
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        scale = np.frombuffer(np.float16(_RANDOM_BLOCK_SCALE).tobytes(), dtype=np.uint8)
        for off in _RANDOM_BLOCK_F16_FIELDS[qt]:
            raw[:, off : off + 2] = scale
        return raw.reshape(*data.shape[:-1], data.shape[-1] // block * size)
    return gguf.quants.quantize(data, qt)


# --------------------------------------------------------------------------------------------
# writer


def _full_key(arch: str, key: str) -> str:
    if key.startswith(("general.", "tokenizer.", "split.", "adapter.", arch + ".")):
        return key
    return f"{arch}.{key}"


def _typed(value: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        v, vt = value
        if vt == GGUFValueType.ARRAY:
            raise ValueError("give arrays as (list, element GGUFValueType)")
        if isinstance(v, (list, np.ndarray)):
            return list(v), GGUFValueType.ARRAY, vt
        return v, vt, None
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, bool):
        return value, GGUFValueType.BOOL, None
    if isinstance(value, (int, np.integer)):
        return int(value), GGUFValueType.UINT32, None
    if isinstance(value, (float, np.floating)):
        return float(value), GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return value, GGUFValueType.STRING, None
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("empty arrays cannot be written")
        if all(isinstance(x, bool) for x in value):
            return [bool(x) for x in value], GGUFValueType.ARRAY, GGUFValueType.BOOL
        if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in value):
            return [int(x) for x in value], GGUFValueType.ARRAY, GGUFValueType.INT32
        if all(isinstance(x, (int, float, np.integer, np.floating)) for x in value):
            return [float(x) for x in value], GGUFValueType.ARRAY, GGUFValueType.FLOAT32
        if all(isinstance(x, str) for x in value):
            return list(value), GGUFValueType.ARRAY, GGUFValueType.STRING
    raise ValueError(f"cannot infer a GGUF type for {value!r}")


def _match(name: str, rules: Any, shape: tuple[int, ...]) -> Any:
    if rules is None:
        return None
    if callable(rules):
        return rules(name, shape)
    for pat, val in rules.items():
        if fnmatch.fnmatchcase(name, pat):
            return val
    return None


def _tensor_type(
    name: str, shape: tuple[int, ...], default: GGMLQuantizationType, overrides: Any
) -> GGMLQuantizationType:
    ov = _match(name, overrides, shape)
    if ov is not None:
        qt = ggml_type_of(ov)
    elif len(shape) == 1 or any(fnmatch.fnmatchcase(name, p) for p in F32_PATTERNS):
        return GGMLQuantizationType.F32
    else:
        qt = default
    block, _ = GGML_QUANT_SIZES[qt]
    if shape[0] % block != 0:
        if ov is not None:
            raise ValueError(f"{name}: ne0={shape[0]} is not a multiple of the {qt.name} block size {block}")
        return GGMLQuantizationType.F16
    if not _can_write(qt):
        raise NotImplementedError(f"{name}: cannot write {qt.name} tensors")
    return qt


def write_gguf(
    path: str | os.PathLike[str],
    arch: str,
    hparams: Mapping[str, Any],
    tensors: Sequence[tuple[str, tuple[int, ...]]],
    *,
    ftype: str | GGMLQuantizationType = "f16",
    seed: int = 0,
    vocab: Vocab | str | int | None = None,
    tensor_types: Mapping[str, Any] | Callable[[str, tuple[int, ...]], Any] | None = None,
    tensor_values: Mapping[str, Any] | None = None,
    name: str | None = None,
    sparse: bool = False,
) -> Path:
    """Write a GGUF with ``hparams`` (relative or absolute keys), a tokenizer and random ``tensors``.

    ``tensors``: ``(name, shape)`` with shape in ggml order (ne0 first). ``vocab``: a ``Vocab``, a
    kind for ``make_vocab`` ('gpt2', 'spm'), a size (gpt2 of that size), or None (gpt2 sized by
    ``token_embd.weight``'s ne1, else ``DEFAULT_N_VOCAB``). Returns ``path``.

    ``sparse``: write the header only and extend the file to its full size without writing tensor
    data (a sparse file: a full-size model's header for ggfit and llama.cpp's dry run, no disk used;
    llama.cpp must not be asked to load its weights).
    """
    path = Path(path)
    shapes = {n: tuple(int(d) for d in s) for n, s in tensors}
    if len(shapes) != len(tensors):
        dup = sorted({n for n, _ in tensors if sum(1 for m, _ in tensors if m == n) > 1})
        raise ValueError(f"duplicate tensor names: {dup}")
    default_n_vocab = shapes["token_embd.weight"][1] if "token_embd.weight" in shapes else DEFAULT_N_VOCAB
    if vocab is None:
        vocab = make_vocab("gpt2", default_n_vocab)
    elif isinstance(vocab, str):
        vocab = make_vocab(vocab, default_n_vocab)
    elif isinstance(vocab, int):
        vocab = make_vocab("gpt2", vocab)

    ftype_q = ggml_type_of(ftype)
    rng = np.random.default_rng(seed)

    w = GGUFWriter(path, arch)
    w.add_name(name or f"synthetic {arch}")
    w.add_file_type(int(_FILE_TYPES.get(ftype_q, LlamaFileType.GUESSED)))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # tokenizer
    w.add_string("tokenizer.ggml.model", vocab.model)
    if vocab.pre is not None:
        w.add_string("tokenizer.ggml.pre", vocab.pre)
    w.add_key_value("tokenizer.ggml.tokens", vocab.tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.token_type", vocab.token_types, GGUFValueType.ARRAY, GGUFValueType.INT32)
    if vocab.scores is not None:
        w.add_key_value("tokenizer.ggml.scores", vocab.scores, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    if vocab.merges:
        w.add_key_value("tokenizer.ggml.merges", vocab.merges, GGUFValueType.ARRAY, GGUFValueType.STRING)

    written: dict[str, Any] = {}
    for k, v in list(vocab.extra.items()) + list(hparams.items()):
        written[_full_key(arch, k)] = v  # hparams may override tokenizer extras
    for key, v in written.items():
        val, vt, sub = _typed(v)
        w.add_key_value(key, val, vt, sub)

    if sparse:
        return _write_sparse(w, path, tensors, shapes, ftype_q, tensor_types)

    values = dict(tensor_values or {})
    for n, shape in tensors:
        shape = shapes[n]
        qt = _tensor_type(n, shape, ftype_q, tensor_types)
        np_shape = tuple(reversed(shape))
        v = _match(n, values, shape)
        if v is None and any(fnmatch.fnmatchcase(n, p) for p in ONES_PATTERNS):
            v = 1.0
        if v is None:
            data = rng.standard_normal(np_shape, dtype=np.float32) * np.float32(WEIGHT_STD)
        elif callable(v):
            data = np.asarray(v(rng, shape), dtype=np.float32).reshape(np_shape)
        else:
            data = np.full(np_shape, float(v), dtype=np.float32)
        enc = _encode(data, qt, rng)
        if enc.dtype == np.uint8:
            w.add_tensor(n, enc, raw_shape=enc.shape, raw_dtype=qt)
        else:
            w.add_tensor(n, enc)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_sparse(w: GGUFWriter, path: Path, tensors, shapes, ftype_q, tensor_types) -> Path:
    """Header and tensor infos only; the data section is a hole of the right size."""
    end = 0
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    for n, _ in tensors:
        shape = shapes[n]
        qt = _tensor_type(n, shape, ftype_q, tensor_types)
        block, size = gguf.GGML_QUANT_SIZES[qt]
        nbytes = shape[0] // block * size
        for d in shape[1:]:
            nbytes *= d
        w.add_tensor_info(n, tuple(reversed(shape)), np.float32, nbytes, raw_dtype=qt)
        end += nbytes + (-nbytes) % align
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    header_end = path.stat().st_size
    data_start = header_end + (-header_end) % align
    os.truncate(path, data_start + end)
    return path
