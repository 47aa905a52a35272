"""The speed model's coefficients per backend (fitter.speed.model), fitted by `python benchmarks/speed_model.py
--fit` on 418 training rows of the truth set (our H200 llama-bench runs, llama.cpp 0c1e570, and the
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
            "act": 3.12572,
            "attn": 1.27525,
            "attn.cpu": 0.00445122,
            "attn.nofa": 0.0,
            "c.float": 0.858751,
            "c.k": 1.02936,
            "c.q4": 0.490832,
            "c.q8": 1.14049,
            "copy": 7.02643,
            "kq": 6.0958,
            "layer": 0.000404154,
            "read": 1.22388,
            "rec": 1.28693,
            "split": 0.0,
            "ubatch": 0.00358507
        }
    },
    "metal": {
        "decode": {
            "bw.float": 1.09973,
            "bw.k": 0.0,
            "bw.q4": 0.0112111,
            "bw.q8": 0.0170394,
            "dq.float": 3.48348,
            "dq.k": 40.501,
            "dq.q4": 20.1495,
            "dq.q8": 39.4395,
            "host": 1.50171,
            "kv.dev": 2.72551,
            "layer": 0.000146092,
            "token": 0.00102626
        },
        "prefill": {
            "attn": 5.7323,
            "attn.nofa": 6.74469,
            "c.m1": 5.16152,
            "c.m2": 4.08899,
            "c.m3": 4.01967,
            "c.m4": 3.31,
            "c.m5": 3.01196,
            "kq": 4.01504,
            "layer": 7.77684e-05,
            "read": 0.0,
            "ubatch": 0.00128482
        }
    }
}

SPREAD: dict[str, float] = {"decode": 0.1086, "prefill": 0.1315}

# per hardware profile: measured / predicted seconds (decode, prefill) over its training rows
PROFILE_SCALE: dict[str, dict[str, float]] = {
    "apple-m1-8": {
        "decode": 1.698,
        "prefill": 0.9987
    },
    "apple-m1-max-32": {
        "decode": 1.125,
        "prefill": 1.231
    },
    "apple-m1-pro-16": {
        "decode": 1.138,
        "prefill": 0.8742
    },
    "apple-m1-ultra-64": {
        "decode": 1.182,
        "prefill": 0.8949
    },
    "apple-m2-10": {
        "decode": 1.158,
        "prefill": 0.9637
    },
    "apple-m2-max-30": {
        "decode": 1.06,
        "prefill": 0.9719
    },
    "apple-m2-max-38": {
        "decode": 1.174,
        "prefill": 1.038
    },
    "apple-m2-pro-16": {
        "prefill": 0.9714
    },
    "apple-m2-pro-19": {
        "decode": 1.245,
        "prefill": 1.023
    },
    "apple-m2-ultra-60": {
        "decode": 1.085,
        "prefill": 1.083
    },
    "apple-m2-ultra-76": {
        "decode": 1.059,
        "prefill": 1.049
    },
    "apple-m3-10": {
        "decode": 1.365,
        "prefill": 0.9994
    },
    "apple-m3-max-30": {
        "prefill": 0.9567
    },
    "apple-m3-max-40": {
        "decode": 0.9616,
        "prefill": 0.9997
    },
    "apple-m3-pro-18": {
        "decode": 1.228,
        "prefill": 0.9393
    },
    "apple-m3-ultra-60": {
        "decode": 1.081,
        "prefill": 1.035
    },
    "apple-m3-ultra-80": {
        "prefill": 1.002
    },
    "apple-m4-10": {
        "decode": 1.23,
        "prefill": 1.011
    },
    "apple-m4-max-32": {
        "decode": 0.881
    },
    "apple-m4-max-40": {
        "decode": 0.9395,
        "prefill": 0.9935
    },
    "apple-m4-pro-16": {
        "decode": 0.8539,
        "prefill": 0.9955
    },
    "apple-m4-pro-20": {
        "decode": 0.9733,
        "prefill": 1.006
    },
    "apple-m5-10": {
        "decode": 1.016,
        "prefill": 1.003
    },
    "apple-m5-max-40": {
        "decode": 0.7847,
        "prefill": 0.999
    },
    "apple-m5-pro-16": {
        "decode": 0.7181
    },
    "nvidia-a100-80gb": {
        "decode": 1.316,
        "prefill": 1.229
    },
    "nvidia-dgx-spark": {
        "decode": 1.035,
        "prefill": 1.146
    },
    "nvidia-h100-pcie": {
        "decode": 1.351,
        "prefill": 1.084
    },
    "nvidia-h200": {
        "decode": 1.03,
        "prefill": 1.056
    },
    "nvidia-l40s": {
        "decode": 1.052,
        "prefill": 1.258
    },
    "nvidia-rtx-3070": {
        "decode": 0.8794,
        "prefill": 0.9172
    },
    "nvidia-rtx-3080": {
        "decode": 0.8944,
        "prefill": 0.8794
    },
    "nvidia-rtx-3090": {
        "decode": 1.034,
        "prefill": 1.027
    },
    "nvidia-rtx-3090-ti": {
        "prefill": 0.9638
    },
    "nvidia-rtx-4070-ti": {
        "decode": 0.9089,
        "prefill": 0.8666
    },
    "nvidia-rtx-4080": {
        "decode": 0.9078,
        "prefill": 0.7662
    },
    "nvidia-rtx-4090": {
        "decode": 0.9249,
        "prefill": 0.8569
    },
    "nvidia-rtx-5060-ti": {
        "decode": 1.108,
        "prefill": 0.9617
    },
    "nvidia-rtx-5070": {
        "decode": 1.047,
        "prefill": 0.9427
    },
    "nvidia-rtx-5070-ti": {
        "prefill": 0.9188
    },
    "nvidia-rtx-5080": {
        "decode": 0.9123,
        "prefill": 0.8775
    },
    "nvidia-rtx-5090": {
        "decode": 0.7764
    },
    "nvidia-rtx-6000-ada": {
        "decode": 0.9754,
        "prefill": 1.059
    },
    "nvidia-rtx-a6000": {
        "decode": 0.9616,
        "prefill": 1.041
    },
    "nvidia-rtx-pro-6000-blackwell": {
        "prefill": 0.718
    }
}
