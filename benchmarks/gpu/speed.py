"""llama-bench's prefill and decode rates on the device, the truth set of the speed model (issue 46).

    python benchmarks/gpu/speed.py LLAMA_BENCH OUT GROUP...

Each group is a list of (shape, ftype, llama-bench flags); each case runs the pinned llama-bench as llama.cpp's own
tables do: pp512 and tg128 (`-p 512 -n 128`), at depth 0 and 4096 (`-d`), `-r 3` repetitions after its warm-up run,
flash attention on, `--repack 0` (the host's AMX CPU), on the full-size synthetic shapes filled with random valid
blocks (tests/synth/shapes.py fill_weights; their MoE routers send a prompt to few experts, not to all as a trained
router does: benchmarks/synthetic_routing.py), quantized as fitter.fit.quants predicts llama-quantize would. Each file is deleted after its cases (the disk holds ~60 GB).
Rows: llama-bench's own JSON records (build_commit, gpu_info, model_size, n_ubatch, n_gpu_layers, n_cpu_moe, n_prompt,
n_gen, n_depth, avg_ts, stddev_ts, samples_ts, ...) plus the shape and ftype.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.synth.shapes import build_shape, fill_weights, quant_types  # noqa: E402

RUN = ["-r", "3", "-fa", "1", "--repack", "0", "-o", "json"]
COMMON = ["-p", "512", "-n", "128", "-d", "0,4096", *RUN]
# a case whose flags start with "-p" replaces COMMON's -p/-n/-d (llama-bench appends repeated values)
LONG = ["-p", "4096", "-n", "128", "-d", "0"]
SHORT = ["-p", "512", "-n", "128", "-d", "0"]
GROUPS: dict[str, list[tuple[str, str, list[str]]]] = {
    "dense": [
        ("llama-8b", "Q4_K_M", ["-ngl", "99", "-ub", "512,2048"]),
        ("llama-8b", "Q4_K_M", ["-ngl", "16", "-ub", "512"]),
        ("llama-8b", "Q8_0", ["-ngl", "99", "-ub", "512"]),
        ("qwen35-0.8b", "Q4_K_M", ["-ngl", "99", "-ub", "512"]),
    ],
    "moe": [
        ("qwen36-35b-a3b", "Q4_K_M", ["-ngl", "99", "-ub", "512,2048", "-ncmoe", "0,20"]),
        ("gpt-oss-20b", "Q4_K_M", ["-ngl", "99", "-ub", "512", "-ncmoe", "0,12"]),
    ],
    # more quants and partial -ngl of the dense shape
    "dense2": [
        ("llama-8b", "Q4_0", ["-ngl", "99", "-ub", "512"]),
        ("llama-8b", "Q6_K", ["-ngl", "99", "-ub", "512"]),
        ("llama-8b", "F16", ["-ngl", "99", "-ub", "512"]),
        ("llama-8b", "Q4_K_M", ["-ngl", "8,24,30", "-ub", "512"]),
    ],
    # SWA, MLA and a second MoE family, all on the GPU and with experts on the CPU
    "arch": [
        ("gemma3-27b", "Q4_K_M", ["-ngl", "99", "-ub", "512"]),
        ("deepseek2-30b-a3b", "Q4_K_M", ["-ngl", "99", "-ub", "512", "-ncmoe", "0,16"]),
        ("qwen3-30b-a3b", "Q4_K_M", ["-ngl", "99", "-ub", "512", "-ncmoe", "0,24"]),
    ],
    # the 22,000 MiB budget at -c 131072 (issue 46): every --n-cpu-moe / -ub that fits it by ggfit's prediction, and
    # three quants at theirs; a 4,096-token prompt, so that -ub matters
    "budget": [
        ("qwen36-35b-a3b", "Q4_K_M", ["-ngl", "99", "-ub", "512,1024,2048", "-ncmoe", "5,6,7,8", *LONG]),
        ("qwen36-35b-a3b", "Q3_K_M", ["-ngl", "99", "-ub", "512,2048", "-ncmoe", "0,2", *LONG]),
        ("qwen36-35b-a3b", "Q5_K_M", ["-ngl", "99", "-ub", "512,2048", "-ncmoe", "11,12", *LONG]),
    ],
    # gpt-oss 20B (its router spreads a prompt over the experts, as a real model's does) on a 10,000 MiB budget at
    # -c 131072: the --n-cpu-moe / -ub that fit by ggfit's prediction around its placement (13), pp4096 and tg128
    "budget2": [
        ("gpt-oss-20b", "Q4_K_M", ["-ngl", "99", "-ub", "512,1024,2048", "-ncmoe", str(k), *LONG, "-r", "2"])
        for k in (13, 14, 15)
    ],
    # a GPU the fit never saw (an H100 SXM: the truth set's NVIDIA rows are an H200's and published tables, none of
    # an H100 SXM), all on the GPU: the generic model held out whole (benchmarks/speed_model.py HELD_OUT_GPUS)
    "h100": [
        ("qwen35-0.8b", "Q4_K_M", ["-ngl", "99", "-ub", "512"]),
        ("llama-8b", "Q4_K_M", ["-ngl", "99", "-ub", "512"]),
        ("llama-8b", "Q8_0", ["-ngl", "99", "-ub", "512"]),
        ("qwen3-30b-a3b", "Q4_K_M", ["-ngl", "99", "-ub", "512"]),
    ],
    # the CPU alone (-dev none: no op offload to the GPU), 16 threads
    "cpu": [
        ("qwen35-0.8b", "Q4_K_M", ["-dev", "none", "-t", "16", *SHORT]),
        ("llama-8b", "Q4_K_M", ["-dev", "none", "-t", "16", *SHORT]),
        ("llama-8b", "Q8_0", ["-dev", "none", "-t", "16", *SHORT]),
        ("qwen3-30b-a3b", "Q4_K_M", ["-dev", "none", "-t", "16", *SHORT]),
    ],
}


def types_for(shape: str, ftype: str) -> dict[str, str]:
    """Per-tensor types of the shape quantized to `ftype` (tests.synth.shapes.quant_types)."""
    return quant_types(shape, ftype)


def main() -> int:
    bench, out = sys.argv[1], Path(sys.argv[2])
    for group in sys.argv[3:] or list(GROUPS):
        rows: list[dict] = []
        path_out = out / f"speed-{group}.json"
        cases = GROUPS[group]
        for i, (shape, ftype, flags) in enumerate(cases):
            path = build_shape(shape, tensor_types=types_for(shape, ftype))
            if i == 0 or cases[i - 1][:2] != (shape, ftype):
                t = time.time()
                fill_weights(path)
                print(f"{shape} {ftype}: filled {path.stat().st_size / 2**30:.2f} GiB in {time.time() - t:.0f} s",
                      flush=True)
            t = time.time()
            common = RUN if "-p" in flags else COMMON
            p = subprocess.run([bench, "-m", str(path), *common, *flags], capture_output=True, text=True, timeout=900)
            try:
                recs = json.loads(p.stdout)
            except json.JSONDecodeError:
                recs = []
                print(p.stdout[-2000:], p.stderr[-3000:], flush=True)
            for r in recs:
                r.update(shape=shape, ftype=ftype, flags=flags)
                print(f"  {shape} {ftype} ngl={r.get('n_gpu_layers')} ncmoe={r.get('n_cpu_moe')} ub={r.get('n_ubatch')} "
                      f"pp{r.get('n_prompt')} tg{r.get('n_gen')} d{r.get('n_depth')}: {r.get('avg_ts'):.1f} "
                      f"+- {r.get('stddev_ts'):.1f} tok/s", flush=True)
            rows += recs
            print(f"  rc={p.returncode} {time.time() - t:.0f} s", flush=True)
            path_out.write_text(json.dumps({"group": group, "common": COMMON, "rows": rows}, indent=1))
            if i + 1 == len(cases) or cases[i + 1][:2] != (shape, ftype):
                path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
