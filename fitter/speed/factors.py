"""The speed model's coefficients per backend (fitter.speed.model), fitted by `python benchmarks/speed_model.py
--fit` on 413 training rows of the truth set (our H200 llama-bench runs, llama.cpp 0c1e570, and the
published tables of benchmarks/results/speed-published.json). Generated: edit the fit, not this file.
SPREAD: the 80th percentile of the training rows' relative error, the range `fit` shows."""

COEFFICIENTS: dict[str, dict[str, dict[str, float]]] = {
    "cpu": {
        "decode": {
            "bw.float": 1.45401,
            "bw.k": 1.34849,
            "bw.q8": 1.25697,
            "kv.dev": 4.61865,
            "layer": 5.57358e-05,
            "token": 0.000649694
        },
        "prefill": {
            "attn.cpu": 0.342878,
            "cpu": 0.0190322,
            "layer": 5.06682e-05,
            "ubatch": 0.00101155
        }
    },
    "cuda": {
        "decode": {
            "bw.float": 1.1908,
            "bw.k": 1.23626,
            "bw.q4": 0.622928,
            "bw.q8": 1.0107,
            "cpu": 0.0847359,
            "dq.q4": 7.78371,
            "dq.q8": 5.78609,
            "kv.dev": 1.5278,
            "kv.host": 5.07813,
            "layer": 8.21845e-05,
            "split": 7.09815e-05,
            "token": 3.00065e-05
        },
        "prefill": {
            "attn": 0.514565,
            "attn.cpu": 0.010179,
            "attn.nofa": 1.44528,
            "c.k": 1.17687,
            "c.q4": 0.428988,
            "c.q8": 0.778306,
            "copy": 1.62814,
            "layer": 0.000753451,
            "read": 1.83904,
            "split": 0.000138512,
            "ubatch": 0.00121565
        }
    },
    "metal": {
        "decode": {
            "bw.float": 1.11584,
            "bw.q4": 0.0361124,
            "bw.q8": 0.0297771,
            "dq.float": 3.07036,
            "dq.k": 41.0351,
            "dq.q4": 19.8333,
            "dq.q8": 39.2128,
            "host": 1.5016,
            "kv.dev": 2.39731,
            "layer": 0.000150942,
            "token": 0.00100048
        },
        "prefill": {
            "attn": 5.20598,
            "attn.nofa": 8.78074,
            "c.m1": 4.9393,
            "c.m2": 3.83124,
            "c.m3": 3.91331,
            "c.m4": 3.22738,
            "c.m5": 2.94484,
            "layer": 7.47936e-05,
            "read": 0.234176,
            "ubatch": 0.00120147
        }
    }
}

SPREAD: dict[str, float] = {"decode": 0.115, "prefill": 0.2298}

# per hardware profile: measured / predicted seconds (decode, prefill) over its training rows
PROFILE_SCALE: dict[str, dict[str, float]] = {
    "apple-m1-7": {
        "decode": 0.9054,
        "prefill": 0.9802
    },
    "apple-m1-8": {
        "decode": 1.713,
        "prefill": 1.02
    },
    "apple-m1-max-32": {
        "decode": 1.125,
        "prefill": 1.237
    },
    "apple-m1-pro-16": {
        "decode": 1.14,
        "prefill": 0.8933
    },
    "apple-m1-ultra-64": {
        "decode": 1.175,
        "prefill": 0.9137
    },
    "apple-m2-10": {
        "decode": 1.158,
        "prefill": 1.001
    },
    "apple-m2-max-30": {
        "decode": 1.059,
        "prefill": 1.011
    },
    "apple-m2-max-38": {
        "decode": 1.172,
        "prefill": 1.084
    },
    "apple-m2-pro-16": {
        "prefill": 1.011
    },
    "apple-m2-pro-19": {
        "decode": 1.25,
        "prefill": 1.069
    },
    "apple-m2-ultra-60": {
        "decode": 1.079,
        "prefill": 1.13
    },
    "apple-m2-ultra-76": {
        "decode": 1.072,
        "prefill": 1.025
    },
    "apple-m3-10": {
        "decode": 1.372,
        "prefill": 1.004
    },
    "apple-m3-max-30": {
        "prefill": 0.9738
    },
    "apple-m3-max-40": {
        "decode": 0.9618,
        "prefill": 0.9979
    },
    "apple-m3-pro-18": {
        "decode": 1.228,
        "prefill": 0.9369
    },
    "apple-m3-ultra-60": {
        "decode": 1.075,
        "prefill": 1.039
    },
    "apple-m3-ultra-80": {
        "prefill": 1.007
    },
    "apple-m4-10": {
        "decode": 1.237,
        "prefill": 1.012
    },
    "apple-m4-max-32": {
        "decode": 0.8812
    },
    "apple-m4-max-40": {
        "decode": 0.9336,
        "prefill": 0.9921
    },
    "apple-m4-pro-16": {
        "decode": 0.8569,
        "prefill": 0.9979
    },
    "apple-m4-pro-20": {
        "decode": 0.9714,
        "prefill": 1.006
    },
    "apple-m5-10": {
        "decode": 1.019,
        "prefill": 1.002
    },
    "apple-m5-max-40": {
        "decode": 0.7827,
        "prefill": 0.9991
    },
    "apple-m5-pro-16": {
        "decode": 0.7206
    },
    "cpu": {
        "decode": 0.9999,
        "prefill": 1.018
    },
    "nvidia-a100-80gb": {
        "decode": 1.416,
        "prefill": 1.714
    },
    "nvidia-dgx-spark": {
        "decode": 1.027,
        "prefill": 0.9659
    },
    "nvidia-h100-pcie": {
        "decode": 1.382,
        "prefill": 1.327
    },
    "nvidia-h200": {
        "decode": 1.022,
        "prefill": 1.256
    },
    "nvidia-l40s": {
        "decode": 0.9864,
        "prefill": 1.849
    },
    "nvidia-rtx-3070": {
        "decode": 0.9421,
        "prefill": 0.9292
    },
    "nvidia-rtx-3080": {
        "decode": 0.9964,
        "prefill": 0.8277
    },
    "nvidia-rtx-3090": {
        "decode": 1.003,
        "prefill": 0.8327
    },
    "nvidia-rtx-3090-ti": {
        "prefill": 1.044
    },
    "nvidia-rtx-4070-ti": {
        "decode": 0.9098,
        "prefill": 0.8997
    },
    "nvidia-rtx-4080": {
        "decode": 0.8996,
        "prefill": 0.8644
    },
    "nvidia-rtx-4090": {
        "decode": 0.9317,
        "prefill": 0.8025
    },
    "nvidia-rtx-5060-ti": {
        "decode": 1.07,
        "prefill": 1.166
    },
    "nvidia-rtx-5070": {
        "decode": 0.9971,
        "prefill": 1.127
    },
    "nvidia-rtx-5070-ti": {
        "prefill": 1.048
    },
    "nvidia-rtx-5080": {
        "decode": 0.9073,
        "prefill": 0.9958
    },
    "nvidia-rtx-5090": {
        "decode": 0.7694
    },
    "nvidia-rtx-6000-ada": {
        "decode": 0.9272,
        "prefill": 1.239
    },
    "nvidia-rtx-a6000": {
        "decode": 0.9772,
        "prefill": 1.356
    },
    "nvidia-rtx-pro-6000-blackwell": {
        "prefill": 0.6384
    }
}
