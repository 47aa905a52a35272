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
         ("qwen3vl", {"ftype": "q8_0", "n_embd": 128, "n_ff": 256, "n_pos_side": 92, "deepstack": []})]
full = [(k, {**o, "sparse": True}) for k, o in FULL_SHAPES.values()]
cases = [(k, o, fa, True) for k, o in small + full for fa in ("auto", "off")]
cases += [("gemma3", {}, "auto", False), (full[0][0], full[0][1], "auto", False)]
rows, logs = [], []
for kind, over, fa, gpu in cases:
    path = str(build_mmproj(kind, **over))
    t = time.time()
    p = subprocess.run([exe, path, {"auto": "-1", "off": "0", "on": "1"}[fa], "1" if gpu else "0"],
                       capture_output=True, text=True, timeout=240)
    log = p.stderr
    row = {"kind": kind, "overrides": over, "flash_attn": fa, "use_gpu": gpu, "rc": p.returncode,
           "seconds": round(time.time() - t, 2),
           "allocs": [[m[1], int(m[2])] for m in re.finditer(r"ggfit-alloc: (\S+) (\d+)", log)],
           "compute_lines": [[m[1], float(m[2])] for m in re.finditer(r"(\S+) compute buffer size = +([\d.]+) MiB", log)],
           "splits": [[int(m[1]), int(m[2])] for m in re.finditer(r"graph splits = (\d+), nodes = (\d+)", log)],
           "fa_enabled": "flash attention is enabled" in log,
           "backend": (re.search(r"CLIP using (\S+) backend", log) or [None, None])[1],
           "warnings": [ln for ln in log.splitlines() if "WARN" in ln or "not supported" in ln or "unsupported" in ln.lower()][:40]}
    rows.append(row)
    print(kind, over, fa, gpu, row["rc"], row["allocs"], row["fa_enabled"], row["seconds"], flush=True)
    logs.append(f"===== {kind} {over} fa={fa} gpu={gpu}\n" + "\n".join(
        ln for ln in log.splitlines() if "tensor[" not in ln))
json.dump({"device": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip(),
           "llama_cpp": "0c1e57098bba", "rows": rows}, open(out, "w"), indent=1)
open(os.path.join(os.path.dirname(out), "mmproj-logs.txt"), "w").write("\n".join(logs))
