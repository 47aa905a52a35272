"""The MLX prefill peak: ggfit's prediction against mx.get_peak_memory() (mlx CPU backend), on the tiny
random-weight models of tests/mlxlm, at several --prefill-step-size values. Prints one line per case.

    python3 benchmarks/mlx_prefill_peak.py [--prompt 1100] [--steps 256,512,1024] [--bits 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fitter.mlx.activations import prefill_peak  # noqa: E402
from fitter.mlx.cache import CacheSettings  # noqa: E402
from fitter.mlx.config import load_mlx_model  # noqa: E402
from fitter.mlx.weights import weight_bytes  # noqa: E402
from tests.mlxlm.synth import CONFIGS, build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1100)
    ap.add_argument("--steps", default="256,512,1024")
    ap.add_argument("--bits", type=int, default=4)
    a = ap.parse_args()
    for name in CONFIGS:
        d = build(name, a.bits)
        m = load_mlx_model(str(d))
        for step in map(int, a.steps.split(",")):
            out = subprocess.run([sys.executable, "-m", "tests.mlxlm._peak_child", str(d), str(a.prompt), str(step)],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            real = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
            pk = prefill_peak(m.spec, CacheSettings(prefill_step_size=step), a.prompt)
            pred = weight_bytes(m.spec, m.tensors).resident + pk.cache_bytes + pk.bytes
            print(f"{name:<10} {a.bits}-bit prompt {a.prompt} step {step:>5}: predicted {pred / 2**20:8.2f} MiB, "
                  f"mx.get_peak_memory() {real / 2**20:8.2f} MiB, {100 * (pred - real) / real:+.1f}%", flush=True)


if __name__ == "__main__":
    main()
