"""Synthetic MoE, hybrid-recurrent and MLA architectures (see tests/synth/common.py).

Registered here: ``qwen3moe``, ``qwen35`` (hybrid dense), ``qwen35moe`` (hybrid MoE), ``qwen3next``,
``gpt-oss``, ``deepseek2`` (MLA) and ``glm4moe`` (with a NextN/MTP block).

Every builder mirrors the ``load_arch_hparams`` / ``load_arch_tensors`` of the reference llama.cpp
(``src/models/<arch>.cpp``): the keys it writes are the ones llama.cpp reads (plus those the
converters in ``conversion/*.py`` write anyway), the tensors are exactly the ones it creates, with
its shapes (ggml order). Defaults are tiny (64-wide, 4-8 layers, 8 experts with 2 used) but keep
the structure that matters for memory: per-layer patterns (linear-attention vs full-attention
layers, sliding-window vs full layers, leading dense layers), shared experts, MLA's compressed KV,
MTP blocks that are present in the file but not loaded.

Common overrides: ``n_layer`` (trunk layers, without NextN blocks), ``n_embd``, ``n_head``,
``n_head_kv``, ``head_dim``, ``n_ff``, ``n_expert``, ``n_expert_used``, ``n_ff_exp``,
``n_ctx_train``, ``n_vocab``, ``tie_embeddings`` (no ``output.weight``), ``ftype``, ``seed``,
``tensor_types`` (passed to ``write_gguf``; it wins over a builder's own type choices).
Per-builder extras are listed in each builder's docstring.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, Mapping

from tests.synth.common import DEFAULT_N_VOCAB, blk, options, register, write_gguf

__all__ = [
    "build_deepseek2",
    "build_glm4moe",
    "build_gpt_oss",
    "build_qwen35",
    "build_qwen35moe",
    "build_qwen3moe",
    "build_qwen3next",
]

Tensors = list[tuple[str, tuple[int, ...]]]

_COMMON: dict[str, Any] = dict(
    n_ctx_train=4096,
    n_vocab=DEFAULT_N_VOCAB,
    tie_embeddings=False,
    ftype="f16",
    seed=0,
    tensor_types=None,
)


def _merge_types(user: Any, own: Mapping[str, Any]) -> Any:
    """The caller's ``tensor_types`` first (first match wins), then the builder's own rules."""
    if user is None:
        return dict(own) or None
    if callable(user):
        if not own:
            return user

        def rule(name: str, shape: tuple[int, ...]) -> Any:
            got = user(name, shape)
            if got is not None:
                return got
            for pat, val in own.items():
                if fnmatch.fnmatchcase(name, pat):
                    return val
            return None

        return rule
    out = dict(user)
    for k, v in own.items():
        out.setdefault(k, v)
    return out


def _write(
    path: Path,
    arch: str,
    hp: dict[str, Any],
    t: Tensors,
    o: Mapping[str, Any],
    own_types: Mapping[str, Any] | None = None,
    values: Mapping[str, Any] | None = None,
) -> Path:
    types = _merge_types(o["tensor_types"], own_types or {})
    return write_gguf(path, arch, hp, t, ftype=o["ftype"], seed=o["seed"], tensor_types=types, tensor_values=values,
                      sparse=o["sparse"])


def _embd_out(o: Mapping[str, Any], *, output_required: bool = False) -> Tensors:
    # token_embd / output_norm / output (output optional: TENSOR_DUPLICATED from token_embd)
    t: Tensors = [("token_embd.weight", (o["n_embd"], o["n_vocab"])), ("output_norm.weight", (o["n_embd"],))]
    if output_required or not o["tie_embeddings"]:
        t.append(("output.weight", (o["n_embd"], o["n_vocab"])))
    return t


def _attn_hp(o: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "context_length": o["n_ctx_train"],
        "embedding_length": o["n_embd"],
        "attention.head_count": o["n_head"],
        "attention.head_count_kv": o["n_head_kv"],
        "attention.key_length": o["head_dim"],
        "attention.value_length": o["head_dim"],
        "attention.layer_norm_rms_epsilon": 1e-6,
    }


def _moe_exps(i: int, n_embd: int, n_ff_exp: int, n_expert: int) -> Tensors:
    # create_tensor_gate_up_exps + ffn_down_exps (separate gate/up, as the converters write them)
    return [
        (blk(i, "ffn_gate_inp.weight"), (n_embd, n_expert)),
        (blk(i, "ffn_gate_exps.weight"), (n_embd, n_ff_exp, n_expert)),
        (blk(i, "ffn_down_exps.weight"), (n_ff_exp, n_embd, n_expert)),
        (blk(i, "ffn_up_exps.weight"), (n_embd, n_ff_exp, n_expert)),
    ]


def _shexp(i: int, n_embd: int, n_ff_shexp: int) -> Tensors:
    return [
        (blk(i, "ffn_gate_shexp.weight"), (n_embd, n_ff_shexp)),
        (blk(i, "ffn_down_shexp.weight"), (n_ff_shexp, n_embd)),
        (blk(i, "ffn_up_shexp.weight"), (n_embd, n_ff_shexp)),
    ]


def _dense_ffn(i: int, n_embd: int, n_ff: int) -> Tensors:
    return [
        (blk(i, "ffn_gate.weight"), (n_embd, n_ff)),
        (blk(i, "ffn_down.weight"), (n_ff, n_embd)),
        (blk(i, "ffn_up.weight"), (n_embd, n_ff)),
    ]


def _nextn(i: int, n_embd: int, n_vocab: int, full_heads: bool) -> Tensors:
    # NextN/MTP-specific tensors (eh_proj, enorm, hnorm required; the rest TENSOR_NOT_REQUIRED)
    t: Tensors = [
        (blk(i, "nextn.eh_proj.weight"), (2 * n_embd, n_embd)),
        (blk(i, "nextn.enorm.weight"), (n_embd,)),
        (blk(i, "nextn.hnorm.weight"), (n_embd,)),
        (blk(i, "nextn.shared_head_norm.weight"), (n_embd,)),
    ]
    if full_heads:
        t += [
            (blk(i, "nextn.embed_tokens.weight"), (n_embd, n_vocab)),
            (blk(i, "nextn.shared_head_head.weight"), (n_embd, n_vocab)),
        ]
    return t


# --------------------------------------------------------------------------------------------
# qwen3moe


@register("qwen3moe")
def build_qwen3moe(path: Path, **overrides: Any) -> Path:
    """Qwen3-MoE (30B-A3B shape, scaled down): every layer MoE, Q/K norms, no shared expert."""
    o = options(
        dict(_COMMON, n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
             n_expert=8, n_expert_used=2, n_ff_exp=32),
        overrides,
    )
    # llama_model_qwen3moe::load_arch_hparams
    hp = _attn_hp(o) | {
        "block_count": o["n_layer"],
        "feed_forward_length": o["n_ff"],
        "expert_feed_forward_length": o["n_ff_exp"],
        "expert_count": o["n_expert"],
        "expert_used_count": o["n_expert_used"],
        "rope.freq_base": 1000000.0,
    }
    e, hd = o["n_embd"], o["head_dim"]
    t = _embd_out(o)
    for i in range(o["n_layer"]):  # llama_model_qwen3moe::load_arch_tensors
        t += [
            (blk(i, "attn_norm.weight"), (e,)),
            (blk(i, "attn_q.weight"), (e, hd * o["n_head"])),
            (blk(i, "attn_k.weight"), (e, hd * o["n_head_kv"])),
            (blk(i, "attn_v.weight"), (e, hd * o["n_head_kv"])),
            (blk(i, "attn_output.weight"), (hd * o["n_head"], e)),
            (blk(i, "attn_k_norm.weight"), (hd,)),
            (blk(i, "attn_q_norm.weight"), (hd,)),
            (blk(i, "ffn_norm.weight"), (e,)),
        ]
        t += _moe_exps(i, e, o["n_ff_exp"], o["n_expert"])
    return _write(path, "qwen3moe", hp, t, o)


# --------------------------------------------------------------------------------------------
# qwen35 / qwen35moe / qwen3next: gated delta net + full attention every full_attention_interval


_HYBRID: dict[str, Any] = dict(
    _COMMON,
    n_layer=8,
    n_embd=64,
    n_head=4,
    n_head_kv=2,
    head_dim=64,
    n_rot=16,  # partial_rotary_factor 0.25 of head_dim, like the real models
    full_attention_interval=4,
    recurrent_layers=None,  # explicit per-layer list of bools (attention.recurrent_layers) instead
    ssm_d_conv=4,
    ssm_d_state=16,  # linear_key_head_dim (= value head dim, as llama.cpp assumes)
    ssm_n_group=2,  # linear_num_key_heads
    ssm_dt_rank=4,  # linear_num_value_heads
    n_nextn=0,  # MTP blocks appended after the trunk (nextn_predict_layers)
)


def _hybrid_hp(o: Mapping[str, Any]) -> dict[str, Any]:
    n_all = o["n_layer"] + o["n_nextn"]
    hp = _attn_hp(o) | {
        "block_count": n_all,
        "rope.dimension_count": o["n_rot"],
        "rope.freq_base": 10000000.0,
        "ssm.conv_kernel": o["ssm_d_conv"],
        "ssm.state_size": o["ssm_d_state"],
        "ssm.group_count": o["ssm_n_group"],
        "ssm.time_step_rank": o["ssm_dt_rank"],
        "ssm.inner_size": o["ssm_d_state"] * o["ssm_dt_rank"],
        "full_attention_interval": o["full_attention_interval"],
    }
    if o["recurrent_layers"] is not None:
        rl = [bool(x) for x in o["recurrent_layers"]]
        if len(rl) == o["n_layer"]:
            rl += [False] * o["n_nextn"]
        if len(rl) != n_all:
            raise ValueError(f"recurrent_layers has {len(o['recurrent_layers'])} entries, n_layer is {o['n_layer']}")
        hp["attention.recurrent_layers"] = rl
    if o["n_nextn"]:
        hp["nextn_predict_layers"] = o["n_nextn"]
    return hp


def _is_recr(o: Mapping[str, Any], i: int) -> bool:
    # load_arch_hparams of qwen35 / qwen35moe / qwen3next
    if i >= o["n_layer"]:
        return False
    if o["recurrent_layers"] is not None:
        return bool(o["recurrent_layers"][i])  # length checked in _hybrid_hp
    return (i + 1) % o["full_attention_interval"] != 0


def _mrope_sections(n_rot: int) -> list[int]:
    # Qwen3.5's interleaved MRoPE: [11, 11, 10, 0] for n_rot 64, i.e. n_rot/2 split ~3 ways
    half = n_rot // 2
    a = (half + 2) // 3
    return [a, a, half - 2 * a, 0]


def _gated_attn(i: int, o: Mapping[str, Any]) -> Tensors:
    # full-attention layer of the Qwen3-Next family: Q projection carries query + gate (2x)
    e, hd = o["n_embd"], o["head_dim"]
    return [
        (blk(i, "attn_q.weight"), (e, hd * o["n_head"] * 2)),
        (blk(i, "attn_k.weight"), (e, hd * o["n_head_kv"])),
        (blk(i, "attn_v.weight"), (e, hd * o["n_head_kv"])),
        (blk(i, "attn_output.weight"), (hd * o["n_head"], e)),
        (blk(i, "attn_q_norm.weight"), (hd,)),
        (blk(i, "attn_k_norm.weight"), (hd,)),
    ]


def _gdn(i: int, o: Mapping[str, Any], *, fused_ba: bool, legacy_ssm_in: bool = False) -> Tensors:
    # gated delta net layer (load_block_trunk, is_recr branch)
    e = o["n_embd"]
    key_dim = o["ssm_d_state"] * o["ssm_n_group"]
    value_dim = o["ssm_d_state"] * o["ssm_dt_rank"]
    conv_dim = 2 * key_dim + value_dim
    nv = o["ssm_dt_rank"]
    if legacy_ssm_in:
        t: Tensors = [(blk(i, "ssm_in.weight"), (e, 2 * key_dim + 2 * value_dim))]
    else:
        t = [(blk(i, "attn_qkv.weight"), (e, conv_dim)), (blk(i, "attn_gate.weight"), (e, value_dim))]
    t += [
        (blk(i, "ssm_conv1d.weight"), (o["ssm_d_conv"], conv_dim)),
        (blk(i, "ssm_dt.bias"), (nv,)),
        (blk(i, "ssm_a"), (nv,)),
    ]
    if fused_ba:
        t.append((blk(i, "ssm_ba.weight"), (e, 2 * nv)))
    else:
        t += [(blk(i, "ssm_beta.weight"), (e, nv)), (blk(i, "ssm_alpha.weight"), (e, nv))]
    t += [
        (blk(i, "ssm_norm.weight"), (o["ssm_d_state"],)),
        (blk(i, "ssm_out.weight"), (value_dim, e)),
    ]
    return t


def _ssm_a_values(rng: Any, shape: tuple[int, ...]) -> Any:
    # ssm_a holds -exp(A_log) (conversion/qwen.py); keep it negative like the real thing
    return -rng.uniform(0.5, 8.0, size=tuple(reversed(shape)))


def _hybrid_values() -> dict[str, Any]:
    return {"*.ssm_a": _ssm_a_values}


def _write_hybrid(path: Path, arch: str, hp: dict[str, Any], t: Tensors, o: Mapping[str, Any]) -> Path:
    return _write(path, arch, hp, t, o, values=_hybrid_values())


@register("qwen35")
def build_qwen35(path: Path, **overrides: Any) -> Path:
    """Qwen3.5 dense hybrid: gated-delta-net layers, full (gated, IMRoPE) attention every
    ``full_attention_interval`` layers, dense SwiGLU FFN. Extras: ``full_attention_interval``,
    ``recurrent_layers``, ``ssm_d_conv``, ``ssm_d_state``, ``ssm_n_group``, ``ssm_dt_rank``,
    ``n_rot``, ``n_nextn`` (MTP blocks, not loaded unless ``load_mtp``)."""
    o = options(dict(_HYBRID, n_ff=128), overrides)
    # llama_model_qwen35::load_arch_hparams
    hp = _hybrid_hp(o) | {
        "feed_forward_length": o["n_ff"],
        "rope.dimension_sections": _mrope_sections(o["n_rot"]),
    }
    e = o["n_embd"]
    t = _embd_out(o)
    for i in range(o["n_layer"] + o["n_nextn"]):  # llama_model_qwen35::load_arch_tensors
        t += [(blk(i, "attn_norm.weight"), (e,)), (blk(i, "post_attention_norm.weight"), (e,))]
        t += _gdn(i, o, fused_ba=False) if _is_recr(o, i) else _gated_attn(i, o)
        t += _dense_ffn(i, e, o["n_ff"])
        if i >= o["n_layer"]:
            t += _nextn(i, e, o["n_vocab"], full_heads=False)
    return _write_hybrid(path, "qwen35", hp, t, o)


@register("qwen35moe")
def build_qwen35moe(path: Path, **overrides: Any) -> Path:
    """Qwen3.5 MoE hybrid: as ``qwen35`` but every layer's FFN is routed experts plus a sigmoid-
    gated shared expert (``ffn_gate_inp_shexp``). Extras as ``qwen35`` plus ``n_ff_shexp``."""
    o = options(dict(_HYBRID, n_ff=128, n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32), overrides)
    # llama_model_qwen35moe::load_arch_hparams
    hp = _hybrid_hp(o) | {
        "feed_forward_length": o["n_ff"],
        "expert_feed_forward_length": o["n_ff_exp"],
        "expert_shared_feed_forward_length": o["n_ff_shexp"],
        "expert_count": o["n_expert"],
        "expert_used_count": o["n_expert_used"],
        "rope.dimension_sections": _mrope_sections(o["n_rot"]),
    }
    e = o["n_embd"]
    t = _embd_out(o)
    for i in range(o["n_layer"] + o["n_nextn"]):  # llama_model_qwen35moe::load_arch_tensors
        t += [(blk(i, "attn_norm.weight"), (e,)), (blk(i, "post_attention_norm.weight"), (e,))]
        t += _gdn(i, o, fused_ba=False) if _is_recr(o, i) else _gated_attn(i, o)
        t += _moe_exps(i, e, o["n_ff_exp"], o["n_expert"])
        t += [(blk(i, "ffn_gate_inp_shexp.weight"), (e,))] + _shexp(i, e, o["n_ff_shexp"])
        if i >= o["n_layer"]:
            t += _nextn(i, e, o["n_vocab"], full_heads=False)
    return _write_hybrid(path, "qwen35moe", hp, t, o)


@register("qwen3next")
def build_qwen3next(path: Path, **overrides: Any) -> Path:
    """Qwen3-Next (80B-A3B shape): like ``qwen35moe`` but plain RoPE (no MRoPE sections), a
    fused ``ssm_ba`` beta/alpha projection, and optionally the legacy fused ``ssm_in``
    (``legacy_ssm_in=True``) instead of ``attn_qkv`` + ``attn_gate``."""
    o = options(
        dict(_HYBRID, n_ff=128, n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32, legacy_ssm_in=False),
        overrides,
    )
    # llama_model_qwen3next::load_arch_hparams
    hp = _hybrid_hp(o) | {
        "feed_forward_length": o["n_ff"],
        "expert_feed_forward_length": o["n_ff_exp"],
        "expert_shared_feed_forward_length": o["n_ff_shexp"],
        "expert_count": o["n_expert"],
        "expert_used_count": o["n_expert_used"],
    }
    e = o["n_embd"]
    t = _embd_out(o)
    for i in range(o["n_layer"] + o["n_nextn"]):  # llama_model_qwen3next::load_arch_tensors
        t += [(blk(i, "attn_norm.weight"), (e,)), (blk(i, "post_attention_norm.weight"), (e,))]
        if _is_recr(o, i):
            t += _gdn(i, o, fused_ba=True, legacy_ssm_in=o["legacy_ssm_in"])
        else:
            t += _gated_attn(i, o)
        t += _moe_exps(i, e, o["n_ff_exp"], o["n_expert"])
        t += [(blk(i, "ffn_gate_inp_shexp.weight"), (e,))] + _shexp(i, e, o["n_ff_shexp"])
        if i >= o["n_layer"]:
            t += _nextn(i, e, o["n_vocab"], full_heads=False)
    return _write_hybrid(path, "qwen3next", hp, t, o)


# --------------------------------------------------------------------------------------------
# gpt-oss


@register("gpt-oss")
def build_gpt_oss(path: Path, **overrides: Any) -> Path:
    """gpt-oss: MoE on every layer with biased experts (SwiGLU-OAI), attention sinks, sliding
    window on even layers (pattern 2, ``n_swa``), MXFP4 experts like the released files
    (``expert_type``). Extras: ``n_swa``, ``expert_type``, ``swa_pattern`` (written only if given),
    ``rope_yarn_factor`` (YaRN keys written only if given)."""
    o = options(
        dict(_COMMON, n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=64,
             n_expert=8, n_expert_used=2, n_ff_exp=64, n_swa=32, expert_type="mxfp4",
             swa_pattern=None, rope_yarn_factor=None),
        overrides,
    )
    # llama_model_openai_moe::load_arch_hparams
    hp = _attn_hp(o) | {
        "block_count": o["n_layer"],
        "feed_forward_length": o["n_ff"],
        "expert_feed_forward_length": o["n_ff_exp"],
        "expert_count": o["n_expert"],
        "expert_used_count": o["n_expert_used"],
        "attention.sliding_window": o["n_swa"],
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 150000.0,
    }
    if o["swa_pattern"] is not None:
        hp["attention.sliding_window_pattern"] = o["swa_pattern"]
    if o["rope_yarn_factor"] is not None:
        hp |= {
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": float(o["rope_yarn_factor"]),
            "rope.scaling.original_context_length": max(1, int(o["n_ctx_train"] // o["rope_yarn_factor"])),
        }
    e, hd, ne, nff = o["n_embd"], o["head_dim"], o["n_expert"], o["n_ff_exp"]
    t = _embd_out(o, output_required=True)
    for i in range(o["n_layer"]):  # llama_model_openai_moe::load_arch_tensors
        t += [
            (blk(i, "attn_norm.weight"), (e,)),
            (blk(i, "post_attention_norm.weight"), (e,)),
            (blk(i, "attn_q.weight"), (e, o["n_head"] * hd)),
            (blk(i, "attn_k.weight"), (e, o["n_head_kv"] * hd)),
            (blk(i, "attn_v.weight"), (e, o["n_head_kv"] * hd)),
            (blk(i, "attn_q.bias"), (o["n_head"] * hd,)),
            (blk(i, "attn_k.bias"), (o["n_head_kv"] * hd,)),
            (blk(i, "attn_v.bias"), (o["n_head_kv"] * hd,)),
            (blk(i, "attn_output.weight"), (o["n_head"] * hd, e)),
            (blk(i, "attn_output.bias"), (e,)),
            (blk(i, "attn_sinks.weight"), (o["n_head"],)),
        ]
        t += _moe_exps(i, e, nff, ne)
        t += [
            (blk(i, "ffn_gate_inp.bias"), (ne,)),
            (blk(i, "ffn_gate_exps.bias"), (nff, ne)),
            (blk(i, "ffn_down_exps.bias"), (e, ne)),
            (blk(i, "ffn_up_exps.bias"), (nff, ne)),
        ]
    own: dict[str, Any] = {"*.bias": "f32"}
    if o["expert_type"] is not None:
        own["*_exps.weight"] = o["expert_type"]
    return _write(path, "gpt-oss", hp, t, o, own)


# --------------------------------------------------------------------------------------------
# deepseek2 (MLA)


@register("deepseek2")
def build_deepseek2(path: Path, **overrides: Any) -> Path:
    """DeepSeek-V3-style MLA MoE: q LoRA, compressed KV (``kv_lora_rank``) plus a decoupled RoPE
    key (``qk_rope``), split ``attn_k_b``/``attn_v_b``, leading dense layers, shared experts,
    sigmoid gating with ``exp_probs_b``. Extras: ``q_lora_rank`` (0: plain ``attn_q``, like
    V2-Lite), ``kv_lora_rank``, ``qk_rope``, ``qk_nope``, ``v_head_dim``, ``n_layer_dense_lead``,
    ``n_expert_shared``, ``n_expert_groups``/``n_group_used``, ``mla`` (False: legacy GGUF without
    ``key_length_mla``, unsplit ``attn_kv_b``, KV cached as full MHA), ``n_nextn``,
    ``rope_yarn_factor``."""
    o = options(
        dict(_COMMON, n_layer=4, n_embd=64, n_head=4, n_ff=128, q_lora_rank=32, kv_lora_rank=32,
             qk_rope=8, qk_nope=16, v_head_dim=16, n_layer_dense_lead=1, n_expert=8, n_expert_used=2,
             n_ff_exp=32, n_expert_shared=1, n_expert_groups=0, n_group_used=0, mla=True, n_nextn=0,
             rope_yarn_factor=None),
        overrides,
    )
    if o["n_layer"] in (26, 27):
        # llama.cpp treats these depths as "lite" (no q LoRA read); refuse rather than surprise
        raise ValueError("deepseek2 with 26/27 layers is read as a V2-Lite model; pick another n_layer")
    e, nh = o["n_embd"], o["n_head"]
    rope, nope, vd, kvr, qr = o["qk_rope"], o["qk_nope"], o["v_head_dim"], o["kv_lora_rank"], o["q_lora_rank"]
    n_all = o["n_layer"] + o["n_nextn"]
    # llama_model_deepseek2::load_arch_hparams (keys as conversion/deepseek.py writes them)
    hp: dict[str, Any] = {
        "context_length": o["n_ctx_train"],
        "embedding_length": e,
        "block_count": n_all,
        "feed_forward_length": o["n_ff"],
        "attention.head_count": nh,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "leading_dense_block_count": o["n_layer_dense_lead"],
        "vocab_size": o["n_vocab"],
        "attention.q_lora_rank": qr,
        "attention.kv_lora_rank": kvr,
        "expert_feed_forward_length": o["n_ff_exp"],
        "expert_count": o["n_expert"],
        "expert_used_count": o["n_expert_used"],
        "expert_shared_count": o["n_expert_shared"],
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
        "expert_gating_func": 2,  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        "rope.dimension_count": rope,
        "rope.freq_base": 10000.0,
    }
    if o["mla"]:
        # MLA converts to MQA over the compressed latent: one KV head of kv_lora_rank + rope
        hp |= {
            "attention.head_count_kv": 1,
            "attention.key_length": kvr + rope,
            "attention.value_length": kvr,
            "attention.key_length_mla": nope + rope,
            "attention.value_length_mla": vd,
        }
    else:
        hp |= {
            "attention.head_count_kv": nh,
            "attention.key_length": nope + rope,
            "attention.value_length": vd,
        }
    if o["n_expert_groups"]:
        hp |= {"expert_group_count": o["n_expert_groups"], "expert_group_used_count": o["n_group_used"]}
    if o["n_nextn"]:
        hp["nextn_predict_layers"] = o["n_nextn"]
    if o["rope_yarn_factor"] is not None:
        hp |= {
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": float(o["rope_yarn_factor"]),
            "rope.scaling.original_context_length": max(1, int(o["n_ctx_train"] // o["rope_yarn_factor"])),
            "rope.scaling.yarn_log_multiplier": 0.1,
        }
    t = _embd_out(o)
    kd = nope + rope  # n_embd_head_k_mla
    for i in range(n_all):  # llama_model_deepseek2::load_arch_tensors
        t.append((blk(i, "attn_norm.weight"), (e,)))
        if qr > 0:
            t += [
                (blk(i, "attn_q_a_norm.weight"), (qr,)),
                (blk(i, "attn_q_a.weight"), (e, qr)),
                (blk(i, "attn_q_b.weight"), (qr, nh * kd)),
            ]
        else:
            t.append((blk(i, "attn_q.weight"), (e, nh * kd)))
        t += [
            (blk(i, "attn_kv_a_norm.weight"), (kvr,)),
            (blk(i, "attn_kv_a_mqa.weight"), (e, kvr + rope)),
        ]
        if o["mla"]:
            t += [(blk(i, "attn_k_b.weight"), (nope, kvr, nh)), (blk(i, "attn_v_b.weight"), (kvr, vd, nh))]
        else:
            t.append((blk(i, "attn_kv_b.weight"), (kvr, nh * (nope + vd))))
        t += [(blk(i, "attn_output.weight"), (nh * vd, e)), (blk(i, "ffn_norm.weight"), (e,))]
        if i < o["n_layer_dense_lead"]:
            t += _dense_ffn(i, e, o["n_ff"])
        else:
            t += _moe_exps(i, e, o["n_ff_exp"], o["n_expert"])
            t.append((blk(i, "exp_probs_b.bias"), (o["n_expert"],)))
            t += _shexp(i, e, o["n_ff_exp"] * o["n_expert_shared"])
        if i >= o["n_layer"]:
            t += _nextn(i, e, o["n_vocab"], full_heads=False)
    return _write(path, "deepseek2", hp, t, o)


# --------------------------------------------------------------------------------------------
# glm4moe


@register("glm4moe")
def build_glm4moe(path: Path, **overrides: Any) -> Path:
    """GLM-4.5-style MoE: leading dense layers, biased Q/K/V, optional Q/K norms, partial RoPE
    (half the head), sigmoid gating with ``exp_probs_b``, shared experts, and one NextN/MTP block
    appended after the trunk (in the file, skipped by llama.cpp unless ``load_mtp``). Extras:
    ``n_layer_dense_lead``, ``n_expert_shared``, ``qk_norm``, ``n_nextn``, ``nextn_full_heads``
    (also write the optional ``nextn.embed_tokens`` / ``nextn.shared_head_head``)."""
    o = options(
        dict(_COMMON, n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
             n_expert=8, n_expert_used=2, n_ff_exp=32, n_expert_shared=1, n_layer_dense_lead=1,
             qk_norm=True, n_nextn=1, nextn_full_heads=False),
        overrides,
    )
    n_all = o["n_layer"] + o["n_nextn"]
    # llama_model_glm4_moe::load_arch_hparams (keys as conversion/glm.py writes them)
    hp = _attn_hp(o) | {
        "block_count": n_all,
        "feed_forward_length": o["n_ff"],
        "expert_feed_forward_length": o["n_ff_exp"],
        "expert_count": o["n_expert"],
        "expert_used_count": o["n_expert_used"],
        "expert_shared_count": o["n_expert_shared"],
        "leading_dense_block_count": o["n_layer_dense_lead"],
        "expert_gating_func": 2,  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        "expert_weights_scale": 1.0,
        "expert_weights_norm": True,
        "rope.dimension_count": o["head_dim"] // 2,
        "rope.freq_base": 1000000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
    }
    if o["n_nextn"]:
        hp["nextn_predict_layers"] = o["n_nextn"]
    e, hd = o["n_embd"], o["head_dim"]
    q, kv = hd * o["n_head"], hd * o["n_head_kv"]
    t = _embd_out(o)
    for i in range(n_all):  # llama_model_glm4_moe::load_arch_tensors
        t += [
            (blk(i, "attn_norm.weight"), (e,)),
            (blk(i, "attn_q.weight"), (e, q)),
            (blk(i, "attn_k.weight"), (e, kv)),
            (blk(i, "attn_v.weight"), (e, kv)),
            (blk(i, "attn_q.bias"), (q,)),
            (blk(i, "attn_k.bias"), (kv,)),
            (blk(i, "attn_v.bias"), (kv,)),
            (blk(i, "attn_output.weight"), (q, e)),
        ]
        if o["qk_norm"]:
            t += [(blk(i, "attn_q_norm.weight"), (hd,)), (blk(i, "attn_k_norm.weight"), (hd,))]
        t.append((blk(i, "post_attention_norm.weight"), (e,)))
        if i >= o["n_layer_dense_lead"]:
            t += _moe_exps(i, e, o["n_ff_exp"], o["n_expert"])
            t.append((blk(i, "exp_probs_b.bias"), (o["n_expert"],)))
            if o["n_expert_shared"] > 0:
                t += _shexp(i, e, o["n_ff_exp"] * o["n_expert_shared"])
        else:
            t += _dense_ffn(i, e, o["n_ff"])
        if i >= o["n_layer"]:
            t += _nextn(i, e, o["n_vocab"], full_heads=o["nextn_full_heads"])
    return _write(path, "glm4moe", hp, t, o)
