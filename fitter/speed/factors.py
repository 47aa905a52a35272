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
            "bw.float": 1.17525,
            "bw.k": 0.963397,
            "bw.q4": 0.848676,
            "bw.q8": 1.12319,
            "cpu": 0.0859617,
            "dq.k": 9.09748,
            "kv.dev": 1.60622,
            "kv.host": 4.90211,
            "layer": 8.1731e-05,
            "split": 7.21447e-05
        },
        "prefill": {
            "attn": 1.0881,
            "attn.cpu": 0.00488496,
            "c.float": 0.209422,
            "c.k": 0.987487,
            "c.q4": 0.434654,
            "c.q8": 1.45665,
            "copy": 6.99323,
            "kq": 5.89511,
            "layer_token": 1.77093e-06,
            "read": 2.86902,
            "rec": 0.193827
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
            "attn": 5.21731,
            "attn.nofa": 6.74675,
            "c.m1": 4.94697,
            "c.m2": 3.83759,
            "c.m3": 3.90552,
            "c.m4": 3.23927,
            "c.m5": 2.95334,
            "kq": 3.09849,
            "layer": 7.52256e-05,
            "read": 0.124916,
            "ubatch": 0.00120516
        }
    }
}

SPREAD: dict[str, float] = {"decode": 0.106, "prefill": 0.1737}

# per hardware profile: measured / predicted seconds (decode, prefill) over its training rows
PROFILE_SCALE: dict[str, dict[str, float]] = {
    "apple-m1-7": {
        "decode": 0.8347,
        "prefill": 0.9793
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
        "prefill": 0.9141
    },
    "apple-m2-10": {
        "decode": 1.16,
        "prefill": 1.003
    },
    "apple-m2-max-30": {
        "decode": 1.059,
        "prefill": 1.013
    },
    "apple-m2-max-38": {
        "decode": 1.172,
        "prefill": 1.083
    },
    "apple-m2-pro-16": {
        "prefill": 1.012
    },
    "apple-m2-pro-19": {
        "decode": 1.247,
        "prefill": 1.068
    },
    "apple-m2-ultra-60": {
        "decode": 1.08,
        "prefill": 1.13
    },
    "apple-m2-ultra-76": {
        "decode": 1.063,
        "prefill": 1.027
    },
    "apple-m3-10": {
        "decode": 1.369,
        "prefill": 1.007
    },
    "apple-m3-max-30": {
        "prefill": 0.9617
    },
    "apple-m3-max-40": {
        "decode": 0.9643,
        "prefill": 0.9974
    },
    "apple-m3-pro-18": {
        "decode": 1.23,
        "prefill": 0.9426
    },
    "apple-m3-ultra-60": {
        "decode": 1.077,
        "prefill": 1.043
    },
    "apple-m3-ultra-80": {
        "prefill": 1.01
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
        "prefill": 0.9928
    },
    "apple-m4-pro-16": {
        "decode": 0.8557,
        "prefill": 0.9972
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
        "decode": 1.316,
        "prefill": 1.2
    },
    "nvidia-dgx-spark": {
        "decode": 0.9658,
        "prefill": 1.129
    },
    "nvidia-h100-pcie": {
        "decode": 1.33,
        "prefill": 1.125
    },
    "nvidia-h200": {
        "decode": 1.03,
        "prefill": 1.09
    },
    "nvidia-l40s": {
        "decode": 1.052,
        "prefill": 1.248
    },
    "nvidia-rtx-3070": {
        "decode": 0.8794,
        "prefill": 0.9299
    },
    "nvidia-rtx-3080": {
        "decode": 0.8944,
        "prefill": 0.8657
    },
    "nvidia-rtx-3090": {
        "decode": 0.9333,
        "prefill": 1.212
    },
    "nvidia-rtx-3090-ti": {
        "prefill": 0.968
    },
    "nvidia-rtx-4070-ti": {
        "decode": 0.9089,
        "prefill": 0.885
    },
    "nvidia-rtx-4080": {
        "decode": 0.8675,
        "prefill": 0.7691
    },
    "nvidia-rtx-4090": {
        "decode": 0.889,
        "prefill": 0.8027
    },
    "nvidia-rtx-5060-ti": {
        "decode": 0.8758,
        "prefill": 1.075
    },
    "nvidia-rtx-5070": {
        "decode": 0.8341,
        "prefill": 1.002
    },
    "nvidia-rtx-5070-ti": {
        "prefill": 0.9341
    },
    "nvidia-rtx-5080": {
        "decode": 0.7771,
        "prefill": 0.8773
    },
    "nvidia-rtx-5090": {
        "decode": 0.6891
    },
    "nvidia-rtx-6000-ada": {
        "decode": 0.9754,
        "prefill": 1.007
    },
    "nvidia-rtx-a6000": {
        "decode": 0.9395,
        "prefill": 1.082
    },
    "nvidia-rtx-pro-6000-blackwell": {
        "prefill": 0.6428
    }
}
