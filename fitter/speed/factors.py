"""The speed model's coefficients per backend (fitter.speed.model), fitted by `python benchmarks/speed_model.py
--fit` on 413 training rows of the truth set (our H200 llama-bench runs, llama.cpp 0c1e570, and the
published tables of benchmarks/results/speed-published.json). Generated: edit the fit, not this file.
SPREAD: the 80th percentile of the training rows' relative error, the range `fit` shows."""

COEFFICIENTS: dict[str, dict[str, dict[str, float]]] = {
    "cpu": {
        "decode": {
            "bw.q8": 0.536711,
            "cpu": 0.0586252,
            "layer": 0.000352029
        },
        "prefill": {
            "attn.cpu": 0.339408,
            "cpu": 0.0184611,
            "layer": 0.00290435
        }
    },
    "cuda": {
        "decode": {
            "bw.float": 1.18997,
            "bw.k": 1.23388,
            "bw.q4": 0.604385,
            "bw.q8": 0.803796,
            "cpu": 0.0820435,
            "dq.q4": 8.33731,
            "dq.q8": 17.0324,
            "kv.dev": 1.51088,
            "kv.host": 6.81965,
            "layer": 8.34429e-05,
            "split": 7.47792e-05
        },
        "prefill": {
            "attn": 0.456806,
            "attn.cpu": 0.0082637,
            "c.k": 1.13623,
            "c.q4": 0.361635,
            "c.q8": 0.708399,
            "copy": 0.547357,
            "layer": 0.00096526,
            "read": 3.37144,
            "split": 0.0747861
        }
    },
    "metal": {
        "decode": {
            "bw.float": 1.10065,
            "bw.q4": 0.0349477,
            "bw.q8": 0.0257276,
            "dq.float": 0.413952,
            "dq.k": 40.8454,
            "dq.q4": 19.7347,
            "dq.q8": 38.2191,
            "host": 16066.1,
            "kv.dev": 2.32672,
            "layer": 0.000164639
        },
        "prefill": {
            "attn": 5.43216,
            "c.m1": 4.97824,
            "c.m2": 3.74617,
            "c.m3": 3.882,
            "c.m4": 3.18835,
            "c.m5": 2.87275,
            "layer": 0.000869286,
            "read": 0.219796
        }
    }
}

SPREAD: dict[str, float] = {"decode": 0.1925, "prefill": 0.3098}
