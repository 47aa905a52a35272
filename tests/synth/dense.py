"""Dense and sliding-window architectures: llama, qwen2, qwen3, phi3, mistral3, gemma2, gemma3, gemma4.

Every builder takes keyword overrides (``n_layer``, ``n_embd``, ``n_head``, ``n_head_kv``, ``n_ff``,
``n_ctx_train``, ``n_vocab``, ``ftype``, ``seed``, ``tie_embeddings``, ``tensor_types`` (per-tensor
ggml types by fnmatch pattern, for mixes like Q4_K_M) and per-arch ones; see each
builder's defaults) and writes exactly the tensors the arch's ``load_arch_tensors`` in the reference
llama.cpp (``src/models/<arch>.cpp``) creates. Notes on what llama.cpp does with them:

* llama, qwen2, qwen3, mistral3, gemma*: ``head_dim`` may differ from n_embd/n_head (written as
  ``attention.key_length``/``value_length``); llama asserts n_rot == head_dim.
* phi3: fused ``attn_qkv`` and ``ffn_up`` of 2*n_ff (gate and up concatenated); a
  ``attention.sliding_window`` is written like real Phi-3-mini files (2047), but
  ``llama_model_phi3::load_arch_hparams`` turns SWA off (n_swa = 0).
* gemma2: SWA on every other layer (pattern 2: even layers SWA), window defaults to 4096 if absent.
* gemma3: SWA pattern 6 (5 SWA + 1 full) when ``attention.sliding_window`` > 0, none otherwise.
* gemma4: explicit per-layer ``sliding_window_pattern`` (bool array), separate head sizes for SWA
  and full layers (``key_length_swa``), per-layer ``head_count_kv`` array, per-layer ``n_ff``
  array (double-wide MLP on shared-KV layers), KV-sharing layers at the end
  (``attention.shared_kv_layers``: they have no K/V weights and reuse the KV cache of the last
  non-shared layer of the same type), per-layer embeddings (PLE) and ``rope_freqs`` for
  proportional RoPE on full layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.synth.common import DEFAULT_N_VOCAB, blk, make_vocab, options, register, write_gguf

_COMMON: dict[str, Any] = dict(
    n_layer=2,
    n_embd=64,
    n_head=4,
    n_head_kv=2,
    n_ff=128,
    n_ctx_train=4096,
    n_vocab=DEFAULT_N_VOCAB,
    ftype="f16",
    seed=0,
    tie_embeddings=False,
    tensor_types=None,  # {fnmatch pattern: ggml type name}, e.g. {"output.weight": "q6_k"}
)


def _head_dim(o: dict[str, Any]) -> int:
    hd = o.get("head_dim")
    return int(hd) if hd else o["n_embd"] // o["n_head"]


def _embeddings(o: dict[str, Any], *, output: bool) -> list[tuple[str, tuple[int, ...]]]:
    t = [("token_embd.weight", (o["n_embd"], o["n_vocab"])), ("output_norm.weight", (o["n_embd"],))]
    if output:
        t.append(("output.weight", (o["n_embd"], o["n_vocab"])))
    return t


def _attn(i: int, n_embd: int, n_q: int, n_k: int, n_v: int, *, bias: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    # llama_model_base::create_tensor_qkv (separate Q/K/V) + attn_output
    t = [
        (blk(i, "attn_q.weight"), (n_embd, n_q)),
        (blk(i, "attn_k.weight"), (n_embd, n_k)),
        (blk(i, "attn_v.weight"), (n_embd, n_v)),
        (blk(i, "attn_output.weight"), (n_q, n_embd)),
    ]
    if bias:
        t += [(blk(i, "attn_q.bias"), (n_q,)), (blk(i, "attn_k.bias"), (n_k,)), (blk(i, "attn_v.bias"), (n_v,))]
    return t


def _ffn(i: int, n_embd: int, n_ff: int) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (blk(i, "ffn_gate.weight"), (n_embd, n_ff)),
        (blk(i, "ffn_up.weight"), (n_embd, n_ff)),
        (blk(i, "ffn_down.weight"), (n_ff, n_embd)),
    ]


def _base_hparams(o: dict[str, Any], *, head_dim_keys: bool) -> dict[str, Any]:
    hp: dict[str, Any] = {
        "context_length": o["n_ctx_train"],
        "embedding_length": o["n_embd"],
        "block_count": o["n_layer"],
        "feed_forward_length": o["n_ff"],
        "attention.head_count": o["n_head"],
        "attention.head_count_kv": o["n_head_kv"],
        "attention.layer_norm_rms_epsilon": 1e-6,
    }
    if head_dim_keys:
        hp["attention.key_length"] = _head_dim(o)
        hp["attention.value_length"] = _head_dim(o)
    return hp


def _write(path: Path, arch: str, hp: dict[str, Any], t: list, o: dict[str, Any], **kw: Any) -> Path:
    return write_gguf(path, arch, hp, t, ftype=o["ftype"], seed=o["seed"], tensor_types=o["tensor_types"],
                      sparse=o["sparse"], **kw)


# ------------------------------------------------------------------------------------------------


@register("llama")
def build_llama(path: Path, **overrides: Any) -> Path:
    """Llama 3 style: GQA, rope.dimension_count == head_dim (llama_model_llama::load_arch_tensors)."""
    o = options(dict(_COMMON, head_dim=None, rope_freq_base=500000.0), overrides)
    hd = _head_dim(o)
    hp = _base_hparams(o, head_dim_keys=o["head_dim"] is not None)
    hp["rope.dimension_count"] = hd
    hp["rope.freq_base"] = float(o["rope_freq_base"])
    hp["vocab_size"] = o["n_vocab"]
    t = _embeddings(o, output=not o["tie_embeddings"])
    for i in range(o["n_layer"]):
        t.append((blk(i, "attn_norm.weight"), (o["n_embd"],)))
        t += _attn(i, o["n_embd"], hd * o["n_head"], hd * o["n_head_kv"], hd * o["n_head_kv"])
        t.append((blk(i, "ffn_norm.weight"), (o["n_embd"],)))
        t += _ffn(i, o["n_embd"], o["n_ff"])
    return _write(path, "llama", hp, t, o)


@register("qwen2")
def build_qwen2(path: Path, **overrides: Any) -> Path:
    """Qwen2: Q/K/V biases, head_dim = n_embd/n_head (llama_model_qwen2::load_arch_tensors)."""
    o = options(dict(_COMMON, tie_embeddings=True, rope_freq_base=1000000.0), overrides)
    hd = o["n_embd"] // o["n_head"]
    hp = _base_hparams(o, head_dim_keys=False)
    hp["rope.freq_base"] = float(o["rope_freq_base"])
    t = _embeddings(o, output=not o["tie_embeddings"])
    for i in range(o["n_layer"]):
        t.append((blk(i, "attn_norm.weight"), (o["n_embd"],)))
        t += _attn(i, o["n_embd"], o["n_embd"], hd * o["n_head_kv"], hd * o["n_head_kv"], bias=True)
        t.append((blk(i, "ffn_norm.weight"), (o["n_embd"],)))
        t += _ffn(i, o["n_embd"], o["n_ff"])
    return _write(path, "qwen2", hp, t, o)


@register("qwen3")
def build_qwen3(path: Path, **overrides: Any) -> Path:
    """Qwen3: head_dim independent of n_embd (key_length), per-head Q/K RMS norms
    (llama_model_qwen3::load_arch_tensors)."""
    o = options(dict(_COMMON, head_dim=32, rope_freq_base=1000000.0), overrides)
    hd = _head_dim(o)
    hp = _base_hparams(o, head_dim_keys=True)
    hp["rope.freq_base"] = float(o["rope_freq_base"])
    t = _embeddings(o, output=not o["tie_embeddings"])
    for i in range(o["n_layer"]):
        t.append((blk(i, "attn_norm.weight"), (o["n_embd"],)))
        t += _attn(i, o["n_embd"], hd * o["n_head"], hd * o["n_head_kv"], hd * o["n_head_kv"])
        t += [(blk(i, "attn_k_norm.weight"), (hd,)), (blk(i, "attn_q_norm.weight"), (hd,))]
        t.append((blk(i, "ffn_norm.weight"), (o["n_embd"],)))
        t += _ffn(i, o["n_embd"], o["n_ff"])
    return _write(path, "qwen3", hp, t, o)


@register("phi3")
def build_phi3(path: Path, **overrides: Any) -> Path:
    """Phi-3: fused attn_qkv, ffn_up = [gate; up] of 2*n_ff, no ffn_gate; optional LongRoPE factors
    (llama_model_phi3::load_arch_tensors). ``sliding_window`` is written but llama.cpp disables it."""
    o = options(dict(_COMMON, n_head_kv=4, sliding_window=2047, longrope=False), overrides)
    hd = o["n_embd"] // o["n_head"]
    hp = _base_hparams(o, head_dim_keys=False)
    hp["rope.dimension_count"] = hd
    if o["sliding_window"]:
        hp["attention.sliding_window"] = o["sliding_window"]
    t = _embeddings(o, output=not o["tie_embeddings"])
    if o["longrope"]:
        # Phi-3-mini-128k: rope.scaling.* keys plus per-model long/short factors of n_rot/2.
        hp["rope.scaling.original_context_length"] = min(4096, o["n_ctx_train"])
        hp["rope.scaling.attn_factor"] = 1.19
        t += [("rope_factors_long.weight", (hd // 2,)), ("rope_factors_short.weight", (hd // 2,))]
    n_qkv = o["n_embd"] + 2 * hd * o["n_head_kv"]
    for i in range(o["n_layer"]):
        t += [
            (blk(i, "attn_norm.weight"), (o["n_embd"],)),
            (blk(i, "attn_qkv.weight"), (o["n_embd"], n_qkv)),
            (blk(i, "attn_output.weight"), (o["n_embd"], o["n_embd"])),
            (blk(i, "ffn_norm.weight"), (o["n_embd"],)),
            (blk(i, "ffn_down.weight"), (o["n_ff"], o["n_embd"])),
            (blk(i, "ffn_up.weight"), (o["n_embd"], 2 * o["n_ff"])),
        ]
    # llama_vocab::impl::load sets RSTRIP attributes on "</s>", "<unk>", "<s>", "<|endoftext|>" by
    # name (token_to_id.at, so they must exist) when general.name contains "phi3" or "phi-3".
    vocab = make_vocab("spm", o["n_vocab"], specials=["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"])
    return _write(path, "phi3", hp, t, o, tensor_values={"rope_factors_*": 1.0}, vocab=vocab)


@register("mistral3")
def build_mistral3(path: Path, **overrides: Any) -> Path:
    """Ministral 3: llama-like with head_dim != n_embd/n_head, YaRN rope scaling and attention
    temperature scaling (llama_model_mistral3::load_arch_hparams / load_arch_tensors)."""
    o = options(dict(_COMMON, n_ctx_train=16384, head_dim=32, yarn=True, rope_freq_base=1000000.0), overrides)
    hd = _head_dim(o)
    hp = _base_hparams(o, head_dim_keys=True)
    hp["rope.dimension_count"] = hd
    hp["rope.freq_base"] = float(o["rope_freq_base"])
    if o["yarn"]:
        orig = max(1, o["n_ctx_train"] // 16)
        hp["rope.scaling.type"] = "yarn"
        hp["rope.scaling.factor"] = float(o["n_ctx_train"] / orig)
        hp["rope.scaling.original_context_length"] = orig
        hp["rope.scaling.yarn_beta_fast"] = 32.0
        hp["rope.scaling.yarn_beta_slow"] = 1.0
        hp["rope.scaling.yarn_log_multiplier"] = 1.0
        hp["attention.temperature_scale"] = 0.1
    t = _embeddings(o, output=not o["tie_embeddings"])
    for i in range(o["n_layer"]):
        t.append((blk(i, "attn_norm.weight"), (o["n_embd"],)))
        t += _attn(i, o["n_embd"], hd * o["n_head"], hd * o["n_head_kv"], hd * o["n_head_kv"])
        t.append((blk(i, "ffn_norm.weight"), (o["n_embd"],)))
        t += _ffn(i, o["n_embd"], o["n_ff"])
    return _write(path, "mistral3", hp, t, o)


def _gemma_block(i: int, o: dict[str, Any], hd: int, *, qk_norm: bool) -> list[tuple[str, tuple[int, ...]]]:
    n_embd = o["n_embd"]
    t = [(blk(i, "attn_norm.weight"), (n_embd,))]
    t += _attn(i, n_embd, hd * o["n_head"], hd * o["n_head_kv"], hd * o["n_head_kv"])
    t.append((blk(i, "post_attention_norm.weight"), (n_embd,)))
    if qk_norm:
        t += [(blk(i, "attn_k_norm.weight"), (hd,)), (blk(i, "attn_q_norm.weight"), (hd,))]
    t.append((blk(i, "ffn_norm.weight"), (n_embd,)))
    t += _ffn(i, n_embd, o["n_ff"])
    t.append((blk(i, "post_ffw_norm.weight"), (n_embd,)))
    return t


@register("gemma2")
def build_gemma2(path: Path, **overrides: Any) -> Path:
    """Gemma 2: SWA on every other layer, logit soft-capping, output tied to token_embd
    (llama_model_gemma2::load_arch_hparams / load_arch_tensors). SPM vocabulary like the real one.

    ``swa_pattern``: None (llama.cpp's default period 2), an int period, or a list of bools."""
    o = options(
        dict(_COMMON, n_layer=4, n_ctx_train=8192, head_dim=32, sliding_window=256, swa_pattern=None, vocab="spm"),
        overrides,
    )
    if o["tie_embeddings"] is False:
        o["tie_embeddings"] = True  # gemma2 never reads output.weight
    hd = _head_dim(o)
    hp = _base_hparams(o, head_dim_keys=True)
    hp["attn_logit_softcapping"] = 50.0
    hp["final_logit_softcapping"] = 30.0
    if o["sliding_window"] is not None:
        hp["attention.sliding_window"] = o["sliding_window"]
    if o["swa_pattern"] is not None:
        hp["attention.sliding_window_pattern"] = o["swa_pattern"]
    t = _embeddings(o, output=False)
    for i in range(o["n_layer"]):
        t += _gemma_block(i, o, hd, qk_norm=False)
    return _write(path, "gemma2", hp, t, o, vocab=o["vocab"])


@register("gemma3")
def build_gemma3(path: Path, **overrides: Any) -> Path:
    """Gemma 3: 5 SWA + 1 full layers (pattern 6) when sliding_window > 0, Q/K norms, head_dim
    independent of n_embd, MQA by default like the 270M (llama_model_gemma3::load_arch_hparams).

    ``swa_pattern``: None (llama.cpp's default period 6), an int period, or a list of bools;
    ``sliding_window=0`` makes every layer full attention."""
    o = options(
        dict(
            _COMMON,
            n_layer=8,
            n_head_kv=1,
            n_ctx_train=8192,
            head_dim=32,
            tie_embeddings=True,
            sliding_window=256,
            swa_pattern=None,
            rope_freq_base=1000000.0,
            rope_freq_base_swa=None,
            vocab="spm",
        ),
        overrides,
    )
    hd = _head_dim(o)
    hp = _base_hparams(o, head_dim_keys=True)
    hp["rope.freq_base"] = float(o["rope_freq_base"])
    if o["rope_freq_base_swa"] is not None:
        hp["rope.freq_base_swa"] = float(o["rope_freq_base_swa"])
    if o["sliding_window"]:
        hp["attention.sliding_window"] = o["sliding_window"]
    if o["swa_pattern"] is not None:
        hp["attention.sliding_window_pattern"] = o["swa_pattern"]
    t = _embeddings(o, output=not o["tie_embeddings"])
    for i in range(o["n_layer"]):
        t += _gemma_block(i, o, hd, qk_norm=True)
    return _write(path, "gemma3", hp, t, o, vocab=o["vocab"])


def gemma4_layout(o: dict[str, Any]) -> dict[str, Any]:
    """Per-layer lists of the gemma4 builder: is_swa, n_head_kv, n_ff, has_kv."""
    n = o["n_layer"]
    pat = o["swa_pattern"]
    if isinstance(pat, int):
        is_swa = [(i % pat) < pat - 1 for i in range(n)]  # llama_hparams::set_swa_pattern
    else:
        is_swa = [bool(x) for x in pat]
    if len(is_swa) != n:
        raise ValueError(f"swa_pattern has {len(is_swa)} entries for {n} layers")
    n_kv_from_start = n - o["n_kv_shared"]
    if o["n_kv_shared"]:
        # llama_model::create_memory (gemma3n/gemma4 reuse): shared layers read layer
        # n_kv_from_start-2 (SWA) or n_kv_from_start-1 (full), which must be of that type.
        if n_kv_from_start < 2 or is_swa[n_kv_from_start - 1] or not is_swa[n_kv_from_start - 2]:
            raise ValueError("gemma4 shared-KV layers need a SWA then a full layer just before them")
    has_kv = [i < n_kv_from_start for i in range(n)]
    n_head_kv = [o["n_head_kv_swa"] if s else o["n_head_kv"] for s in is_swa]
    n_ff = [o["n_ff"] * (2 if (o["double_wide_mlp"] and not kv) else 1) for kv in has_kv]
    return dict(is_swa=is_swa, has_kv=has_kv, n_head_kv=n_head_kv, n_ff=n_ff)


@register("gemma4")
def build_gemma4(path: Path, **overrides: Any) -> Path:
    """Gemma 4 (dense, E2B-like by default): explicit SWA pattern, head sizes per layer type,
    per-layer head_count_kv and n_ff arrays, trailing KV-shared layers, per-layer embeddings,
    rope_freqs for proportional RoPE (llama_model_gemma4::load_arch_hparams / load_arch_tensors).

    ``n_head_kv`` is for full layers, ``n_head_kv_swa`` for SWA layers; ``k_eq_v`` drops attn_v on
    full layers (31B-style "use_alternative_attention": V = K); ``n_embd_per_layer=0`` drops PLE."""
    o = options(
        dict(
            _COMMON,
            n_layer=8,
            n_head_kv=1,
            n_head_kv_swa=2,
            n_ctx_train=8192,
            head_dim=64,
            head_dim_swa=32,
            partial_rotary_full=0.25,
            sliding_window=128,
            swa_pattern=4,
            n_kv_shared=4,
            n_embd_per_layer=16,
            double_wide_mlp=True,
            k_eq_v=False,
            layer_output_scale=True,
            final_logit_softcapping=30.0,
            tie_embeddings=True,
        ),
        overrides,
    )
    lay = gemma4_layout(o)
    n, n_embd, hd_f, hd_s = o["n_layer"], o["n_embd"], o["head_dim"], o["head_dim_swa"]
    hp = _base_hparams(o, head_dim_keys=True)
    hp.update(
        {
            "feed_forward_length": lay["n_ff"] if len(set(lay["n_ff"])) > 1 else o["n_ff"],
            "attention.head_count_kv": lay["n_head_kv"] if len(set(lay["n_head_kv"])) > 1 else o["n_head_kv"],
            "attention.key_length_swa": hd_s,
            "attention.value_length_swa": hd_s,
            "attention.sliding_window": o["sliding_window"],
            "attention.sliding_window_pattern": lay["is_swa"],
            "attention.shared_kv_layers": o["n_kv_shared"],
            "embedding_length_per_layer_input": o["n_embd_per_layer"],
            "rope.dimension_count": hd_f,
            "rope.dimension_count_swa": hd_s,
            "rope.freq_base": 1000000.0,
            "rope.freq_base_swa": 10000.0,
            "final_logit_softcapping": float(o["final_logit_softcapping"]),
        }
    )
    t = _embeddings(o, output=not o["tie_embeddings"])
    ple = o["n_embd_per_layer"]
    if ple:
        t += [
            ("per_layer_token_embd.weight", (ple * n, o["n_vocab"])),
            ("per_layer_model_proj.weight", (n_embd, ple * n)),
            ("per_layer_proj_norm.weight", (ple,)),
        ]
    if not all(lay["is_swa"]):
        t.append(("rope_freqs.weight", (hd_f // 2,)))
    for i in range(n):
        swa, kv = lay["is_swa"][i], lay["has_kv"][i]
        hd = hd_s if swa else hd_f
        n_kv = hd * lay["n_head_kv"][i]
        t += [(blk(i, "attn_norm.weight"), (n_embd,)), (blk(i, "attn_q.weight"), (n_embd, hd * o["n_head"]))]
        if kv:
            t.append((blk(i, "attn_k.weight"), (n_embd, n_kv)))
            if swa or not o["k_eq_v"]:
                t.append((blk(i, "attn_v.weight"), (n_embd, n_kv)))
        t.append((blk(i, "attn_output.weight"), (hd * o["n_head"], n_embd)))
        t.append((blk(i, "attn_q_norm.weight"), (hd,)))
        if kv:
            t.append((blk(i, "attn_k_norm.weight"), (hd,)))
        t.append((blk(i, "post_attention_norm.weight"), (n_embd,)))
        if o["layer_output_scale"]:
            t.append((blk(i, "layer_output_scale.weight"), (1,)))
        t.append((blk(i, "ffn_norm.weight"), (n_embd,)))
        t += _ffn(i, n_embd, lay["n_ff"][i])
        t.append((blk(i, "post_ffw_norm.weight"), (n_embd,)))
        if ple:
            t += [
                (blk(i, "inp_gate.weight"), (n_embd, ple)),
                (blk(i, "proj.weight"), (ple, n_embd)),
                (blk(i, "post_norm.weight"), (n_embd,)),
            ]

    n_rot = int(hd_f * o["partial_rotary_full"] / 2)

    def rope_freqs(rng: Any, shape: tuple[int, ...]) -> list[float]:
        # convert: Gemma4Model.generate_extra_tensors (1.0 for rotated dims, 1e30 for the rest)
        return [1.0] * n_rot + [1e30] * (shape[0] - n_rot)

    values = {"rope_freqs.weight": rope_freqs, "*.layer_output_scale.weight": 1.0}
    return _write(path, "gemma4", hp, t, o, tensor_values=values)
