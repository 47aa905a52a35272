"""An engine comparison: one Optuna study whose first parameter is `engine` (llama.cpp or MLX), over the
same model in both formats (a GGUF and an MLX directory) and the same workload.

Each engine brings its own conditional parameters (TPE samples them with group=True):
- llama: `n_ubatch` (llama-server -ub);
- mlx: `prefill_step_size` (mlx_lm.server --prefill-step-size) and `kv_bits` (none, 8, 4: --kv-bits with
  --quantized-kv-start 0).
Every trial is first sized by its engine's memory model (fitter.fit.memory.predict /
fitter.mlx.memory.predict_mlx) at the workload's context; one over the budget minus the margin is pruned with a
violated constraint, as `ggfit optimise` does, and never started. The others run as a real server (llama-server or
mlx_lm.server, started and stopped by ggfit on 127.0.0.1) measured by the same openai runner, so the
two engines are timed the same way. The report names the best config of each engine, the winner,
the ratio of their decode rates, and the memory each used (predicted and the server's peak RSS).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

import optuna
from pydantic import BaseModel

from fitter.fit.plan import predict_plan
from fitter.fit.request import Budgets, FitRequest
from fitter.ggml.backends.base import Backend
from fitter.llama.cparams import Frontend, RunConfig
from fitter.llama.model import load_model_spec
from fitter.llama_builds import PINNED
from fitter.mlx.cache import MlxCacheSettings
from fitter.mlx.config import load_mlx_model
from fitter.mlx.memory import MlxRun, predict_mlx
from fitter.speed.hardware import HardwareProfile
from search.runner_mlx import MlxFlags, mlx_probe, served_probe
from search.runner_openai import OpenAIProbe
from search.server import find_llama_server, server_command
from search.space import StudyError
from search.study.engine_speed import EnginePrediction, predict_engines
from search.study.objective import quiet_trial_failures
from search.study.prior import study_hardware

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
    reason: str | None = None  # why it is not ok: over the budget, or the probe's message

    def flags(self) -> str:
        """The engine's own flags for the searched parameters: ``-ub 512``, ``--prefill-step-size 256 --kv-bits 8``."""
        p = self.params
        if self.engine == "llama":
            return f"-ub {p.get('n_ubatch')}"
        bits = p.get("kv_bits", "none")
        return f"--prefill-step-size {p.get('prefill_step_size')}" + ("" if bits == "none" else f" --kv-bits {bits}")

    def outcome(self) -> str:
        """One line: what the trial measured, or why it has no measurement."""
        if self.status != "ok":
            return f"{self.status}: {self.reason}" if self.reason else self.status
        rss = f", peak RSS {_mib(self.peak_rss_bytes)} MiB" if self.peak_rss_bytes else ""
        return f"ok: decode {_rate(self.decode_tps)} tok/s, prefill {_rate(self.prefill_tps)} tok/s{rss}"


ENGINE_NAMES = {"llama": "llama.cpp", "mlx": "MLX"}


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


class EngineReport(BaseModel):
    trials: list[EngineTrial]
    best: dict[str, EngineTrial]  # engine -> its best ok trial
    winner: str | None
    ratio: float | None  # winner's decode tok/s over the other engine's best
    predicted: EnginePrediction | None = None  # both engines' decode from the bandwidth model, before any probe

    def text(self) -> str:
        rows = [["#", "engine", "flags", "status", "predicted MiB", "decode tok/s", "prefill tok/s", "peak RSS MiB"]]
        for t in self.trials:
            rows.append([str(t.number), ENGINE_NAMES.get(t.engine, t.engine), t.flags(), t.status,
                         _mib(t.predicted_bytes), _rate(t.decode_tps), _rate(t.prefill_tps), _mib(t.peak_rss_bytes)])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        right = {0, 4, 5, 6, 7}
        lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                 for r in rows]
        lines.append("")
        for eng, t in self.best.items():
            lines.append(f"best {ENGINE_NAMES.get(eng, eng)}: trial {t.number}, {t.flags()}: decode {_rate(t.decode_tps)} "
                         f"tok/s, predicted {_mib(t.predicted_bytes)} MiB, peak RSS {_mib(t.peak_rss_bytes)} MiB")
        name = ENGINE_NAMES.get(self.winner or "", self.winner)
        if self.winner and self.ratio:
            lines.append(f"winner: {name}, {self.ratio:.2f}x the other engine's best decode rate")
        elif self.winner:
            lines.append(f"winner: {name} (the other engine had no config that fits and runs)")
        else:
            lines.append("no engine had a config that fits and runs")
        if self.predicted is not None:
            m = self.best.get("mlx"), self.best.get("llama")
            measured = (f"; measured {(m[0].decode_tps or 0) / (m[1].decode_tps or 1):.2f}x"
                        if m[0] and m[1] else "")
            lines.append(self.predicted.line() + measured)
        return "\n".join(lines)


def same_model(gguf: str, spec: Any, mlx_dir: str, mlx: Any) -> None:
    """Refuse (one line) a GGUF and an MLX directory that are not the same model: the architecture (GGUF's
    general.architecture against config.json's model_type, spelled alike: qwen3moe = qwen3_moe, mistral = llama),
    n_layer, n_embd, the attention heads and the vocabulary size must agree."""
    attn = next((la for la in spec.layers if la.n_head), spec.layers[0])
    pairs = [("architecture", _arch(spec.architecture), _arch(mlx.model_type), spec.architecture, mlx.model_type),
             ("n_layer", spec.n_layer, mlx.n_layers, None, None), ("n_embd", spec.n_embd, mlx.hidden_size, None, None),
             ("n_head", attn.n_head, mlx.n_heads, None, None), ("n_head_kv", attn.n_head_kv, mlx.n_kv_heads, None, None),
             ("n_vocab", spec.n_vocab, mlx.vocab_size, None, None)]
    diff = [f"{name} {a if ga is None else ga} vs {b if gb is None else gb}" for name, a, b, ga, gb in pairs if a != b]
    if diff:
        raise StudyError(f"{Path(gguf).name} and {mlx_dir} are not the same model ({', '.join(diff)}): compare-engines "
                         "needs one model in both formats")


def _arch(name: str) -> str:
    n = name.lower().replace("_", "").replace("-", "").removesuffix("text")
    return {"mistral": "llama"}.get(n, n)


def _say_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Objective:
    """One engine trial: sized by its engine's memory model, then (when it fits) served and measured."""

    def __init__(self, gguf: str, mlx_dir: str, *, available_bytes: int, n_trials: int, prompt_tokens: int,
                 gen_tokens: int, timeout: float, llama_server: str | None, threads: int | None,
                 say: Callable[[str], None]):
        self.header, self.spec = load_model_spec(gguf)
        self.mlx_model = load_mlx_model(mlx_dir)
        same_model(gguf, self.spec, mlx_dir, self.mlx_model.spec)
        self.binary = find_llama_server(llama_server)
        self.gguf, self.mlx_dir, self.avail, self.n_trials = gguf, mlx_dir, available_bytes, n_trials
        self.prompt_tokens, self.gen_tokens, self.timeout = prompt_tokens, gen_tokens, timeout
        self.threads = threads or os.cpu_count() or 1
        self.n_ctx = -(-(prompt_tokens * 2 + gen_tokens) // 256) * 256  # chars cut at ~4 a token: room for either tokenizer
        self.say = say
        self.trials: list[EngineTrial] = []

    def _probe_for(self, url: str, pid: int) -> OpenAIProbe:
        return OpenAIProbe(url, pid=pid, prompt_tokens=self.prompt_tokens, gen_tokens=self.gen_tokens)

    def __call__(self, trial: optuna.Trial) -> float:
        engine = trial.suggest_categorical("engine", ["llama", "mlx"])
        if engine == "llama":
            ub = trial.suggest_categorical("n_ubatch", LLAMA_UBATCH)
            cfg = RunConfig(n_ctx=self.n_ctx, n_batch=max(512, ub), n_ubatch=ub, n_parallel=1)
            req = FitRequest.trial(self.gguf, cfg, Backend.CPU, Frontend.SERVER, PINNED, Budgets.held(self.avail))
            predicted = predict_plan(req, model=(self.header, self.spec)).pred.total_device_bytes
        else:
            step = trial.suggest_categorical("prefill_step_size", MLX_STEP)
            kvb = trial.suggest_categorical("kv_bits", MLX_KV_BITS)
            flags = MlxFlags(prefill_step_size=step, kv_bits=None if kvb == "none" else int(kvb), quantized_kv_start=0,
                             max_tokens=self.gen_tokens)
            settings = MlxCacheSettings(prefill_step_size=step, kv_bits=flags.kv_bits, quantized_kv_start=0)
            run = MlxRun(n_ctx=self.n_ctx, max_tokens=self.gen_tokens, cache=settings)
            predicted = predict_mlx(self.mlx_model, run).total_device_bytes
        over = predicted - self.avail
        trial.set_constraint("predicted_over_budget_mib", over / 2**20)
        rec = EngineTrial(number=trial.number, engine=engine, params=dict(trial.params), status="skipped",
                          predicted_bytes=predicted)
        self.trials.append(rec)
        head = f"[ggfit] trial {trial.number + 1} of {self.n_trials}: {ENGINE_NAMES[engine]} {rec.flags()}"
        if over > 0:
            rec.reason = (f"predicted {_mib(predicted)} MiB > {_mib(self.avail)} MiB available (budget - margin): "
                          "not started")
            self.say(f"{head}: {rec.outcome()}")
            trial.set_constraint("probe_failed", 0.0)
            raise optuna.TrialPruned(rec.reason)
        self.say(f"{head}: starting {'llama-server' if engine == 'llama' else 'mlx_lm.server'} "
                 f"(predicted {_mib(predicted)} MiB)")
        if engine == "llama":
            res, rec.command = served_probe(lambda port: server_command(
                self.binary, self.gguf, cfg, port=port, threads=self.threads, use_extra_bufts=False),
                self._probe_for, self.timeout, "llama-server")
        else:
            res, rec.command = mlx_probe(self.mlx_dir, flags, self._probe_for, timeout=self.timeout)
        rec.status, rec.peak_rss_bytes, rec.reason = res.status, res.memory.peak, res.message
        if res.levels:
            rec.decode_tps, rec.prefill_tps = res.levels[0].decode_tps, res.levels[0].prefill_tps
        ok = res.ok and bool(rec.decode_tps)
        if res.ok and not ok:
            rec.status, rec.reason = "error", "the server gave no decode rate"
        self.say(f"{head}: {rec.outcome()}")
        trial.set_constraint("probe_failed", 0.0 if ok else 1.0)
        if not ok:
            raise optuna.TrialPruned(rec.reason or rec.status)
        return float(rec.decode_tps or 0.0)


def compare_engines(gguf: str, mlx_dir: str, *, available_bytes: int, n_trials: int = 8, prompt_tokens: int = 64,
                    gen_tokens: int = 16, seed: int = 0, timeout: float = 300.0,
                    llama_server: str | None = None, threads: int | None = None,
                    progress: Callable[[str], None] | None = _say_stderr,
                    hardware: HardwareProfile | None = None) -> EngineReport:
    """The engine study. Refuses (StudyError, one line) a GGUF and an MLX directory that are not the same model.
    `progress` gets one line as each trial starts a server and one as it ends (stderr by default; None: quiet).
    Before any probe, the decode ratio the bandwidth model predicts on `hardware` (default: this machine's profile)
    is said and kept in the report (search/study/engine_speed.py)."""
    objective = _Objective(gguf, mlx_dir, available_bytes=available_bytes, n_trials=n_trials,
                           prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, timeout=timeout,
                           llama_server=llama_server, threads=threads, say=progress or (lambda line: None))
    predicted = _predicted(objective, hardware)
    if predicted is not None:
        objective.say(f"[ggfit] {predicted.line()}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # before create_study: no "A new study created" line
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, n_trials // 2))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    # each engine's defaults first, so that both are measured at least once
    study.enqueue_trial({"engine": "llama", "n_ubatch": 512})
    study.enqueue_trial({"engine": "mlx", "prefill_step_size": 2048, "kv_bits": "none"})
    with quiet_trial_failures():  # Ctrl-C: one line from the CLI, not Optuna's warning with a traceback
        study.optimize(objective, n_trials=n_trials)
    trials = objective.trials
    best: dict[str, EngineTrial] = {}
    for t in trials:
        if t.decode_tps and (t.engine not in best or t.decode_tps > (best[t.engine].decode_tps or 0)):
            best[t.engine] = t
    winner = max(best, key=lambda e: best[e].decode_tps or 0) if best else None
    ratio = None
    if winner and len(best) == 2:
        other = next(e for e in best if e != winner)
        ratio = (best[winner].decode_tps or 0) / (best[other].decode_tps or 1)
    return EngineReport(trials=trials, best=best, winner=winner, ratio=ratio, predicted=predicted)


def _predicted(o: _Objective, hardware: HardwareProfile | None) -> EnginePrediction | None:
    hw = hardware or study_hardware()
    if hw is None:
        return None
    try:
        return predict_engines(o.header, o.spec, o.mlx_model, hw, n_ctx=o.n_ctx, threads=o.threads)
    except (ValueError, ZeroDivisionError, KeyError):  # a model the speed model cannot size: no prediction
        return None
