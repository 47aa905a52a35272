"""The study file (studies/*.toml): objectives, workload, search space, trial budget; and the prompt lengths."""

from __future__ import annotations

import bisect
import math
import os
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fitter.llama.cparams import ConfigError, RunConfig
from search.space import Candidate, SpaceDef, StudyError
from search.workload import Workload

# The named studies: the checkout's studies/ (editable installs), else where a wheel puts them (data-files)
STUDIES_DIR = Path(__file__).resolve().parents[2] / "studies"
if not STUDIES_DIR.is_dir():
    STUDIES_DIR = Path(sys.prefix) / "share" / "ggfit" / "studies"

Metric = Literal["prefill_tps", "decode_tps", "ttft_s", "acceptance", "served_share"]
DIRECTIONS: dict[str, str] = {"prefill_tps": "maximize", "decode_tps": "maximize", "ttft_s": "minimize",
                              "acceptance": "maximize", "served_share": "maximize"}
SPEED_CUT = 0.5  # the study file's default speed_cut (--speed-cut)
UNITS = {"prefill_tps": "tok/s", "decode_tps": "tok/s", "ttft_s": "s", "acceptance": "", "served_share": ""}



# --- the study file ------------------------------------------------------------------------------------------


class SamplerDef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["tpe", "random"] = "tpe"
    n_startup_trials: int = Field(10, ge=0, description="random trials (probed or not) before TPE models the space")
    seed: int | None = None


class PromptLengths(BaseModel):
    """Lengths of the user's prompts, in tokens: quantiles (``p50 = 1800``...) and/or a file of one length a line."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantiles: dict[str, int] = Field(default_factory=dict)
    file: str | None = None

    @field_validator("quantiles")
    @classmethod
    def _q(cls, v: dict[str, int]) -> dict[str, int]:
        for k, n in v.items():
            m = re.fullmatch(r"p(\d+(?:\.\d+)?)", k)
            if not m or not 0 < float(m.group(1)) <= 100:
                raise ValueError(f"quantile key {k!r}: write p50, p90, p99, p99.9 or p100")
            if n < 1:
                raise ValueError(f"{k} = {n}: a length in tokens must be positive")
        shares = sorted((float(k[1:]), n) for k, n in v.items())
        if any(b[1] < a[1] for a, b in zip(shares, shares[1:])):
            raise ValueError("quantile lengths must grow with the quantile")
        return v

    @model_validator(mode="after")
    def _some(self) -> PromptLengths:
        if not self.quantiles and not self.file:
            raise ValueError("give quantiles (p50 = ..., p99 = ...) or a file of lengths")
        return self


class PickDef(BaseModel):
    """How the one recommended config is chosen: among trials meeting every ``require`` minimum (else the ones
    coming closest to the first requirement), the best single objective, or for several objectives the Pareto trial
    with the highest weighted sum of objectives normalised by their best values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    require: dict[Metric, float] = Field(default_factory=dict)
    weights: dict[Metric, float] = Field(default_factory=dict)


class StudyDef(BaseModel):
    """A study file (studies/*.toml): objectives, workload, search space, trial budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    objectives: list[Metric] = Field(min_length=1, max_length=3)
    trials: int = Field(ge=1, description="probes (real measurements) the study may spend")
    max_trials: int | None = Field(None, ge=1, description="all trials, skipped ones included (default 10 x trials)")
    workload: Workload = Field(default_factory=Workload)
    space: SpaceDef = Field(default_factory=SpaceDef)
    fixed: dict[str, Any] = Field(default_factory=dict, description="RunConfig fields every trial shares")
    prompt_lengths: PromptLengths | None = None
    pick: PickDef = Field(default_factory=PickDef)
    sampler: SamplerDef = Field(default_factory=SamplerDef)
    speed_cut: float = Field(SPEED_CUT, ge=0, lt=1, description="prune configs the speed model predicts below this "
                             "share of the best predicted (0: probe them all); needs a hardware profile")

    @field_validator("objectives")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("objectives must be distinct")
        return v

    @field_validator("fixed")
    @classmethod
    def _fixed(cls, v: dict[str, Any]) -> dict[str, Any]:
        searched = {"n_ctx", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn", "spec_type", "draft_model",
                    "draft_type_k", "draft_type_v", "draft_n_max"}
        for k in v:
            if k not in RunConfig.model_fields:
                raise ValueError(f"unknown RunConfig field {k!r} (known: {', '.join(RunConfig.model_fields)})")
            if k in searched:
                raise ValueError(f"{k!r} belongs in [space] (one value = fixed), not [fixed]")
        try:
            RunConfig(**v)
        except ConfigError as e:  # one line naming the flag: `fixed: -ngl x: use a valid integer`
            raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _consistent(self) -> StudyDef:
        if "served_share" in self.objectives or "served_share" in self.pick.require:
            if self.prompt_lengths is None:
                raise ValueError("served_share needs [prompt_lengths]")
        for m in list(self.pick.require) + list(self.pick.weights):
            if m not in self.objectives:
                raise ValueError(f"[pick] names {m!r}, which is not an objective")
        if "acceptance" in self.objectives and self.space.draft is None:
            raise ValueError("the acceptance objective needs [space.draft]")
        return self

    @property
    def directions(self) -> list[str]:
        return [DIRECTIONS[m] for m in self.objectives]

    @property
    def total_cap(self) -> int:
        return self.max_trials or 10 * self.trials


def _one_line(e: ValidationError) -> str:
    errs = e.errors()
    first = errs[0]
    loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{loc}: {msg}{more}"


def named_studies() -> list[str]:
    return sorted(p.stem for p in STUDIES_DIR.glob("*.toml"))


def load_study(which: str | os.PathLike[str] | StudyDef) -> StudyDef:
    """A named study (studies/<name>.toml) or a study file. Raises StudyError with one line on bad input."""
    if isinstance(which, StudyDef):
        return which
    text = str(which)
    path = Path(text).expanduser()
    if not (path.suffix == ".toml" or path.exists() or os.sep in text):
        path = STUDIES_DIR / f"{text}.toml"
        if not path.is_file():
            raise StudyError(f"no study named {text!r}; named studies: {', '.join(named_studies())} (or pass a .toml file)")
    if not path.is_file():
        raise StudyError(f"study file {text!r} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise StudyError(f"{path}: not a TOML file: {e}") from None
    try:
        d = StudyDef.model_validate(data)
    except ValidationError as e:
        raise StudyError(f"{path}: {_one_line(e)}") from None
    if d.prompt_lengths and d.prompt_lengths.file and not Path(d.prompt_lengths.file).is_absolute():
        pl = d.prompt_lengths.model_copy(update={"file": str((path.parent / d.prompt_lengths.file).resolve())})
        d = d.model_copy(update={"prompt_lengths": pl})
    return d


# --- prompt lengths: which share of requests a context serves -----------------------------------------------------


class LengthDistribution:
    """Share of requests whose prompt fits in L tokens, from quantiles (linear between them) or a file (empirical)."""

    def __init__(self, pl: PromptLengths):
        pts: list[tuple[int, float]] = [(n, float(k[1:]) / 100) for k, n in pl.quantiles.items()]
        self.samples: list[int] | None = None
        if pl.file:
            try:
                vals = [int(x) for x in Path(pl.file).read_text().split()]
            except (OSError, ValueError) as e:
                raise StudyError(f"prompt_lengths.file {pl.file}: {e}") from None
            if not vals or min(vals) < 0:
                raise StudyError(f"prompt_lengths.file {pl.file}: needs non-negative integers, one a line")
            self.samples = sorted(vals)
            if not pts:
                for q in (0.5, 0.9, 0.95, 0.99, 1.0):
                    pts.append((self.samples[min(len(vals) - 1, math.ceil(q * len(vals)) - 1)], q))
        self.points = sorted(set(pts))

    def share(self, tokens: int) -> float:
        """Share of prompts of at most `tokens` tokens."""
        if self.samples is not None:
            return bisect.bisect_right(self.samples, tokens) / len(self.samples)
        prev_n, prev_q = 0, 0.0
        for n, q in self.points:
            if tokens < n:
                return prev_q + (q - prev_q) * (tokens - prev_n) / (n - prev_n) if n > prev_n else prev_q
            prev_n, prev_q = n, q
        return prev_q  # beyond the largest known quantile: at least that share (exact when p100 is given)

    def lengths(self) -> list[tuple[float, int]]:
        return [(q, n) for n, q in self.points]


@dataclass(frozen=True)
class ServedShare:
    """The share of requests a candidate's context serves (its n_ctx less the generated tokens); None without
    [prompt_lengths]."""

    dist: LengthDistribution | None
    gen_tokens: int

    def __call__(self, cand: Candidate) -> float | None:
        if self.dist is None:
            return None
        assert cand.config.n_ctx is not None  # the space always sets the context
        return self.dist.share(int(cand.config.n_ctx) - self.gen_tokens)
