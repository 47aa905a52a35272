"""An engine comparison: one Optuna study whose first parameter is `engine` (llama.cpp or MLX), over the
same model in both formats (a GGUF and an MLX directory) and the same workload.

Each engine brings its own conditional parameters (TPE samples them with group=True):
- llama: `n_ubatch` (llama-server -ub);
- mlx: `prefill_step_size` (mlx_lm.server --prefill-step-size) and `kv_bits` (none, 8, 4: --kv-bits with
  --quantized-kv-start 0).
Every trial is first sized by its engine's memory model (fitter.predict / fitter.predict_mlx) at the
workload's context; one over the budget minus the margin is pruned with a violated constraint, as
`ggfit optimise` does, and never started. The others run as a real server (llama-server or
mlx_lm.server, started and stopped by ggfit on 127.0.0.1) measured by the same openai runner, so the
two engines are timed the same way. The report names the best config of each engine, the winner,
the ratio of their decode rates, and the memory each used (predicted and the server's peak RSS).
"""

from __future__ import annotations

import os
from typing import Any

import optuna
from pydantic import BaseModel

from fitter import (
    Backend,
    MlxCacheSettings,
    MlxRun,
    RunConfig,
    load_mlx_model,
    load_model_spec,
    predict,
    predict_mlx,
)
from search.runner_mlx import MlxFlags, mlx_probe, served_probe
from search.runner_openai import OpenAIProbe
from search.server import find_llama_server, server_command

LLAMA_UBATCH = (64, 128, 256, 512)
MLX_STEP = (64, 256, 2048)
MLX_KV_BITS = ("none", "8", "4")


class EngineTrial(BaseModel):
    number: int
    engine: str
    params: dict[str, Any]
    status: str  # ok, skipped (over budget), or the probe's status
    predicted_bytes: int
    decode_tps: float | None = None
    prefill_tps: float | None = None
    peak_rss_bytes: int | None = None
    command: list[str] = []


class EngineReport(BaseModel):
    trials: list[EngineTrial]
    best: dict[str, EngineTrial]  # engine -> its best ok trial
    winner: str | None
    ratio: float | None  # winner's decode tok/s over the other engine's best

    def text(self) -> str:
        lines = [f"{'#':>3} {'engine':<6} {'params':<40} {'status':<8} {'predicted MiB':>13} {'decode tok/s':>12} "
                 f"{'peak RSS MiB':>12}"]
        for t in self.trials:
            p = ", ".join(f"{k}={v}" for k, v in t.params.items() if k != "engine")
            lines.append(f"{t.number:>3} {t.engine:<6} {p:<40} {t.status:<8} {t.predicted_bytes / 2**20:>13.1f} "
                         f"{(t.decode_tps or 0):>12.1f} {(t.peak_rss_bytes or 0) / 2**20:>12.1f}")
        for eng, t in self.best.items():
            lines.append(f"best {eng}: {t.params} decode {t.decode_tps:.1f} tok/s, predicted {t.predicted_bytes / 2**20:.1f} MiB, "
                         f"peak RSS {(t.peak_rss_bytes or 0) / 2**20:.1f} MiB")
        if self.winner and self.ratio:
            lines.append(f"winner: {self.winner}, {self.ratio:.2f}x the other engine's best decode rate")
        elif self.winner:
            lines.append(f"winner: {self.winner} (the other engine had no config that fits and runs)")
        else:
            lines.append("no engine had a config that fits and runs")
        return "\n".join(lines)


def compare_engines(gguf: str, mlx_dir: str, *, available_bytes: int, n_trials: int = 8, prompt_tokens: int = 64,
                    gen_tokens: int = 16, seed: int = 0, timeout: float = 300.0,
                    llama_server: str | None = None, threads: int | None = None) -> EngineReport:
    header, spec = load_model_spec(gguf)
    mlx_model = load_mlx_model(mlx_dir)
    binary = find_llama_server(llama_server)
    threads = threads or os.cpu_count() or 1
    n_ctx = -(-(prompt_tokens * 2 + gen_tokens) // 256) * 256  # chars are cut at ~4 per token: room for either tokenizer
    trials: list[EngineTrial] = []

    def probe_for(url: str, pid: int) -> OpenAIProbe:
        return OpenAIProbe(url, pid=pid, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens)

    def objective(trial: optuna.Trial) -> float:
        engine = trial.suggest_categorical("engine", ["llama", "mlx"])
        cmd: list[str] = []
        if engine == "llama":
            ub = trial.suggest_categorical("n_ubatch", LLAMA_UBATCH)
            cfg = RunConfig(n_ctx=n_ctx, n_batch=max(512, ub), n_ubatch=ub, n_parallel=1)
            predicted = predict(header, spec, cfg, backend=Backend.CPU).total_device_bytes
        else:
            step = trial.suggest_categorical("prefill_step_size", MLX_STEP)
            kvb = trial.suggest_categorical("kv_bits", MLX_KV_BITS)
            bits = None if kvb == "none" else int(kvb)
            settings = MlxCacheSettings(prefill_step_size=step, kv_bits=bits, quantized_kv_start=0)
            predicted = predict_mlx(mlx_model, MlxRun(n_ctx=n_ctx, max_tokens=gen_tokens, cache=settings)).total_device_bytes
        over = predicted - available_bytes
        trial.set_constraint("predicted_over_budget_mib", over / 2**20)
        rec = EngineTrial(number=trial.number, engine=engine, params=dict(trial.params), status="skipped",
                          predicted_bytes=predicted)
        trials.append(rec)
        if over > 0:
            trial.set_constraint("probe_failed", 0.0)
            raise optuna.TrialPruned(f"predicted {predicted} bytes, {over} over the budget")
        if engine == "llama":
            res, cmd = served_probe(lambda port: server_command(binary, gguf, cfg, port=port, threads=threads,
                                                                use_extra_bufts=False), probe_for, timeout, "llama-server")
        else:
            res, cmd = mlx_probe(mlx_dir, MlxFlags(prefill_step_size=step, kv_bits=bits, quantized_kv_start=0,
                                                   max_tokens=gen_tokens), probe_for, timeout=timeout)
        rec.status, rec.command = res.status, cmd
        rec.peak_rss_bytes = res.memory.peak
        if res.levels:
            rec.decode_tps, rec.prefill_tps = res.levels[0].decode_tps, res.levels[0].prefill_tps
        trial.set_constraint("probe_failed", 0.0 if res.ok and rec.decode_tps else 1.0)
        if not (res.ok and rec.decode_tps):
            raise optuna.TrialPruned(res.message or "no decode rate")
        return float(rec.decode_tps)

    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, n_trials // 2))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    # each engine's defaults first, so that both are measured at least once
    study.enqueue_trial({"engine": "llama", "n_ubatch": 512})
    study.enqueue_trial({"engine": "mlx", "prefill_step_size": 2048, "kv_bits": "none"})
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=n_trials)
    best: dict[str, EngineTrial] = {}
    for t in trials:
        if t.decode_tps and (t.engine not in best or t.decode_tps > (best[t.engine].decode_tps or 0)):
            best[t.engine] = t
    winner = max(best, key=lambda e: best[e].decode_tps or 0) if best else None
    ratio = None
    if winner and len(best) == 2:
        other = next(e for e in best if e != winner)
        ratio = (best[winner].decode_tps or 0) / (best[other].decode_tps or 1)
    return EngineReport(trials=trials, best=best, winner=winner, ratio=ratio)
