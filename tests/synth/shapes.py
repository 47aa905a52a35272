"""Full-size shapes of real models, written as sparse header-only GGUFs (no tensor data on disk).

For ggfit's predictions and llama.cpp's dry runs at real scale. The hyperparameters are those of
the published models; the tensor types come from `tensor_types` (e.g. a Q4_K_M-like mix from
fitter.fit.quants), F16 by default. `fill_weights` then writes valid random blocks into the hole, so
that llama.cpp can load and decode the file (GPU measurements: benchmarks/gpu/).
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES

from tests.synth.common import ONES_PATTERNS, WEIGHT_STD, _encode, build, ggml_type_of

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
    # Gemma 3 27B: 62 layers, 5 sliding-window (1024) layers to 1 global, 32 heads, 16 KV heads of 128
    "gemma3-27b": ("gemma3", dict(
        n_layer=62, n_embd=5376, n_head=32, n_head_kv=16, head_dim=128, n_ff=21504, n_vocab=262208,
        n_ctx_train=131072, sliding_window=1024, rope_freq_base=1000000.0, rope_freq_base_swa=10000.0,
    )),
    # gpt-oss 20B: 24 layers, 32 MXFP4 experts (4 used) of 2880, 64 heads, 8 KV heads of 64, sliding
    # window 128 on every other layer, attention sinks, YaRN x32 from 4096
    "gpt-oss-20b": ("gpt-oss", dict(
        n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_ff=2880, n_ff_exp=2880,
        n_expert=32, n_expert_used=4, n_swa=128, n_vocab=201088, n_ctx_train=131072, rope_yarn_factor=32.0,
    )),
    # Qwen3.5 0.8B, the drafter of Qwen3.6-35B-A3B (same 248,320 vocab): 24 layers, hidden 1024, full
    # attention every 4th layer (8 heads, 2 KV heads of 256), gated delta net 16 key / 16 value heads
    "qwen35-0.8b": ("qwen35", dict(
        n_layer=24, n_embd=1024, n_head=8, n_head_kv=2, head_dim=256, n_rot=64, n_ff=3584,
        full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=16,
        n_vocab=248320, n_ctx_train=262144, tie_embeddings=True,
    )),
    # Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts (8 used) of 768, 32 heads, 4 KV heads of 128
    "qwen3-30b-a3b": ("qwen3moe", dict(
        n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144, n_ff_exp=768,
        n_expert=128, n_expert_used=8, n_vocab=151936, n_ctx_train=262144,
    )),
    # An MLA MoE at the scale of GLM-4.7-Flash (deepseek2): 47 layers, hidden 2048, 20 heads, q LoRA 768,
    # KV LoRA 512 + 64 RoPE dims, 64 experts (4 used) of 1536 plus one shared, one leading dense layer
    "deepseek2-30b-a3b": ("deepseek2", dict(
        n_layer=47, n_embd=2048, n_head=20, n_ff=10240, q_lora_rank=768, kv_lora_rank=512, qk_rope=64,
        qk_nope=192, v_head_dim=256, n_layer_dense_lead=1, n_expert=64, n_expert_used=4, n_ff_exp=1536,
        n_expert_shared=1, n_vocab=154880, n_ctx_train=202752,
    )),
    # The models of the published llama-bench tables (benchmarks/results/speed-published.json).
    # Llama 2 7B (llama.cpp discussions #4167, #15013): 32 layers, MHA 32 heads of 128, vocab 32,000
    "llama2-7b": ("llama", dict(
        n_layer=32, n_embd=4096, n_head=32, n_head_kv=32, n_ff=11008, n_vocab=32000, n_ctx_train=4096,
        rope_freq_base=10000.0,
    )),
    # Llama 3 8B and 70B (XiongjieDai/GPU-Benchmarks-on-LLM-Inference): GQA 8 KV heads of 128, vocab 128,256,
    # 8K training context
    "llama3-8b": ("llama", dict(
        n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256, n_ctx_train=8192,
    )),
    "llama3-70b": ("llama", dict(
        n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, n_ff=28672, n_vocab=128256, n_ctx_train=8192,
    )),
    # Qwen2.5-Coder-7B (llama.cpp benches/): 28 layers, 28 heads, 4 KV heads of 128, untied output
    "qwen2.5-coder-7b": ("qwen2", dict(
        n_layer=28, n_embd=3584, n_head=28, n_head_kv=4, n_ff=18944, n_vocab=152064, n_ctx_train=32768,
        tie_embeddings=False,
    )),
    # Qwen3-Coder-30B-A3B (llama.cpp benches/): 48 layers, 128 experts (8 used) of 768, 32 heads,
    # 4 KV heads of 128, vocab 151,936
    "qwen3-coder-30b-a3b": ("qwen3moe", dict(
        n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144, n_ff_exp=768,
        n_expert=128, n_expert_used=8, n_vocab=151936, n_ctx_train=262144,
    )),
    # Gemma 3 4B (llama.cpp benches/, text model): 34 layers, 5 SWA (1024) to 1 global, 8 heads,
    # 4 KV heads of 256
    "gemma3-4b": ("gemma3", dict(
        n_layer=34, n_embd=2560, n_head=8, n_head_kv=4, head_dim=256, n_ff=10240, n_vocab=262208,
        n_ctx_train=131072, sliding_window=1024, rope_freq_base=1000000.0, rope_freq_base_swa=10000.0,
    )),
    # gpt-oss 120B (llama.cpp benches/): gpt-oss 20B's layers, 36 of them, 128 experts (4 used)
    "gpt-oss-120b": ("gpt-oss", dict(
        n_layer=36, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_ff=2880, n_ff_exp=2880,
        n_expert=128, n_expert_used=4, n_swa=128, n_vocab=201088, n_ctx_train=131072, rope_yarn_factor=32.0,
    )),
}

# a prime number of blocks: a tensor filled by repeating a chunk this long has no two equal rows
_FILL_BLOCKS = 65521


def build_shape(name: str, **overrides: Any) -> Path:
    arch, params = SHAPES[name]
    return build(arch, **{**params, "sparse": True, **overrides})


def quant_types(name: str, ftype: str = "Q4_K_M") -> dict[str, str]:
    """Per-tensor types of the shape quantized to `ftype`, as fitter.fit.quants predicts llama-quantize would choose
    them from the F16 header (the header of a real file of the model in that quant). The released gpt-oss files keep
    their MXFP4 experts in every quant; `MXFP4` names those files (the rest Q8_0, as llama-bench's size shows)."""
    from fitter.fit.quants import predict_quant
    from fitter.gguf.reader import read_header

    q = "Q8_0" if ftype == "MXFP4" else ftype
    pred = predict_quant(read_header(build_shape(name)), q)
    types = {t.name: t.type_name.lower() for t in pred.tensors}
    if SHAPES[name][0] == "gpt-oss":
        types.update({n: "mxfp4" for n in types if n.endswith("_exps.weight")})
    return types


def q4_k_m_types(name: str) -> dict[str, str]:
    return quant_types(name, "Q4_K_M")


def fill_weights(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write valid random tensor data into a sparse shape file, in place (finite block scales).

    Each ggml type gets one chunk of `_FILL_BLOCKS` random blocks; a tensor longer than that repeats the
    chunk from a random block of it (so rows, experts and tensors differ), a shorter one is random
    throughout; norms are 1.0. Writes at disk speed: seconds for a 20 GiB model, not the hours that
    quantizing real random floats would take."""
    from fitter.gguf.reader import read_header

    path = Path(path)
    header = read_header(path)
    rng = np.random.default_rng(seed)
    data_offset = header.shards[0].data_offset
    chunks: dict[tuple[Any, bool], bytes] = {}

    def encode(qt: Any, n_blocks: int, ones: bool) -> bytes:
        n = n_blocks * GGML_QUANT_SIZES[qt][0]
        vals = np.ones(n, np.float32) if ones else rng.standard_normal(n, dtype=np.float32) * np.float32(WEIGHT_STD)
        return np.ascontiguousarray(_encode(vals.reshape(1, -1), qt, rng)).view(np.uint8).tobytes()

    with open(path, "r+b") as f:
        for t in header.tensors:
            qt = ggml_type_of(int(t.ggml_type))
            n_blocks = t.n_elements // GGML_QUANT_SIZES[qt][0]
            ones = any(fnmatch.fnmatchcase(t.name, p) for p in ONES_PATTERNS)
            f.seek(data_offset + t.offset)
            if n_blocks <= _FILL_BLOCKS:
                f.write(encode(qt, n_blocks, ones))
                continue
            chunk = chunks.get((qt, ones)) or chunks.setdefault((qt, ones), encode(qt, _FILL_BLOCKS, ones))
            start = int(rng.integers(0, _FILL_BLOCKS)) * GGML_QUANT_SIZES[qt][1]
            view = memoryview(chunk[start:] + chunk[:start])
            left = t.nbytes
            while left > 0:
                n = min(left, len(view))
                f.write(view[:n])
                left -= n
    return path


_QORDER_VERSION = 1  # bump when _write_reordered changes (the copies are cached by this name)


def quantize_ordered(path: str | os.PathLike[str]) -> Path:
    """A sparse copy of a synthetic GGUF with its tensors in the order llama-quantize writes them: ml.weights_map's,
    by layer (the tensors outside blk.N first), then by name (llama_model_loader::weight_name_comparer; llama-quant.cpp
    llama_model_quantize_impl). Real quantized files have this layout: the token embedding sits between output.weight
    and blk.0, inside the Metal mapped range of the GPU's tensors (get_mapping_range). The builders write the
    converter's order (token_embd first). Cached beside the source file."""
    from tests.synth.common import write_once

    src = Path(path)
    return write_once(src.with_name(f"{src.stem}-qorder{_QORDER_VERSION}.gguf"), lambda tmp: _write_reordered(src, tmp))


def _write_reordered(src: Path, dst: Path) -> None:
    """The same keys and values byte for byte, the tensor infos re-sorted with offsets packed anew (each tensor padded
    to the alignment, as gguf_add_tensor does), the data a hole of the right size."""
    import struct

    from gguf import GGUFReader

    from fitter.fit.quant_rules import weights_order

    r = GGUFReader(src)
    head = bytes(r.data[: r.tensors[0].field.offset])  # magic, version, counts and every key/value, unchanged
    align, infos, off = r.alignment, [], 0
    for t in sorted(r.tensors, key=lambda t: weights_order(t.name)):
        name = t.name.encode()
        dims = [int(d) for d in t.shape]  # ne0 first, as stored
        infos.append(struct.pack(f"<Q{len(name)}sI{len(dims)}QIQ", len(name), name, len(dims), *dims,
                                 int(t.tensor_type), off))
        off += (int(t.n_bytes) + align - 1) // align * align
    body = head + b"".join(infos)
    with open(dst, "wb") as f:
        f.write(body + b"\0" * ((-len(body)) % align))
    os.truncate(dst, (len(body) + align - 1) // align * align + off)
