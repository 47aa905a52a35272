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
            "cpu": 0.0,
            "kv.dev": 4.61456,
            "layer": 5.58246e-05,
            "token": 0.000650567
        },
        "prefill": {
            "act": 6.81637,
            "attn.cpu": 0.223566,
            "cpu": 0.0205924,
            "layer": 5.01868e-05,
            "rec.cpu": 0.98549,
            "ubatch": 0.00100082
        }
    },
    "cuda": {
        "decode": {
            "bw.float": 1.17525,
            "bw.k": 0.963397,
            "bw.q4": 0.848676,
            "bw.q8": 1.12319,
            "cpu": 0.0859617,
            "dq.float": 0.0,
            "dq.k": 9.09748,
            "dq.q4": 0.0,
            "dq.q8": 0.0,
            "host": 0.0,
            "kv.dev": 1.60622,
            "kv.host": 4.90211,
            "layer": 8.1731e-05,
            "split": 7.21447e-05,
            "token": 0.0
        },
        "prefill": {
            "act": 3.00448,
            "attn": 1.24183,
            "attn.cpu": 0.00445525,
            "attn.nofa": 0.0,
            "c.float": 0.817988,
            "c.k": 1.0187,
            "c.q4": 0.482319,
            "c.q8": 1.12499,
            "copy": 7.0257,
            "kq": 5.8785,
            "layer": 0.000402752,
            "read": 1.5406,
            "rec": 1.22357,
            "split": 0.0,
            "ubatch": 0.00376672
        }
    },
    "metal": {
        "decode": {
            "bw.float": 1.09958,
            "bw.k": 0.0,
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
            "attn": 5.71968,
            "attn.nofa": 6.79453,
            "c.m1": 5.14291,
            "c.m2": 4.09524,
            "c.m3": 4.0315,
            "c.m4": 3.31256,
            "c.m5": 3.01401,
            "kq": 3.48407,
            "layer": 7.90032e-05,
            "read": 0.0,
            "ubatch": 0.00129897
        }
    }
}

SPREAD: dict[str, float] = {"decode": 0.1061, "prefill": 0.1339}

# per hardware profile: measured / predicted seconds (decode, prefill) over its training rows
PROFILE_SCALE: dict[str, dict[str, float]] = {
    "apple-m1-7": {
        "decode": 0.8445,
        "prefill": 1.013
    },
    "apple-m1-8": {
        "decode": 1.707,
        "prefill": 1.003
    },
    "apple-m1-max-32": {
        "decode": 1.142,
        "prefill": 1.238
    },
    "apple-m1-pro-16": {
        "decode": 1.139,
        "prefill": 0.8777
    },
    "apple-m1-ultra-64": {
        "decode": 1.177,
        "prefill": 0.8984
    },
    "apple-m2-10": {
        "decode": 1.16,
        "prefill": 0.9632
    },
    "apple-m2-max-30": {
        "decode": 1.059,
        "prefill": 0.9711
    },
    "apple-m2-max-38": {
        "decode": 1.172,
        "prefill": 1.037
    },
    "apple-m2-pro-16": {
        "prefill": 0.9707
    },
    "apple-m2-pro-19": {
        "decode": 1.248,
        "prefill": 1.023
    },
    "apple-m2-ultra-60": {
        "decode": 1.08,
        "prefill": 1.082
    },
    "apple-m2-ultra-76": {
        "decode": 1.065,
        "prefill": 1.049
    },
    "apple-m3-10": {
        "decode": 1.37,
        "prefill": 0.9974
    },
    "apple-m3-max-30": {
        "prefill": 0.9587
    },
    "apple-m3-max-40": {
        "decode": 0.9643,
        "prefill": 1.003
    },
    "apple-m3-pro-18": {
        "decode": 1.23,
        "prefill": 0.9376
    },
    "apple-m3-ultra-60": {
        "decode": 1.077,
        "prefill": 1.032
    },
    "apple-m3-ultra-80": {
        "prefill": 0.9998
    },
    "apple-m4-10": {
        "decode": 1.234,
        "prefill": 1.012
    },
    "apple-m4-max-32": {
        "decode": 0.8811
    },
    "apple-m4-max-40": {
        "decode": 0.9388,
        "prefill": 0.9934
    },
    "apple-m4-pro-16": {
        "decode": 0.8558,
        "prefill": 0.9953
    },
    "apple-m4-pro-20": {
        "decode": 0.9739,
        "prefill": 1.005
    },
    "apple-m5-10": {
        "decode": 1.018,
        "prefill": 1.003
    },
    "apple-m5-max-40": {
        "decode": 0.7833,
        "prefill": 0.999
    },
    "apple-m5-pro-16": {
        "decode": 0.7196
    },
    "cpu": {
        "decode": 0.9999,
        "prefill": 1.019
    },
    "nvidia-a100-80gb": {
        "decode": 1.316,
        "prefill": 1.214
    },
    "nvidia-dgx-spark": {
        "decode": 1.035,
        "prefill": 1.164
    },
    "nvidia-h100-pcie": {
        "decode": 1.351,
        "prefill": 1.05
    },
    "nvidia-h200": {
        "decode": 1.03,
        "prefill": 1.051
    },
    "nvidia-l40s": {
        "decode": 1.052,
        "prefill": 1.254
    },
    "nvidia-rtx-3070": {
        "decode": 0.8794,
        "prefill": 0.9233
    },
    "nvidia-rtx-3080": {
        "decode": 0.8944,
        "prefill": 0.885
    },
    "nvidia-rtx-3090": {
        "decode": 1.034,
        "prefill": 1.025
    },
    "nvidia-rtx-3090-ti": {
        "prefill": 0.9652
    },
    "nvidia-rtx-4070-ti": {
        "decode": 0.9089,
        "prefill": 0.8676
    },
    "nvidia-rtx-4080": {
        "decode": 0.9078,
        "prefill": 0.7645
    },
    "nvidia-rtx-4090": {
        "decode": 0.9249,
        "prefill": 0.8499
    },
    "nvidia-rtx-5060-ti": {
        "decode": 1.108,
        "prefill": 0.9624
    },
    "nvidia-rtx-5070": {
        "decode": 1.047,
        "prefill": 0.9436
    },
    "nvidia-rtx-5070-ti": {
        "prefill": 0.9188
    },
    "nvidia-rtx-5080": {
        "decode": 0.9123,
        "prefill": 0.8762
    },
    "nvidia-rtx-5090": {
        "decode": 0.7764
    },
    "nvidia-rtx-6000-ada": {
        "decode": 0.9754,
        "prefill": 1.05
    },
    "nvidia-rtx-a6000": {
        "decode": 0.9616,
        "prefill": 1.027
    },
    "nvidia-rtx-pro-6000-blackwell": {
        "prefill": 0.7169
    }
}
