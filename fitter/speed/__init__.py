"""How fast llama.cpp runs a config: llama-bench's prefill (pp<N> at -ub) and decode (tg) rates at a context depth,
from the GGUF header, the placement and a hardware profile (issue 46).

    predict (fitter.speed.predict) predict_speed: the rates of a config, from the parts below
    work (fitter.speed.work)   bytes and FLOPs per token on each device, from the memory model's placement
    model (fitter.speed.model) seconds per token and per ubatch: each term (bandwidth, compute, PCIe, host memory,
                               fixed costs) times a coefficient fitted per backend (fitter.speed.factors)
    hardware                   the profiles (`ggfit hardware`), this machine (`--hardware auto`), host bandwidth
    cpu_rate                   this CPU's matrix rates in llama.cpp's kernels, by type class, measured once and cached
    network                    what llama.cpp's RPC backend sends per ubatch between hosts, and its seconds (issue 47)
    bench_file                 llama-bench's outputs (md, csv, json, jsonl, sql) and ggfit probes, for calibration
    calibration                a machine's measured/predicted ratios, stored with the llama.cpp build

The package imports nothing: `fit` reads a hardware profile without loading the model of rates it may not need.
"""
