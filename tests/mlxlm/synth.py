"""Tiny random-weight MLX models (qwen3, qwen3_5 with linear attention, qwen3_moe), built with
mlx-lm's own classes and quantized with mlx-lm's own `quantize_model`, cached under
~/.cache/ggfit/mlx-synth/ (never committed). `python -m tests.mlxlm.synth` builds them all."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

VOCAB = 1024

CONFIGS: dict[str, dict] = {
    "qwen3": {
        "model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 3, "intermediate_size": 768,
        "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "tie_word_embeddings": False,
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB, "max_position_embeddings": 32768, "linear_num_value_heads": 4,
            "linear_num_key_heads": 2, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10]},
        },
        "tie_word_embeddings": True,
    },
}


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ggfit" / "mlx-synth"


def _key(name: str, bits: int | None, group_size: int) -> str:
    import mlx.core as mx
    import mlx_lm

    blob = json.dumps([CONFIGS[name], bits, group_size, mx.__version__, mlx_lm.__version__, 3], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build(name: str, bits: int | None = 4, group_size: int = 64) -> Path:
    """The model directory (config.json, model.safetensors, tokenizer files), built once."""
    out = cache_root() / f"{name}-{'bf16' if bits is None else f'q{bits}g{group_size}'}-{_key(name, bits, group_size)}"
    if (out / "config.json").exists():
        return out
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    config = json.loads(json.dumps(CONFIGS[name]))
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # bf16 like a converted checkpoint; A_log stays f32 (the models' cast_predicate)
    model.update(tree_map_with_path(lambda p, x: x if p.endswith("A_log") else x.astype(mx.bfloat16),
                                    model.parameters()))
    if bits is not None:
        model, config = quantize_model(model, config, group_size, bits)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    _write_tokenizer(tmp)
    os.replace(tmp, out)
    return out


def _byte_symbol(b: int) -> str:
    """GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for chr(256 + n)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def _write_tokenizer(path: Path) -> None:
    """A byte-level word tokenizer of VOCAB entries with a ChatML template, enough for mlx_lm.server."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # only the byte-level symbols of ASCII bytes: whatever the random model samples decodes to text
    alphabet = [_byte_symbol(b) for b in range(128)]
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    n = len(vocab)
    for a in "abcdefghijklmnopqrstuvwxyz":
        for b in "abcdefghijklmnopqrstuvwxyz":
            if n >= VOCAB:
                break
            vocab.setdefault(a + b, n)
            n = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": template, "model_max_length": 32768}))


if __name__ == "__main__":
    for n in CONFIGS:
        for b in (4, 8, None):
            print(build(n, b))
