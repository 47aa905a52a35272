"""The speed model's coefficients per backend (fitter.speed.model), fitted by `python benchmarks/speed_model.py
--fit` on 424 training rows of the truth set (our H200 llama-bench runs, llama.cpp 0c1e570, and the
published tables of benchmarks/results/speed-published.json). Generated: edit the fit, not this file.
SPREAD: the 80th percentile of the training rows' relative error, the range `fit` shows."""

COEFFICIENTS: dict[str, dict[str, dict[str, float]]] = {
    "cpu": {
        "decode": {
            "bw.float": 1.4544,
            "bw.k": 1.34031,
            "bw.q8": 1.25208,
            "kv.dev": 4.61456,
            "layer": 5.58246e-05,
            "token": 0.000650567
        },
        "prefill": {
            "attn.cpu": 0.364943,
            "cpu": 0.0183401,
            "layer": 4.98595e-05,
            "rec.cpu": 0.307528,
            "ubatch": 0.000997637
        }
    },
    "cuda": {
        "decode": {
            "bw.float": 1.17503,
            "bw.k": 0.957963,
            "bw.q4": 0.406005,
            "bw.q8": 1.10823,
            "cpu": 0.0859544,
            "dq.k": 9.30618,
            "dq.q4": 13.9669,
            "dq.q8": 0.246848,
            "kv.dev": 1.56636,
            "kv.host": 4.90061,
            "layer": 8.1976e-05,
            "split": 7.17506e-05
        },
        "prefill": {
            "attn": 0.375337,
            "attn.cpu": 0.00484642,
            "attn.nofa": 4.74222,
            "c.float": 0.170098,
            "c.k": 0.977846,
            "c.q4": 0.323026,
            "c.q8": 0.676067,
            "copy": 6.99529,
            "layer": 0.000164532,
            "layer_token": 1.57593e-06,
            "read": 3.20313
        }
    },
    "metal": {
        "decode": {
            "bw.float": 1.09958,
            "bw.q4": 0.0121608,
            "bw.q8": 0.0174306,
            "dq.float": 3.33889,
            "dq.k": 39.4372,
            "dq.q4": 19.9799,
            "dq.q8": 39.2786,
            "host": 1.50167,
            "kv.dev": 2.60231,
            "layer": 0.000150009,
            "token": 0.000987846
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

SPREAD: dict[str, float] = {"decode": 0.1043, "prefill": 0.1755}

# per hardware profile: measured / predicted seconds (decode, prefill) over its training rows
PROFILE_SCALE: dict[str, dict[str, float]] = {
    "apple-m1-7": {
        "decode": 0.8347,
        "prefill": 0.9802
    },
    "apple-m1-8": {
        "decode": 1.706,
        "prefill": 1.02
    },
    "apple-m1-max-32": {
        "decode": 1.133,
        "prefill": 1.237
    },
    "apple-m1-pro-16": {
        "decode": 1.139,
        "prefill": 0.8933
    },
    "apple-m1-ultra-64": {
        "decode": 1.177,
        "prefill": 0.9137
    },
    "apple-m2-10": {
        "decode": 1.16,
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
        "decode": 1.247,
        "prefill": 1.069
    },
    "apple-m2-ultra-60": {
        "decode": 1.08,
        "prefill": 1.13
    },
    "apple-m2-ultra-76": {
        "decode": 1.063,
        "prefill": 1.025
    },
    "apple-m3-10": {
        "decode": 1.369,
        "prefill": 1.004
    },
    "apple-m3-max-30": {
        "prefill": 0.9738
    },
    "apple-m3-max-40": {
        "decode": 0.9643,
        "prefill": 0.9979
    },
    "apple-m3-pro-18": {
        "decode": 1.23,
        "prefill": 0.9369
    },
    "apple-m3-ultra-60": {
        "decode": 1.077,
        "prefill": 1.039
    },
    "apple-m3-ultra-80": {
        "prefill": 1.007
    },
    "apple-m4-10": {
        "decode": 1.234,
        "prefill": 1.012
    },
    "apple-m4-max-32": {
        "decode": 0.8803
    },
    "apple-m4-max-40": {
        "decode": 0.9388,
        "prefill": 0.9921
    },
    "apple-m4-pro-16": {
        "decode": 0.8557,
        "prefill": 0.9979
    },
    "apple-m4-pro-20": {
        "decode": 0.9739,
        "prefill": 1.006
    },
    "apple-m5-10": {
        "decode": 1.018,
        "prefill": 1.002
    },
    "apple-m5-max-40": {
        "decode": 0.7832,
        "prefill": 0.9991
    },
    "apple-m5-pro-16": {
        "decode": 0.7195
    },
    "cpu": {
        "decode": 0.9999,
        "prefill": 0.9961
    },
    "nvidia-a100-80gb": {
        "decode": 1.313,
        "prefill": 1.218
    },
    "nvidia-dgx-spark": {
        "decode": 1.025,
        "prefill": 1.014
    },
    "nvidia-h100-pcie": {
        "decode": 1.33,
        "prefill": 1.309
    },
    "nvidia-h200": {
        "decode": 1.029,
        "prefill": 1.075
    },
    "nvidia-l40s": {
        "decode": 1.054,
        "prefill": 1.269
    },
    "nvidia-rtx-3070": {
        "decode": 0.8786,
        "prefill": 0.8963
    },
    "nvidia-rtx-3080": {
        "decode": 0.8933,
        "prefill": 0.8135
    },
    "nvidia-rtx-3090": {
        "decode": 0.9835,
        "prefill": 1.16
    },
    "nvidia-rtx-3090-ti": {
        "prefill": 1.032
    },
    "nvidia-rtx-4070-ti": {
        "decode": 0.9105,
        "prefill": 0.9136
    },
    "nvidia-rtx-4080": {
        "decode": 0.8978,
        "prefill": 0.7831
    },
    "nvidia-rtx-4090": {
        "decode": 0.9683,
        "prefill": 0.844
    },
    "nvidia-rtx-5060-ti": {
        "decode": 1.061,
        "prefill": 1.181
    },
    "nvidia-rtx-5070": {
        "decode": 0.9767,
        "prefill": 1.084
    },
    "nvidia-rtx-5070-ti": {
        "prefill": 0.9946
    },
    "nvidia-rtx-5080": {
        "decode": 0.9223,
        "prefill": 0.9251
    },
    "nvidia-rtx-5090": {
        "decode": 0.7816
    },
    "nvidia-rtx-6000-ada": {
        "decode": 0.9817,
        "prefill": 1.2
    },
    "nvidia-rtx-a6000": {
        "decode": 0.9463,
        "prefill": 1.102
    },
    "nvidia-rtx-pro-6000-blackwell": {
        "prefill": 0.659
    }
}
