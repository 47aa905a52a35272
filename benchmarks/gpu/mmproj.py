"""On the device: every mmproj case through the CUDA-built libmtmd oracle (tests/mtmd/mtmd_mem.c), rows to a JSON file.

Run by benchmarks/gpu/mmproj.sh; the rows are replayed by tests/mtmd/test_mmproj_gpu_recorded.py."""
import json
import os
import re
import subprocess
import sys
import time

os.environ["GGFIT_CACHE"] = "/tmp/mmcache"
from tests.synth.mmproj import FULL_SHAPES, build_mmproj  # noqa: E402

exe, out = sys.argv[1], sys.argv[2]
small = [("gemma3", {}), ("gemma3", {"image_size": 448, "ftype": "q8_0", "n_embd": 96, "n_ff": 256}),
         ("qwen25vl", {}), ("qwen25vl", {"v2": True}), ("qwen3vl", {}),
         ("qwen3vl", {"ftype": "q8_0", "n_embd": 128, "n_ff": 256, "n_pos_side": 92, "deepstack": []}),
         ("gemma4v", {}), ("gemma4v", {"std": False, "pos_size": 128, "ftype": "q8_0", "n_embd": 128, "n_ff": 256}),
         ("pixtral", {}), ("pixtral", {"merger": False, "ftype": "q8_0", "n_embd": 128, "n_ff": 256})]
full = [(k, {**o, "sparse": True}) for k, o in FULL_SHAPES.values()]
# (kind, overrides, -fa, use_gpu, the side of an image to encode after the warmup: 0 none)
cases = [(k, o, fa, True, 0) for k, o in small + full for fa in ("auto", "off")]
cases += [("gemma3", {}, "auto", False, 0), (full[0][0], full[0][1], "auto", False, 0)]
# the largest image each Qwen-VL / Gemma 4 projector takes (64 x 64 merged tokens; 33 x 33 pooled): clip_encode grows
# the compute buffers past the warmup's
cases += [("qwen25vl", {"n_layer": 2, "patch_size": 4}, "auto", True, 512),
          ("qwen3vl", {"patch_size": 4, "n_layer": 2, "deepstack": [1]}, "auto", True, 512),
          ("gemma4v", {"patch_size": 4, "pos_size": 128}, "auto", True, 396),
          (full[1][0], full[1][1], "auto", True, 1792), (full[2][0], full[2][1], "auto", True, 2048)]
rows, logs = [], []
for kind, over, fa, gpu, encode in cases:
    path = str(build_mmproj(kind, **over))
    t = time.time()
    try:
        p = subprocess.run([exe, path, {"auto": "-1", "off": "0", "on": "1"}[fa], "1" if gpu else "0", str(encode)],
                           capture_output=True, text=True, timeout=60)
        log, rc = p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = (e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""), -1
    load, _, enc = log.partition("ggfit-encode:")
    row = {"kind": kind, "overrides": over, "flash_attn": fa, "use_gpu": gpu, "encode": encode, "rc": rc,
           "seconds": round(time.time() - t, 2),
           "allocs": [[m[1], int(m[2])] for m in re.finditer(r"ggfit-alloc: (\S+) (\d+)", load)],
           "grown": [[m[1], int(m[2])] for m in re.finditer(r"ggfit-alloc: (\S+) (\d+)", enc)],
           "compute_lines": [[m[1], float(m[2])] for m in re.finditer(r"(\S+) compute buffer size = +([\d.]+) MiB", log)],
           "splits": [[int(m[1]), int(m[2])] for m in re.finditer(r"graph splits = (\d+), nodes = (\d+)", log)],
           "fa_enabled": "flash attention is enabled" in log,
           "backend": (re.search(r"CLIP using (\S+) backend", log) or [None, None])[1],
           "warnings": [ln for ln in log.splitlines() if "WARN" in ln or "not supported" in ln or "unsupported" in ln.lower()][:40]}
    rows.append(row)
    print(kind, over, fa, gpu, encode, row["rc"], row["allocs"], row["grown"], row["fa_enabled"], row["seconds"],
          flush=True)
    logs.append(f"===== {kind} {over} fa={fa} gpu={gpu} encode={encode}\n" + "\n".join(
        ln for ln in log.splitlines() if "tensor[" not in ln))
json.dump({"device": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip(),
           "llama_cpp": "0c1e57098bba", "rows": rows}, open(out, "w"), indent=1)
open(os.path.join(os.path.dirname(out), "mmproj-logs.txt"), "w").write("\n".join(logs))
