"""Benchmark: fitter.fit.quants predictions against the pinned llama.cpp's llama_model_quantize.

    python benchmarks/quants_matrix.py [--section files|dry|all] [--arch KEY ...] [--ftype Q4_K_M ...] [--imatrix]

files: every synthetic architecture (tests/synth, F16, shapes big enough for K-quants: n_embd 512 for
most, n_embd 320 (not a multiple of 256) for a few so that tensor_type_fallback triggers) is quantized
by the pinned llama.cpp (llama-cpp-python's `llama_model_quantize`, in a child process: GGML asserts
abort) to every ftype of QUANT_FTYPES; per cell, predicted vs actual file bytes, the difference, and
the tensors whose type in the written file differs from the prediction (the header size too).

dry: full-size shapes (Llama 3 8B/70B, Qwen2 72B, Phi-3, Gemma 3 1B, Qwen3 30B-A3B, gpt-oss 20B,
Qwen3.6 35B-A3B, GLM-4.5-Air, DeepSeek-V3 at 12 layers, Falcon 7B/40B) as sparse header-only files,
through llama.cpp's --dry-run: every tensor's type from its log, and the tensor bytes to the 0.01 MiB
it prints (a dry run writes no file, so the header is checked by the files section).

Without --imatrix, ftypes that need an importance matrix must be refused by llama.cpp, as predicted
(a dry run does not refuse: its types are then those without an imatrix); with --imatrix an all-ones
importance matrix is passed, so the IQ types run too (slowly: about an hour and a half for the files).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitter.fit.quants import (  # noqa: E402
    FTYPES,
    QUANT_FTYPES,
    QuantOptions,
    QuantPrediction,
    QuantRefused,
    parse_ggml_type,
    predict_quant,
    resolve_ftype,
)
from fitter.gguf.reader import read_header  # noqa: E402

# The child: quantize argv[1] -> argv[2] as llama_ftype argv[3]; argv[4] == "1" passes an all-ones
# imatrix for every 2-D+ tensor (ne0 * ne2 floats, as llama-quant.cpp checks); argv[5] threads;
# argv[6] == "1" sets allow_requantize (--allow-requantize); argv[7] == "1" sets dry_run (--dry-run);
# argv[8], if given, is the JSON of a QuantOptions with ggml type ids (--pure, --output-tensor-type, ...).
_CHILD = r"""
import ctypes, sys
import numpy as np
import llama_cpp
inp, out, ftype, use_imatrix, nthread = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
llama_cpp.llama_backend_init()
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = ftype
p.nthread = nthread
p.allow_requantize = sys.argv[6] == "1"
p.dry_run = sys.argv[7] == "1"
keep = []
if len(sys.argv) > 8:
    import json
    o = json.loads(sys.argv[8])
    p.pure = o["pure"]
    p.quantize_output_tensor = not o["leave_output_tensor"]
    if o["output_tensor_type"] is not None:
        p.output_tensor_type = o["output_tensor_type"]
    if o["token_embedding_type"] is not None:
        p.token_embedding_type = o["token_embedding_type"]
    if o["tensor_types"]:
        n = len(o["tensor_types"])
        tt = (llama_cpp.llama_model_tensor_override * (n + 1))()
        for i, (pat, t) in enumerate(o["tensor_types"]):
            tt[i].pattern = pat.lower().encode()
            tt[i].type = t
        tt[n].pattern = None
        tt[n].type = 43  # GGML_TYPE_COUNT
        keep.append(tt)
        p.tt_overrides = ctypes.cast(tt, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
if use_imatrix:
    from fitter.gguf.reader import read_header
    h = read_header(inp)
    ents = []
    for t in h.tensors:
        dims = [d for d in t.shape]
        while len(dims) > 1 and dims[-1] == 1:
            dims.pop()
        if len(dims) < 2:
            continue
        n = dims[0] * (dims[2] if len(dims) > 2 else 1)
        arr = np.ones(n, dtype=np.float32)
        keep.append(arr)
        ents.append((t.name.encode(), arr, n))
    Arr = llama_cpp.llama_model_imatrix_data * (len(ents) + 1)
    data = Arr()
    for i, (name, arr, n) in enumerate(ents):
        data[i].name = name
        data[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        data[i].size = n
    data[len(ents)].name = None
    keep.append(data)
    p.imatrix = ctypes.cast(data, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
rc = llama_cpp.llama_model_quantize(inp.encode(), out.encode(), ctypes.byref(p))
sys.exit(rc)
"""

ROOT = Path(__file__).resolve().parent.parent


def quantize_reference(inp: str | os.PathLike[str], out: str | os.PathLike[str], ftype: str, *,
                       imatrix: bool = False, allow_requantize: bool = False, dry_run: bool = False,
                       options: QuantOptions | None = None, nthread: int = 2,
                       timeout: float = 600) -> tuple[int, str]:
    """Quantize with the pinned llama.cpp in a child process; returns (exit code, log)."""
    import json

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    extra = []
    if options is not None:
        def tid(name: str | None) -> int | None:
            return None if name is None else parse_ggml_type(name)

        extra = [json.dumps(dict(
            pure=options.pure, leave_output_tensor=options.leave_output_tensor,
            output_tensor_type=tid(options.output_tensor_type), token_embedding_type=tid(options.token_embedding_type),
            tensor_types=[(p, tid(t)) for p, t in options.tensor_types]))]
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, os.fspath(inp), os.fspath(out), str(FTYPES[ftype].id), "1" if imatrix else "0",
         str(nthread), "1" if allow_requantize else "0", "1" if dry_run else "0", *extra],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT),
    )
    return r.returncode, r.stdout + r.stderr


@dataclass
class Cell:
    arch: str
    ftype: str
    predicted: int = 0
    actual: int | None = None
    mismatches: list[str] = field(default_factory=list)
    refused_predicted: str | None = None
    refused_actual: bool = False
    error: str | None = None
    seconds: float = 0.0
    actual_mib: float | None = None  # dry runs: llama.cpp's printed "quant size" (2 decimals)

    @property
    def diff(self) -> int | None:
        return None if self.actual is None else self.actual - self.predicted

    @property
    def ok(self) -> bool:
        if self.error:
            return False
        if self.refused_predicted or self.refused_actual:
            return bool(self.refused_predicted) == self.refused_actual
        return self.diff == 0 and not self.mismatches


@dataclass
class RawGGUF:
    """A little-endian GGUF v2/v3 header as bytes: what write_split needs and what type checks read."""

    n_kv: int
    kv_raw: bytes  # the key/value section, verbatim
    tensors: list[tuple[str, list[int], int, int]]  # name, dims, ggml type id, data offset
    data_offset: int
    alignment: int


def parse_gguf(path: str | os.PathLike[str]) -> RawGGUF:
    """A minimal parser of its own rather than fitter.gguf.reader, which refuses types gguf-py does not
    know (Q2_0): what llama-quantize wrote is read as it is."""
    import struct

    with open(path, "rb") as f:
        buf = f.read(1 << 20)
        pos = 0

        def need(n: int) -> None:
            nonlocal buf
            while pos + n > len(buf):
                more = f.read(max(n, 1 << 20))
                if not more:
                    raise ValueError("truncated GGUF")
                buf += more

        def u(fmt: str) -> int:
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n)
            v = struct.unpack_from("<" + fmt, buf, pos)[0]
            pos += n
            return v

        def s() -> bytes:
            nonlocal pos
            n = u("Q")
            need(n)
            pos += n
            return buf[pos - n : pos]

        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

        def skip_value(vt: int) -> None:
            nonlocal pos
            if vt == 8:
                s()
            elif vt == 9:
                et, n = u("I"), u("Q")
                if et == 8:
                    for _ in range(n):
                        s()
                else:
                    need(sizes[et] * n)
                    pos += sizes[et] * n
            else:
                need(sizes[vt])
                pos += sizes[vt]

        need(24)
        if buf[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        pos = 8
        n_tensors, n_kv = u("Q"), u("Q")
        kv_start = pos
        alignment = 32
        for _ in range(n_kv):
            key = s()
            vt = u("I")
            if key == b"general.alignment" and vt == 4:
                alignment = u("I")
            else:
                skip_value(vt)
        kv_raw = bytes(buf[kv_start:pos])
        tensors = []
        for _ in range(n_tensors):
            name = s().decode()
            dims = [u("q") for _ in range(u("I"))]
            tensors.append((name, dims, u("I"), u("Q")))
        return RawGGUF(n_kv, kv_raw, tensors, pos + (-pos) % alignment, alignment)


def write_split(src: str | os.PathLike[str], prefix: str | os.PathLike[str], n_split: int) -> list[Path]:
    """Split a GGUF into ``<prefix>-0000i-of-0000N.gguf`` shards as llama-gguf-split does: every shard
    carries the key/values plus split.no (u16), split.count (u16), split.tensors.count (i32), and a
    contiguous run of the tensors."""
    import struct

    raw = parse_gguf(src)
    sizes = {0: (1, 4), 1: (1, 2), 8: (32, 34), 30: (1, 2)}  # the types of the synthetic F16 models
    per = -(-len(raw.tensors) // n_split)
    paths = []
    with open(src, "rb") as fin:
        for i in range(n_split):
            part = raw.tensors[i * per : (i + 1) * per]
            path = Path(f"{prefix}-{i + 1:05d}-of-{n_split:05d}.gguf")

            def kv(key: str, vt: int, fmt: str, v: int) -> bytes:
                return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vt) + struct.pack("<" + fmt, v)

            extra = kv("split.no", 2, "H", i) + kv("split.count", 2, "H", n_split) + \
                kv("split.tensors.count", 5, "i", len(raw.tensors))
            infos, blobs, off = b"", [], 0
            for name, dims, t, src_off in part:
                block, size = sizes[t]
                n = 1
                for d in dims[1:]:
                    n *= d
                nbytes = dims[0] // block * size * n
                fin.seek(raw.data_offset + src_off)
                blobs.append(fin.read(nbytes))
                infos += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims))
                infos += b"".join(struct.pack("<q", d) for d in dims) + struct.pack("<IQ", t, off)
                off += nbytes + (-nbytes) % 32
            head = b"GGUF" + struct.pack("<IQQ", 3, len(part), raw.n_kv + 3) + raw.kv_raw + extra + infos
            with open(path, "wb") as f:
                f.write(head + b"\0" * ((-len(head)) % 32))
                for b in blobs:
                    f.write(b + b"\0" * ((-len(b)) % 32))
            paths.append(path)
    return paths


def type_mismatches(pred: QuantPrediction, out_path: str | os.PathLike[str]) -> list[str]:
    """Tensors whose type in the written file is not the predicted one (and tensors missing either
    side), and the header size if it differs."""
    from fitter.fit.quants import type_name

    raw = parse_gguf(out_path)
    got = {name: type_name(t) for name, _, t, _ in raw.tensors}
    want = pred.types()
    bad = [f"{n}: predicted {want[n]}, got {got.get(n, 'missing')}" for n in want if got.get(n) != want[n]]
    bad += [f"{n}: not predicted ({got[n]})" for n in got if n not in want]
    if raw.data_offset != pred.header_bytes:
        bad.append(f"header: predicted {pred.header_bytes} bytes, got {raw.data_offset}")
    return bad


def run_cell(arch: str, model: Path, ftype: str, workdir: Path, *, imatrix: bool) -> Cell:
    cell = Cell(arch, ftype)
    t0 = time.perf_counter()
    header = read_header(model)
    try:
        pred = predict_quant(header, ftype, imatrix=imatrix)
        cell.predicted = pred.file_bytes
        expect_refusal = pred.needs_imatrix and not imatrix
    except QuantRefused as e:
        pred = None
        cell.refused_predicted = str(e)
        expect_refusal = True
    if pred is not None and expect_refusal:
        cell.refused_predicted = "needs an imatrix"
    out = workdir / f"{arch}-{ftype}.gguf"
    rc, log = quantize_reference(model, out, ftype, imatrix=imatrix)
    if rc != 0:
        cell.refused_actual = True
        if not expect_refusal:
            tail = [ln for ln in log.splitlines() if "error" in ln.lower() or "failed" in ln.lower()]
            cell.error = (tail[-1] if tail else log.strip().splitlines()[-1] if log.strip() else f"rc {rc}")[:200]
    elif pred is not None and not expect_refusal:
        cell.actual = out.stat().st_size
        cell.mismatches = type_mismatches(pred, out)
    if out.exists():
        out.unlink()
    cell.seconds = time.perf_counter() - t0
    return cell


# Shapes: big enough that K-quants apply (n_embd and n_ff multiples of 256), except the "odd" models
# (n_embd 320: rows of 320 are not a multiple of 256, so K-quants fall back). Vocab 512.
MODELS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(n_layer=8, n_embd=512, n_head=8, n_head_kv=2, n_ff=1024)),
    "llama-odd": ("llama", dict(n_layer=8, n_embd=320, n_head=5, n_head_kv=1, n_ff=640)),
    "qwen2": ("qwen2", dict(n_layer=4, n_embd=512, n_head=8, n_head_kv=2, n_ff=1024)),
    "qwen3": ("qwen3", dict(n_layer=4, n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=768)),
    "phi3": ("phi3", dict(n_layer=4, n_embd=512, n_head=8, n_head_kv=8, n_ff=1024)),
    "mistral3": ("mistral3", dict(n_layer=4, n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=1024)),
    "gemma2": ("gemma2", dict(n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024)),
    "gemma3": ("gemma3", dict(n_layer=6, n_embd=320, n_head=4, n_head_kv=1, n_ff=1024)),
    "gemma4": ("gemma4", dict(n_embd=512, n_ff=512)),
    "qwen3moe": ("qwen3moe", dict(n_embd=512, n_ff=512, n_ff_exp=256, head_dim=64)),
    "qwen35": ("qwen35", dict(n_embd=512, n_ff=512)),
    "qwen35moe": ("qwen35moe", dict(n_embd=512, n_ff=512, n_ff_exp=256, n_ff_shexp=256)),
    "qwen3next": ("qwen3next", dict(n_embd=512, n_ff=512, n_ff_exp=256, n_ff_shexp=256)),
    "gpt-oss": ("gpt-oss", dict(n_embd=512, n_ff=512, n_ff_exp=256, head_dim=64, expert_type=None)),
    "deepseek2": ("deepseek2", dict(n_embd=512, n_ff=512, n_ff_exp=256, q_lora_rank=256, kv_lora_rank=256,
                                    qk_rope=32, qk_nope=64, v_head_dim=64)),
    "glm4moe": ("glm4moe", dict(n_embd=512, n_ff=512, n_ff_exp=256, head_dim=64)),
}


def build_model(key: str) -> Path:
    from tests.synth import build

    arch, overrides = MODELS[key]
    return build(arch, ftype="f16", **overrides)


# Full-size shapes (sparse header-only files: no tensor data on disk), checked through llama.cpp's
# --dry-run, which logs every tensor's target type and the total tensor bytes without reading data.
FULL_SIZE: dict[str, tuple[str, dict]] = {
    # Llama 3 70B: 80 layers with GQA, the only shape LLM_TYPE_70B's attn_v rule applies to
    "llama-70b": ("llama", dict(n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, n_ff=28672, n_vocab=128256)),
    "llama-8b": ("llama", dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256)),
    # Qwen2 72B: 80 layers make LLM_TYPE_70B for qwen2 too; n_ff 29568 is not a multiple of 256
    "qwen2-72b": ("qwen2", dict(n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, n_ff=29568, n_vocab=152064)),
    # Phi-3 mini: fused attn_qkv, no GQA
    "phi3-mini": ("phi3", dict(n_layer=32, n_embd=3072, n_head=32, n_head_kv=32, n_ff=8192, n_vocab=32064)),
    # Gemma 3 1B: n_embd 1152 is not a multiple of 256 (fallbacks), tied embeddings, MQA
    "gemma3-1b": ("gemma3", dict(n_layer=26, n_embd=1152, n_head=4, n_head_kv=1, head_dim=256, n_ff=6912,
                                 n_vocab=262144, sliding_window=512)),
    # Qwen3 30B-A3B: 128 experts (n_expert != 8)
    "qwen3moe-30b": ("qwen3moe", dict(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144,
                                      n_ff_exp=768, n_expert=128, n_expert_used=8, n_vocab=151936)),
    # gpt-oss 20B: n_embd 2880 (not a multiple of 256), 32 experts, F16 experts
    "gpt-oss-20b": ("gpt-oss", dict(n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_ff=2880,
                                    n_ff_exp=2880, n_expert=32, n_expert_used=4, n_vocab=201088, expert_type=None)),
    # Qwen3.6 35B-A3B: hybrid gated delta net + attention, 256 experts, one MTP layer
    "qwen36-35b-a3b": ("qwen35moe", dict(
        n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_rot=64, n_ff=512, n_ff_exp=512,
        n_ff_shexp=512, n_expert=256, n_expert_used=8, full_attention_interval=4, ssm_d_conv=4,
        ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32, n_vocab=248320, n_ctx_train=262144, n_nextn=1)),
    # GLM-4.5-Air-like: leading dense layer, 128 experts, shared expert, NextN layer
    "glm45-air": ("glm4moe", dict(n_layer=46, n_embd=4096, n_head=96, n_head_kv=8, head_dim=128, n_ff=10944,
                                  n_ff_exp=1408, n_expert=128, n_expert_used=8, n_vocab=151552)),
    # DeepSeek-V3-like MLA at reduced depth: 256 experts, q/kv LoRA, split attn_k_b/attn_v_b
    "deepseek-v3-12l": ("deepseek2", dict(n_layer=12, n_embd=7168, n_head=128, n_ff=18432, q_lora_rank=1536,
                                          kv_lora_rank=512, qk_rope=64, qk_nope=128, v_head_dim=128,
                                          n_layer_dense_lead=3, n_expert=256, n_expert_used=8, n_ff_exp=2048,
                                          n_vocab=129280)),
}

# Architectures without a synthetic builder, written directly (header only): llama-quantize loads only
# the hparams (load_hparams, not load_tensors), so any tensor list is quantized as long as they load.
def _falcon(n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_vocab: int) -> tuple[str, dict, list]:
    hd = n_embd // n_head
    hp = {"context_length": 2048, "embedding_length": n_embd, "block_count": n_layer, "feed_forward_length": n_ff,
          "attention.head_count": n_head, "attention.head_count_kv": n_head_kv, "attention.layer_norm_epsilon": 1e-5}
    t = [("token_embd.weight", (n_embd, n_vocab)), ("output_norm.weight", (n_embd,)), ("output_norm.bias", (n_embd,)),
         ("output.weight", (n_embd, n_vocab))]
    for i in range(n_layer):
        t += [(f"blk.{i}.attn_norm.weight", (n_embd,)), (f"blk.{i}.attn_norm.bias", (n_embd,)),
              (f"blk.{i}.attn_qkv.weight", (n_embd, n_embd + 2 * hd * n_head_kv)),
              (f"blk.{i}.attn_output.weight", (n_embd, n_embd)),
              (f"blk.{i}.ffn_up.weight", (n_embd, n_ff)), (f"blk.{i}.ffn_down.weight", (n_ff, n_embd))]
    return "falcon", hp, t


CUSTOM: dict[str, tuple[str, dict, list]] = {
    # Falcon 7B: n_embd 4544 (not a multiple of 256), MQA, fused QKV; the falcon-only rules
    "falcon-7b": _falcon(32, 4544, 71, 1, 18176, 65024),
    # Falcon 40B: 60 layers, rows multiples of 256 (Q3_K_M / Q4_K_M falcon ffn_down rules apply unfallen)
    "falcon-40b": _falcon(60, 8192, 128, 8, 32768, 65024),
}


def build_custom(key: str) -> Path:
    from tests.synth.common import cache_dir, write_gguf

    path = cache_dir() / f"quants-{key}-v1.gguf"
    if not path.exists():
        arch, hp, tensors = CUSTOM[key]
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write_gguf(tmp, arch, hp, tensors, ftype="f16", sparse=True)
        os.replace(tmp, path)
    return path


_DRY_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+), size =\s*([\d.]+) MiB"
                       r"(?: ->\s*([\d.]+) MiB \((\S+)\))?")
_DRY_TOTAL = re.compile(r"quant size\s*=\s*([\d.]+) MiB")


def dry_run_types(log: str) -> tuple[dict[str, str], float | None]:
    """Tensor name -> output type (upper case), and the "quant size" total in MiB, from a dry run's log."""
    types: dict[str, str] = {}
    total = None
    for line in log.splitlines():
        m = _DRY_LINE.search(line)
        if m:
            types[m.group(1)] = (m.group(5) or m.group(2)).upper()
        t = _DRY_TOTAL.search(line)
        if t:
            total = float(t.group(1))
    return types, total


def run_dry_cell(key: str, model: Path, ftype: str, *, imatrix: bool) -> Cell:
    """A full-size cell: types from llama.cpp's dry-run log, tensor bytes to its 0.01 MiB print."""
    cell = Cell(key, ftype)
    t0 = time.perf_counter()
    header = read_header(model)
    try:
        pred = predict_quant(header, ftype, imatrix=imatrix)
    except QuantRefused as e:
        pred = None
        cell.refused_predicted = str(e)
    rc, log = quantize_reference(model, "/nonexistent/dry-run.gguf", ftype, imatrix=imatrix, dry_run=True)
    if rc != 0:
        cell.refused_actual = True
    elif pred is not None:
        types, total = dry_run_types(log)
        want = {t.name: t.type_name for t in pred.tensors}
        cell.mismatches = [f"{n}: predicted {want[n]}, got {types.get(n, 'missing')}" for n in want
                           if types.get(n) != want[n]]
        data = sum(t.nbytes for t in pred.tensors)
        cell.predicted = data
        # the log prints MiB with 2 decimals: compare to that precision, report in bytes
        if total is None or abs(total - data / 2**20) > 0.006:
            cell.mismatches.append(f"quant size: predicted {data / 2**20:.2f} MiB, llama.cpp {total} MiB")
        cell.actual_mib = total
        cell.actual = data if not cell.mismatches else int(round((total or 0) * 2**20))
    cell.seconds = time.perf_counter() - t0
    return cell


def build_full_size(key: str) -> Path:
    from tests.synth import build

    arch, overrides = FULL_SIZE[key]
    return build(arch, sparse=True, **overrides)


def _print_cell(c: Cell, label: str = "") -> None:
    if c.refused_predicted or c.refused_actual:
        what = (f"refused (predicted: {c.refused_predicted or 'no'}; llama.cpp: "
                f"{'refused' if c.refused_actual else 'accepted'})")
    elif c.actual_mib is not None:
        what = (f"predicted {c.predicted:>12} B = {c.predicted / 2**20:10.2f} MiB, llama.cpp {c.actual_mib:10.2f} MiB, "
                f"type mismatches {len(c.mismatches)}")
    else:
        what = (f"predicted {c.predicted:>12} actual {c.actual if c.actual is not None else '-':>12} "
                f"diff {c.diff if c.diff is not None else '-':>6} type mismatches {len(c.mismatches)}")
    flag = "ok " if c.ok else "BAD"
    print(f"{flag} {c.arch:16s} {c.ftype:10s} {what}{label}  ({c.seconds:.1f}s)"
          + (f"  error: {c.error}" if c.error else ""), flush=True)
    for m in c.mismatches[:10]:
        print(f"        {m}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="model key(s) of MODELS / FULL_SIZE (default: all)")
    ap.add_argument("--ftype", action="append", help="ftype(s) (default: all of QUANT_FTYPES)")
    ap.add_argument("--imatrix", action="store_true", help="pass an all-ones imatrix (runs the IQ types too)")
    ap.add_argument("--section", choices=("files", "dry", "all"), default="all",
                    help="files: quantize small models and compare the files; dry: full-size shapes through "
                         "llama.cpp's dry run (types and tensor bytes); all: both (default)")
    args = ap.parse_args(argv)
    ftypes = [resolve_ftype(f) for f in args.ftype] if args.ftype else list(QUANT_FTYPES)
    t_start = time.perf_counter()
    cells: list[Cell] = []
    if args.section in ("files", "all"):
        print("== files: quantized by llama.cpp, file bytes and tensor types compared ==", flush=True)
        keys = [k for k in (args.arch or MODELS) if k in MODELS]
        with tempfile.TemporaryDirectory(prefix="ggfit-quants-") as tmp:
            for key in keys:
                model = build_model(key)
                for ft in ftypes:
                    c = run_cell(key, model, ft, Path(tmp), imatrix=args.imatrix)
                    cells.append(c)
                    _print_cell(c)
    if args.section in ("dry", "all"):
        print("== full size: llama.cpp --dry-run, tensor types and tensor bytes (0.01 MiB) compared ==", flush=True)
        keys = [k for k in (args.arch or [*FULL_SIZE, *CUSTOM]) if k in FULL_SIZE or k in CUSTOM]
        for key in keys:
            model = build_full_size(key) if key in FULL_SIZE else build_custom(key)
            for ft in ftypes:
                c = run_dry_cell(key, model, ft, imatrix=args.imatrix)
                cells.append(c)
                _print_cell(c)
    bad = [c for c in cells if not c.ok]
    n_cmp = sum(1 for c in cells if c.actual is not None)
    n_ref = sum(1 for c in cells if c.refused_actual and c.refused_predicted)
    print(f"\n{len(cells)} cells: {n_cmp} compared, {n_ref} refused as predicted, {len(bad)} bad; "
          f"total {time.perf_counter() - t_start:.1f}s")
    for c in bad:
        print(f"BAD {c.arch} {c.ftype}: {c.error or (c.mismatches[:1] or ['refusal differs'])[0]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
