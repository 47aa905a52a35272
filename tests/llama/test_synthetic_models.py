"""Every synthetic model loads in llama.cpp, decodes to finite logits, and llama.cpp reads back the
hyperparameters the builder wrote (its ``print_info:`` lines and its KV-cache layout)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from fitter.gguf.reader import SkippedArray, read_header
from tests.synth import REGISTRY, build
from tests.synth.common import options
from tests.synth.loadcheck import LlamaCppError, load_and_decode

pytestmark = pytest.mark.slow

# llama.cpp behaviour that differs from "what the file says", per arch.
# phi3: llama_model_phi3::load_arch_hparams reads attention.sliding_window, then disables SWA (n_swa = 0).
N_SWA_FORCED = {"phi3": 0}
# gemma2: llama_model_gemma2::load_arch_hparams defaults n_swa to 4096 when the key is absent.
N_SWA_DEFAULT = {"gemma2": 4096}
# Default SWA period (llama_model_base::load_swa_pattern(ml, n)) when attention.sliding_window_pattern
# is absent; gemma4 requires the array. gemma3 has SWA only when sliding_window > 0.
SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
# Plain single-KV-cache archs: one llama_kv_cache holding every layer.
PLAIN_ATTENTION = {"llama", "qwen2", "qwen3", "phi3", "mistral3"}

# Extra shapes of the dense builders: quantized types, tied/untied output, optional features.
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("llama", {"ftype": "q8_0", "tie_embeddings": True, "n_layer": 3}),
    ("llama", {"ftype": "q4_k", "n_embd": 256, "n_ff": 512, "n_head": 4, "n_head_kv": 1}),
    ("llama", {"ftype": "f32", "head_dim": 16}),
    ("qwen2", {"ftype": "bf16", "tie_embeddings": False}),
    ("qwen3", {"ftype": "q4_0", "head_dim": 64, "n_head": 8, "n_head_kv": 2}),
    ("phi3", {"longrope": True, "n_ctx_train": 131072, "n_head_kv": 1}),
    ("mistral3", {"yarn": False}),
    ("gemma2", {"swa_pattern": [True, False, False, True], "sliding_window": None}),
    ("gemma3", {"sliding_window": 0, "n_layer": 3}),
    ("gemma3", {"n_layer": 12, "swa_pattern": 3, "ftype": "q8_0"}),
    ("gemma4", {"k_eq_v": True, "n_embd_per_layer": 0, "n_kv_shared": 0, "double_wide_mlp": False}),
    ("gemma4", {"n_layer": 6, "swa_pattern": [True, False, True, False, True, True], "n_kv_shared": 2}),
]


def _arch_key(md: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    return md.get(f"{arch}.{key}", default)


def _printed(v: Any) -> str:
    """How llama_model::print_info prints a per-layer value (print_f): one value, or [a, b, ...]."""
    if isinstance(v, list):
        return str(v[0]) if len(set(v)) == 1 else "[" + ", ".join(str(x) for x in v) + "]"
    return str(v)


def _per_layer(v: Any, n_layer: int) -> list[int]:
    return list(v) if isinstance(v, list) else [int(v)] * n_layer


def _expected_swa_layers(arch: str, md: dict[str, Any], n_layer: int) -> list[bool] | None:
    """Per-layer is_swa as llama.cpp derives it, for the archs whose rule we know."""
    sw = _arch_key(md, arch, "attention.sliding_window")
    pat = _arch_key(md, arch, "attention.sliding_window_pattern")
    if arch == "gemma4":
        return [bool(x) for x in pat]
    if arch not in SWA_PERIOD:
        return None
    if arch == "gemma3" and not sw:
        return [False] * n_layer
    if isinstance(pat, list):
        return [bool(x) for x in pat]
    period = int(pat) if pat is not None else SWA_PERIOD[arch]
    return [period == 0 or (i % period) < period - 1 for i in range(n_layer)]  # llama_hparams::set_swa_pattern


def _kv_caches(log: str) -> dict[str, int]:
    """Layers per KV cache from llama_kv_cache's 'size = ... (N cells, L layers, ...)' lines."""
    out: dict[str, int] = {}
    kind = "single"
    for line in log.splitlines():
        if "creating non-SWA KV cache" in line:
            kind = "non-swa"
        elif "creating     SWA KV cache" in line:
            kind = "swa"
        m = re.search(r"llama_kv_cache: size = .*\(\s*(\d+) cells,\s*(\d+) layers", line)
        if m:
            out[kind] = int(m.group(2))
    return out


def check_against_llama(path, **ctx) -> dict[str, Any]:
    header = read_header(str(path))
    md = header.metadata
    arch = header.architecture
    assert arch is not None
    r = load_and_decode(path, **ctx)
    info = r["print_info"]
    log = r["log"]

    assert r["finite_logits"], f"non-finite logits from {arch}"
    assert len(r["generated"]) == 4
    tokens = md["tokenizer.ggml.tokens"]
    assert r["n_vocab"] == len(tokens)

    # llama_model_loader: "loaded meta data with N key-value pairs and M tensors"
    m = re.search(r"loaded meta data with (\d+) key-value pairs and (\d+) tensors", log)
    assert m and int(m.group(2)) == len(header.tensors)

    n_layer = int(_arch_key(md, arch, "block_count"))  # llama.cpp's n_layer_all
    n_nextn = int(_arch_key(md, arch, "nextn_predict_layers", 0))  # MTP layers, not in n_layer()
    n_embd = int(_arch_key(md, arch, "embedding_length"))
    n_head = _arch_key(md, arch, "attention.head_count")
    n_head_kv = _arch_key(md, arch, "attention.head_count_kv", n_head)
    head0 = _per_layer(n_head, n_layer)[0]
    assert info["arch"] == arch
    assert int(info["n_layer_all"]) == n_layer
    assert int(info["n_layer"]) == n_layer - n_nextn == r["n_layer"]
    assert int(info["n_embd"]) == n_embd == r["n_embd"]
    assert int(info["n_ctx_train"]) == int(_arch_key(md, arch, "context_length")) == r["n_ctx_train"]
    assert info["n_head"] == _printed(n_head)
    assert info["n_head_kv"] == _printed(n_head_kv)
    assert not isinstance(n_head_kv, SkippedArray)
    head_k = _arch_key(md, arch, "attention.key_length", n_embd // head0 if head0 else 0)
    assert int(info["n_embd_head_k"]) == int(head_k)
    head_v = _arch_key(md, arch, "attention.value_length", n_embd // head0 if head0 else 0)
    assert int(info["n_embd_head_v"]) == int(head_v)
    n_ff = _arch_key(md, arch, "feed_forward_length")
    if n_ff is not None:
        assert info["n_ff"] == _printed(n_ff)

    sw = _arch_key(md, arch, "attention.sliding_window", N_SWA_DEFAULT.get(arch, 0))
    n_swa = N_SWA_FORCED.get(arch, sw)
    assert int(info["n_swa"]) == int(n_swa) == r["n_swa"]
    k_swa = _arch_key(md, arch, "attention.key_length_swa")
    if k_swa is not None:
        assert int(info["n_embd_head_k_swa"]) == int(k_swa)

    # KV-cache layout: how many layers land in the SWA / non-SWA caches.
    caches = _kv_caches(log)
    is_swa = _expected_swa_layers(arch, md, n_layer)
    if is_swa is not None:
        n_shared = int(_arch_key(md, arch, "attention.shared_kv_layers", 0))
        has_kv = [i < n_layer - n_shared for i in range(n_layer)]
        if any(is_swa):
            expect = {
                "non-swa": sum(1 for s, k in zip(is_swa, has_kv) if k and not s),
                "swa": sum(1 for s, k in zip(is_swa, has_kv) if k and s),
            }
        else:
            expect = {"single": sum(has_kv)}
        assert caches == expect, (caches, expect)
    elif arch in PLAIN_ATTENTION:
        assert caches == {"single": n_layer}
    return r


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registered_model_loads_and_matches(name: str) -> None:
    path = build(name)
    try:
        check_against_llama(path)
    except LlamaCppError as e:
        pytest.fail(f"llama.cpp refused synthetic {name}: {e}")


@pytest.mark.parametrize(
    "name,overrides", VARIANTS, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in VARIANTS]
)
def test_dense_variants(name: str, overrides: dict[str, Any]) -> None:
    check_against_llama(build(name, **overrides))


def test_swa_cache_is_window_sized_when_not_full() -> None:
    # llama_kv_cache_iswa: the SWA cache holds GGML_PAD(n_swa*n_seq_max + n_ubatch, 256) cells
    # unless swa_full; gemma3 defaults: window 256, so 256 + 64 padded to 512 for n_ctx 1024.
    r = load_and_decode(build("gemma3"), n_ctx=1024, swa_full=False)
    m = re.search(r"creating     SWA KV cache, size = (\d+) cells", r["log"])
    assert m and int(m.group(1)) == 512


def test_build_is_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path))
    p1 = build("llama", n_layer=3, n_embd=32)
    st = p1.stat()
    assert p1.parent == tmp_path / "synth"
    p2 = build("llama", n_layer=3, n_embd=32)
    assert p2 == p1
    assert p2.stat().st_mtime_ns == st.st_mtime_ns and p2.stat().st_ino == st.st_ino
    p3 = build("llama", n_layer=4, n_embd=32)
    assert p3 != p1
    assert sorted(x.name for x in (tmp_path / "synth").iterdir()) == sorted([p1.name, p3.name])


def test_unknown_override_is_an_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GGFIT_CACHE", str(tmp_path))
    with pytest.raises(TypeError, match="n_layers"):
        build("llama", n_layers=3)
    with pytest.raises(KeyError):
        build("no-such-arch")
    assert options({"a": 1}, {"a": 2}) == {"a": 2, "sparse": False}  # every builder takes sparse


def test_llama_cpp_refusal_is_an_exception(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(LlamaCppError) as ei:
        load_and_decode(bad)
    assert "failed at load" in str(ei.value)


def test_per_tensor_types_like_a_q4_k_m_mix() -> None:
    mix = {"output.weight": "q6_k", "blk.*.attn_v.weight": "q8_0", "blk.1.ffn_down.weight": "iq4_nl"}
    path = build("llama", n_embd=256, n_ff=512, ftype="q4_k", tensor_types=mix)
    types = {t.name: t.ggml_type.name for t in read_header(str(path)).tensors}
    assert types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == types["blk.1.attn_v.weight"] == "Q8_0"
    assert types["blk.1.ffn_down.weight"] == "IQ4_NL" and types["blk.0.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    r = check_against_llama(path)
    assert r["print_info"]["file type"] == "Q4_K - Medium"
