"""How many experts llama.cpp's router uses on the filled synthetic MoE shapes (the speed truth set's --n-cpu-moe rows).

ggml_backend_sched_compute_splits copies to the GPU only the experts a ubatch's ids use, so the prefill of a MoE under
--n-cpu-moe streams (used experts / all) of the CPU's expert bytes. A trained router spreads a ubatch of 512 tokens
over nearly every expert (the speed model's even-routing expectation, fitter.speed.work.experts_used); the random
blocks of tests/synth/shapes.py fill_weights do not: their routers send the tokens to a few experts. This script
measures it: each shape, truncated to its first N + 1 layers (fill_weights fills tensors in file order, so those
layers hold the full-size file's bytes; the last computes only the logits' token and is dropped), filled, loaded by llama-cpp-python (CPU, extra buffer types off), one ubatch of 2048
random tokens after BOS (llama-bench's pp prompt: std::rand() % n_vocab), and llama.cpp's own `ffn_moe_topk-<il>`
tensors read through the graph's eval callback: the distinct experts of the first 32 / 128 / 512 / 1024 / 2048 tokens.

    PYTHONPATH=. python3 benchmarks/synthetic_routing.py            # writes benchmarks/results/synthetic-routing.json
    PYTHONPATH=. python3 benchmarks/synthetic_routing.py gpt-oss-20b    # that shape's runs only, merged into it

Each shape runs in a child process (a failed assert aborts the child, not this script); the filled file is deleted
after (10-13 GB each). About 2-6 minutes a shape on 2 cores.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "synthetic-routing.json"
# (shape, ftype, layers built): the layers whose experts the truth set's rows put on the CPU (--n-cpu-moe <= N)
# (built with one layer more: the last layer computes only the tokens that output logits, llm_graph's inp_out_ids)
RUNS = (("qwen3-30b-a3b", "Q4_K_M", 24), ("deepseek2-30b-a3b", "Q4_K_M", 16), ("qwen36-35b-a3b", "Q4_K_M", 20),
        ("qwen36-35b-a3b", "Q3_K_M", 20), ("qwen36-35b-a3b", "Q5_K_M", 20), ("gpt-oss-20b", "Q4_K_M", 15))
PREFIXES = (32, 128, 512, 1024, 2048)
N_TOKENS = 2048


class _Tensor(ctypes.Structure):  # ggml.h struct ggml_tensor (pinned build)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def _child(shape: str, ftype: str, n_layer: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import llama_cpp

    from tests.synth.shapes import SHAPES, build_shape, fill_weights, quant_types

    types = {k: v for k, v in quant_types(shape, ftype).items()
             if not k.startswith("blk.") or int(k.split(".")[1]) <= n_layer}
    path = build_shape(shape, n_layer=n_layer + 1, tensor_types=types)
    fill_weights(path)
    ids: dict[int, list[list[int]]] = {}

    def on_tensor(t: int, ask: bool, _: int) -> bool:  # llama.cpp's cb_eval: ask, then the computed tensor
        tt = _Tensor.from_address(t)
        name = tt.name.decode(errors="replace")
        if not name.startswith("ffn_moe_topk-"):
            return not ask
        if not ask:
            rows = ids.setdefault(int(name.split("-")[1]), [])
            for j in range(tt.ne[1]):
                rows.append(list((ctypes.c_int32 * tt.ne[0]).from_address(tt.data + j * tt.nb[1])))
        return True

    cb = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(on_tensor)
    try:
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.use_extra_bufts = False  # this CPU's AMX buffer types can SIGILL (DEVELOPERS.md)
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 4096, N_TOKENS, N_TOKENS
        cp.cb_eval = cb
        ctx = llama_cpp.llama_init_from_model(model, cp)
        vocab = llama_cpp.llama_model_get_vocab(model)
        rng = random.Random(0)
        toks = [llama_cpp.llama_vocab_bos(vocab)] + [rng.randrange(llama_cpp.llama_vocab_n_tokens(vocab))
                                                    for _ in range(N_TOKENS - 1)]
        arr = (llama_cpp.llama_token * N_TOKENS)(*toks)
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, N_TOKENS))
    finally:
        os.unlink(path)
    p = SHAPES[shape][1]
    return {"shape": shape, "ftype": ftype, "n_layer_built": n_layer, "n_expert": p["n_expert"],
            "n_expert_used": p["n_expert_used"], "decode_rc": rc,
            "used": {str(il): {str(u): len({e for row in rows[:u] for e in row}) for u in PREFIXES}
                     for il, rows in sorted(ids.items()) if il < n_layer}}


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return 0
    import llama_cpp

    from fitter.llama_builds import PINNED_COMMIT

    only = set(sys.argv[1:])
    kept = json.loads(OUT.read_text())["rows"] if only and OUT.exists() else []
    rows = [r for r in kept if r["shape"] not in only]
    for shape, ftype, n_layer in RUNS:
        if only and shape not in only:
            continue
        r = subprocess.run([sys.executable, __file__, "--child", shape, ftype, str(n_layer)], capture_output=True,
                           text=True, timeout=3600)
        if r.returncode != 0:
            print(f"{shape} {ftype}: exit {r.returncode}: {r.stderr[-500:]}", file=sys.stderr)
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"{shape} {ftype}: {len(rows[-1]['used'])} MoE layers", flush=True)
    OUT.write_text(json.dumps({
        "note": __doc__.split("\n\n")[0] + " " + " ".join(__doc__.split("\n\n")[1].split()),
        "llama_cpp": {"commit": PINNED_COMMIT, "llama_cpp_python": llama_cpp.__version__, "backend": "CPU"},
        "command": "PYTHONPATH=. python3 benchmarks/synthetic_routing.py", "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
