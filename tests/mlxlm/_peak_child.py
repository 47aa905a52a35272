"""Child process: load an MLX model, prefill a prompt with generate_step, print mx.get_peak_memory().

A fresh process per measurement: no other test's arrays are alive in the peak."""

from __future__ import annotations

import json
import sys


def main() -> None:
    path, n, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(path)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    prompt = mx.array([(i * 7) % 1000 + 3 for i in range(n)])
    for _ in generate_step(prompt, model, max_tokens=1, prefill_step_size=step):
        pass
    mx.synchronize()
    print(json.dumps({"peak": mx.get_peak_memory(), "active": mx.get_active_memory()}))


if __name__ == "__main__":
    main()
