"""The speed model as the study's prior (issue 46): the predicted-fastest configs of the space are enqueued first, and
a config predicted far below the best predicted is pruned before any probe.

    prior = SpeedPrior(predictor, hw, d, avail=..., cut=0.5)
    prior.rank(space)            -> [(score, params)], fastest first, over the space's grid (configs that fit only)
    prior.predict(cand)          -> {"prefill_tps": ..., "decode_tps": ...} (the user attrs' predicted_* values)
    prior.below_cut(cand)        -> None, or the reason to prune it

The score follows the study's objectives: prefill_tps (and ttft_s) by the predicted prefill rate at the workload's
prompt length, decode_tps by the predicted decode rate after the prompt (llama-bench's tg at depth = prompt), several
speed objectives by a request's predicted rate (1 / (prompt / prefill + gen / decode)). Acceptance and served share
are not the speed model's: a study with one of them as its only objective gets no prior.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from fitter.llama.cparams import ConfigError
from fitter.speed.hardware import HardwareProfile
from fitter.speed.predict import predict_speed
from search.space import Candidate, SearchSpace
from search.study.define import StudyDef

SPEED_METRICS = ("prefill_tps", "decode_tps", "ttft_s")
GRID_CAP = 4096  # grid points ranked at most (a larger space: its first GRID_CAP points in grid order)
DEFAULT_FIRST = 3  # predicted-fastest configs enqueued before the sampler's own proposals


@dataclass
class SpeedPrior:
    """The speed model's view of a study's candidates on one hardware profile."""

    predictor: Any  # search.study.objective.Predictor
    hw: HardwareProfile
    d: StudyDef
    avail: int
    cut: float = 0.5
    best: float | None = None  # the best predicted score over the space (set by rank)
    _memo: dict[str, dict[str, float] | None] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """A speed objective to rank by."""
        return any(m in SPEED_METRICS for m in self.d.objectives)

    @property
    def cuts(self) -> bool:
        """The cut applies when every objective is a speed: a slower config may serve more requests (served_share)
        or draft better (acceptance), which the speed model does not weigh."""
        return self.cut > 0 and all(m in SPEED_METRICS for m in self.d.objectives)

    def predict(self, cand: Candidate) -> dict[str, float] | None:
        """Predicted llama-bench rates of the candidate at the workload's prompt (None: the model cannot say)."""
        key = cand.key()
        if key not in self._memo:
            self._memo[key] = self._predict(cand)
        return self._memo[key]

    def _predict(self, cand: Candidate) -> dict[str, float] | None:
        header, spec = self.predictor.spec(cand.model_path)
        w = self.d.workload
        try:
            sp = predict_speed(header, spec, cand.config, self.predictor.backend, self.hw, prompt=w.prompt_tokens,
                               depth=0, threads=cand.threads or 8)
            dec = predict_speed(header, spec, cand.config, self.predictor.backend, self.hw, prompt=w.prompt_tokens,
                                depth=w.prompt_tokens, threads=cand.threads or 8).decode_tps
        except (ConfigError, ValueError, ZeroDivisionError):
            return None
        if sp.prefill_tps <= 0 or dec <= 0:
            return None
        return {"prefill_tps": sp.prefill_tps, "decode_tps": dec}

    def score(self, rates: dict[str, float]) -> float:
        """Higher is faster, for the study's objectives."""
        speed = [m for m in self.d.objectives if m in SPEED_METRICS]
        pre = {"prefill_tps", "ttft_s"}
        if set(speed) <= pre:
            return rates["prefill_tps"]
        if speed == ["decode_tps"]:
            return rates["decode_tps"]
        w = self.d.workload
        return 1.0 / (w.prompt_tokens / rates["prefill_tps"] + max(w.gen_tokens, 1) / rates["decode_tps"])

    def rank(self, space: SearchSpace) -> list[tuple[float, dict[str, Any]]]:
        """The grid's configs predicted to fit, fastest first (ties keep grid order); sets `best`."""
        out: list[tuple[float, dict[str, Any]]] = []
        for params in itertools.islice(space.grid(), GRID_CAP):
            cand = space.candidate(params)
            try:
                if self.predictor.device_bytes(self.predictor.predict(cand)) > self.avail:
                    continue
            except ConfigError:
                continue
            rates = self.predict(cand)
            if rates is not None:
                out.append((self.score(rates), params))
        out.sort(key=lambda x: -x[0])
        self.best = out[0][0] if out else None
        return out

    def first(self, space: SearchSpace, n: int = DEFAULT_FIRST) -> list[dict[str, Any]]:
        """The `n` predicted-fastest configs, one per distinct predicted score (configs the model cannot tell apart,
        e.g. threads on a GPU, count once)."""
        seen: set[float] = set()
        out: list[dict[str, Any]] = []
        for s, params in self.rank(space):
            r = round(s, 6)
            if r in seen:
                continue
            seen.add(r)
            out.append(params)
            if len(out) >= n:
                break
        return out

    def below_cut(self, cand: Candidate) -> str | None:
        """The reason to prune `cand` unprobed (predicted below cut x the best predicted), or None."""
        if not self.cuts or not self.best:
            return None
        rates = self.predict(cand)
        if rates is None:
            return None
        share = self.score(rates) / self.best
        if share >= self.cut:
            return None
        return f"predicted at {share:.0%} of the best predicted; below the --speed-cut {self.cut:g}"


def study_hardware() -> HardwareProfile | None:
    """This machine's profile for `optimise`'s prior (`--hardware auto`: the probes run here); None if unreadable."""
    from fitter.speed.hardware import HardwareError, resolve

    try:
        return resolve("auto")
    except (HardwareError, OSError):
        return None
