"""The search space of a study: which llama-server settings Optuna may propose, and the config each proposal means.

A study file's ``[space]`` table (`SpaceDef`) names the settings and their bounds; `SearchSpace` binds it to the
model files, draft files, runner and workload of one run and turns an Optuna trial into a `Candidate`: a `RunConfig`
plus the probe options that are not RunConfig fields (threads, draft p_min), ready for `fitter.fit.memory.predict` and
`search.probe.run_probe`.

Parameters (Optuna names; each one is only suggested when the study gives it more than one value):

- ``n_ctx``: choices or a range; every value is rounded up to a multiple of 256 (llama.cpp pads to 256 anyway) and
  never below what the workload needs (prompt + generated tokens). Omitted: the workload's need, or with a
  prompt-length distribution the contexts that serve its quantiles.
- ``n_ubatch``; ``n_batch_factor``: n_batch = n_ubatch x factor, so n_batch >= n_ubatch always holds (llama.cpp would
  clamp n_ubatch down to n_batch otherwise, and the two proposals would be the same run).
- ``threads``: -t and -tb together (run_probe sets both; separate -tb needs a run_probe option).
- ``type_k``, ``type_v`` (``type_v = "same"`` ties V to K: one parameter ``kv_type``), ``flash_attn``. llama.cpp
  refuses a quantized V cache with ``-fa off`` (llama_init_from_model), so with a quantized V the space never offers
  ``off``: flash attention is then the conditional parameter ``flash_attn_qv`` (the study's other ``flash_attn``
  values), or fixed when one value is left; a study whose only ``flash_attn`` is ``off`` leaves the quantized V types
  out.
- ``quant``: which of the model files given to the run (several GGUF files of the same model); only when several.
- ``n_cpu_moe`` (--n-cpu-moe: experts of the first N layers on the CPU) and ``n_gpu_layers`` (-ngl): placement, for a
  model larger than the GPU. More on the GPU or a longer context: which is faster depends on the prompt length, so a
  prefill study and a decode study may pick differently.
- ``draft``: ``none``, a draft file's name, or ``mtp``; with a drafter, ``draft_n_max``, ``draft_p_min`` and the
  draft cache type ``draft_kv_type`` (conditional parameters: TPE samples them with ``group=True``).

Settings every trial shares go in the study file's ``[fixed]`` table (any RunConfig field, e.g. ``n_parallel = 1``).
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fitter.errors import GGFitError
from fitter.llama.cparams import KV_CACHE_TYPES, ConfigError, RunConfig
from search.candidate import Candidate

CTX_STEP = 256
UNQUANTIZED_KV = ("f32", "f16", "bf16")  # the KV cache types ggml_is_quantized says no to


def quantized(kv_type: str) -> bool:
    """ggml_is_quantized for a KV cache type (q8_0, q4_0, iq4_nl ...: block sizes above 1)."""
    return kv_type not in UNQUANTIZED_KV


class StudyError(GGFitError):
    """A study file, search space or study argument ggfit cannot use (the message says which and why)."""


# --- what a study file says --------------------------------------------------------------------------------


class IntRange(BaseModel):
    """An integer range. ``high`` may be ``"auto"`` (threads: os.cpu_count()) or ``"train"`` (n_ctx: the model's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    low: int = Field(ge=0)
    high: int | Literal["auto", "train"]
    step: int = Field(1, ge=1)
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> IntRange:
        if self.log and self.step != 1:
            raise ValueError("a log range takes no step")
        if isinstance(self.high, int) and self.high < self.low:
            raise ValueError(f"high {self.high} < low {self.low}")
        return self


class FloatRange(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    low: float
    high: float
    step: float | None = None
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> FloatRange:
        if self.high < self.low:
            raise ValueError(f"high {self.high} < low {self.low}")
        if self.log and self.step is not None:
            raise ValueError("a log range takes no step")
        return self


IntSpec = list[int] | IntRange
KvType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
assert set(KvType.__args__) == set(KV_CACHE_TYPES)  # type: ignore[attr-defined]
DraftKind = Literal["none", "model", "mtp"]


class DraftSpace(BaseModel):
    """``[space.draft]``: which drafters to try and their settings. Draft files come from the run (``--draft``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kinds: list[DraftKind] = Field(["none", "model", "mtp"], min_length=1)
    n_max: IntSpec = Field(default_factory=lambda: IntRange(low=1, high=8))
    p_min: list[float] | FloatRange = Field(default_factory=lambda: FloatRange(low=0.0, high=0.9, step=0.1))
    kv_type: list[KvType] = Field(["f16"], min_length=1)


class SpaceDef(BaseModel):
    """``[space]`` of a study file: a list = choices, a table = a range. One value = fixed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_ctx: IntSpec | None = None
    n_ubatch: IntSpec = Field(default_factory=lambda: [512])
    n_batch_factor: list[int] = Field(default_factory=lambda: [1])
    threads: IntSpec | None = None  # None: run_probe's default (os.cpu_count())
    type_k: list[KvType] = Field(["f16"], min_length=1)
    type_v: list[KvType] | Literal["same"] = "same"
    flash_attn: list[Literal["on", "off", "auto"]] = Field(["auto"], min_length=1)
    n_cpu_moe: IntSpec | None = None  # None: the [fixed] value or llama-server's default (0)
    n_gpu_layers: IntSpec | None = None  # None: the [fixed] value or all layers
    draft: DraftSpace | None = None

    @field_validator("n_batch_factor")
    @classmethod
    def _factors(cls, v: list[int]) -> list[int]:
        if not v or any(f < 1 for f in v):
            raise ValueError("n_batch_factor: a list of integers >= 1")
        return v

    @field_validator("n_ubatch", "n_ctx", "threads")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, list):
            if not v or any(x < 1 for x in v):
                raise ValueError("a non-empty list of positive integers")
        elif isinstance(v, IntRange) and v.low < 1:
            raise ValueError("low must be >= 1")
        return v


def _grid_values(spec: list[Any] | IntRange | FloatRange) -> list[Any]:
    """Every value of a searched parameter, for `SearchSpace.grid`."""
    if isinstance(spec, list):
        return spec
    if isinstance(spec, IntRange):
        if spec.log:
            raise StudyError("grid(): a log range has no grid")
        assert isinstance(spec.high, int)  # _ints resolved "auto" and "train"
        return list(range(spec.low, spec.high + 1, spec.step))
    if spec.step is None:
        raise StudyError("grid(): a continuous float range has no grid")
    n = int(round((spec.high - spec.low) / spec.step))
    return [round(spec.low + i * spec.step, 9) for i in range(n + 1)]


# --- binding a space to one run --------------------------------------------------------------------------------


def _round_ctx(n: int) -> int:
    return max(CTX_STEP, -(-int(n) // CTX_STEP) * CTX_STEP)


def _label(path: str) -> str:
    return Path(path).name


class SearchSpace:
    """A `SpaceDef` bound to one run: model files, drafts, runner, workload need and fixed settings.

    ``suggest(trial)`` asks Optuna for the parameters; ``candidate(params)`` turns them into a `Candidate`.
    The same params always give the same candidate, so a retried or enqueued trial reproduces its run.
    """

    def __init__(
        self,
        space: SpaceDef,
        *,
        models: Sequence[str],
        n_ctx_train: int,
        ctx_need: int,
        fixed: dict[str, Any] | None = None,
        drafts: Sequence[str] = (),
        has_mtp: bool = False,
        runner: str = "python",
        ctx_choices: Sequence[int] | None = None,
    ):
        self.defn = space
        self.models = [str(m) for m in models]
        self.n_ctx_train = n_ctx_train
        self.ctx_need = _round_ctx(ctx_need)
        self._need_text = f"{ctx_need} tokens the workload needs (prompt + generated tokens)"
        self.fixed = dict(fixed or {})
        self.notes: list[str] = []  # what the space leaves out or allows that the user may not expect
        self.dims: dict[str, list[Any] | IntRange | FloatRange] = {}  # name -> choices or range (searched only)
        self.consts: dict[str, Any] = {}  # name -> the single value

        labels = [_label(m) for m in self.models]
        if len(set(labels)) != len(labels):
            raise StudyError(f"model files need distinct names: {', '.join(labels)}")
        self._model_by_label = dict(zip(labels, self.models))
        self._put("quant", labels)

        self._ctx_dim(space, ctx_choices)
        self._put("n_ubatch", self._ints(space.n_ubatch, "n_ubatch"))
        self._put("n_batch_factor", sorted(set(space.n_batch_factor)))
        if space.threads is not None:
            self._put("threads", self._ints(space.threads, "threads"))
        self._kv_dims(space)
        for name in ("n_cpu_moe", "n_gpu_layers"):
            spec = getattr(space, name)
            if spec is not None:
                self._put(name, self._ints(spec, name))

        self._draft_dim(space, drafts, has_mtp, runner)

    def _ctx_dim(self, space: SpaceDef, ctx_choices: Sequence[int] | None) -> None:
        """n_ctx: the study's values or range, or the contexts the prompt lengths need, never below the workload's."""
        if space.n_ctx is None:
            ctxs = sorted({_round_ctx(c) for c in (ctx_choices or [self.ctx_need])})
            self._put("n_ctx", ctxs)
        elif isinstance(space.n_ctx, list):
            ctxs = sorted({_round_ctx(c) for c in space.n_ctx})
            small = [c for c in ctxs if c < self.ctx_need]
            if small and len(small) < len(ctxs):
                self.notes.append(f"n_ctx {', '.join(map(str, small))} left out: below the {self._need_text}")
                ctxs = [c for c in ctxs if c >= self.ctx_need]
            self._put("n_ctx", ctxs)
        else:
            r = space.n_ctx
            high = r.high if isinstance(r.high, int) else self.n_ctx_train  # "train" (or "auto"): the model's
            low = max(_round_ctx(r.low), self.ctx_need)
            if _round_ctx(high) < low:
                raise StudyError(f"n_ctx: the range ends ({high}) below the {self._need_text}")
            self._put("n_ctx", IntRange(low=low, high=_round_ctx(high), log=r.log,
                                        step=1 if r.log else max(CTX_STEP, _round_ctx(r.step))))
        ctx = self.dims.get("n_ctx", [self.consts.get("n_ctx")])
        ctx_values = ctx if isinstance(ctx, list) else [ctx.low, ctx.high if isinstance(ctx.high, int) else self.n_ctx_train]
        if max(ctx_values) < self.ctx_need:
            raise StudyError(f"n_ctx: every context in the space ({', '.join(map(str, ctx_values))}) is below the "
                             f"{self._need_text}")
        if max(ctx_values) > self.n_ctx_train:
            self.notes.append(f"n_ctx above the model's training context ({self.n_ctx_train}) is in the space")

    def _kv_dims(self, space: SpaceDef) -> None:
        """type_k / type_v (or kv_type) and flash_attn, without what llama_init_from_model refuses: a quantized V cache
        with -fa off. With a quantized V, flash attention is chosen among the study's other values (``flash_attn_qv``,
        a conditional parameter, or fixed when one is left); a study that only has ``off`` loses its quantized V types."""
        fa = list(dict.fromkeys(space.flash_attn))
        self._fa_qv = [x for x in fa if x != "off"]
        v_types = list(dict.fromkeys(space.type_k if space.type_v == "same" else space.type_v))
        quant_v = [t for t in v_types if quantized(t)]
        if quant_v and not self._fa_qv:
            if len(quant_v) == len(v_types):
                raise StudyError(f"[space]: every V cache type ({', '.join(quant_v)}) is quantized and flash_attn is "
                                 f"only off: llama.cpp refuses a quantized V cache without flash attention")
            self.notes.append(f"V cache types {', '.join(quant_v)} left out: flash_attn is only off, and llama.cpp "
                              f"refuses a quantized V cache without flash attention")
            v_types = [t for t in v_types if not quantized(t)]
        elif quant_v and "off" in fa:
            self.notes.append(f"-fa off is not proposed with a quantized V cache ({', '.join(quant_v)}): llama.cpp "
                              f"refuses it")
        if space.type_v == "same":
            self._put("kv_type", v_types)
        else:
            self._put("type_k", list(dict.fromkeys(space.type_k)))
            self._put("type_v", v_types)
        self._put("flash_attn", fa)

    def _v_quantized(self, params: dict[str, Any]) -> bool:
        return quantized(str(params.get("kv_type", params.get("type_v"))))

    def _flash_attn(self, params: dict[str, Any]) -> str:
        """The -fa of a proposal: ``flash_attn_qv`` (or its one value) with a quantized V, else ``flash_attn``."""
        if "flash_attn_qv" in params:
            return str(params["flash_attn_qv"])
        if "flash_attn" not in params and self._v_quantized(params) and self._fa_qv:
            return self._fa_qv[0]
        return str(params["flash_attn"])

    def _draft_dim(self, space: SpaceDef, drafts: Sequence[str], has_mtp: bool, runner: str) -> None:
        """Speculative decoding: the drafters this run can try (draft files, the model's MTP head, none)."""
        self._drafts = {_label(d): str(d) for d in drafts}
        kinds: list[str] = ["none"]
        if space.draft is not None:
            d = space.draft
            kinds = []
            for k in d.kinds:
                if k == "none":
                    kinds.append("none")
                elif k == "model":
                    if not self._drafts:
                        self.notes.append("draft 'model' left out: no draft files were given (--draft FILE)")
                    kinds += list(self._drafts)
                elif k == "mtp":
                    if not has_mtp:
                        self.notes.append("draft 'mtp' left out: the model has no MTP (NextN) layers")
                    elif runner != "server":
                        self.notes.append("draft 'mtp' left out: only the server runner probes MTP (--runner server)")
                    else:
                        kinds.append("mtp")
            if not kinds:
                raise StudyError("[space.draft]: no drafter is left to try (give --draft FILE, or a model with an "
                                 "MTP head and --runner server, or add 'none' to kinds)")
            if {"none", "mtp"} & set(self._drafts):
                raise StudyError("draft files may not be called 'none' or 'mtp'")
        elif drafts:
            raise StudyError("draft files were given but this study's space has no [space.draft]")
        self._put("draft", kinds)
        self._draft_dims: dict[str, Any] = {}
        if space.draft is not None and any(k != "none" for k in kinds):
            d = space.draft
            self._draft_dims = {"draft_n_max": self._ints(d.n_max, "draft.n_max"),
                                "draft_p_min": d.p_min if isinstance(d.p_min, FloatRange) else sorted(set(d.p_min)),
                                "draft_kv_type": list(dict.fromkeys(d.kv_type))}

    # -- helpers
    def _ints(self, spec: IntSpec, what: str) -> list[int] | IntRange:
        if isinstance(spec, list):
            return sorted(set(spec))
        if spec.high == "auto":
            high = os.cpu_count() or 1
        elif spec.high == "train":
            high = self.n_ctx_train
        else:
            high = spec.high
        if high < spec.low:
            raise StudyError(f"{what}: high {high} < low {spec.low}")
        return IntRange(low=spec.low, high=high, step=spec.step, log=spec.log)

    def _put(self, name: str, spec: list[Any] | IntRange | FloatRange) -> None:
        if isinstance(spec, list):
            if len(spec) == 1:
                self.consts[name] = spec[0]
                return
        elif isinstance(spec, IntRange) and spec.low == spec.high:
            self.consts[name] = spec.low
            return
        self.dims[name] = spec

    @property
    def conditional(self) -> bool:
        """Whether trials suggest different parameters (TPE's group=True): the drafter's, or -fa with a quantized V."""
        return (bool(self._draft_dims) and "draft" in self.dims) or self._fa_conditional

    @property
    def _fa_conditional(self) -> bool:
        """Whether flash_attn is searched and some V type is quantized (those trials ask flash_attn_qv or nothing)."""
        v = self.dims.get("kv_type", self.dims.get("type_v", [self.consts.get("kv_type", self.consts.get("type_v"))]))
        return "flash_attn" in self.dims and isinstance(v, list) and any(quantized(str(t)) for t in v)

    # -- Optuna
    @staticmethod
    def _suggest(trial, name: str, spec):
        if isinstance(spec, list):
            return trial.suggest_categorical(name, spec)
        if isinstance(spec, IntRange):
            return trial.suggest_int(name, spec.low, spec.high, step=spec.step, log=spec.log)
        return trial.suggest_float(name, spec.low, spec.high, step=spec.step, log=spec.log)

    def suggest(self, trial) -> dict[str, Any]:
        """Ask `trial` (an optuna.Trial) for every searched parameter; returns all parameters, fixed ones included."""
        params = dict(self.consts)
        for name, spec in self.dims.items():
            if name == "flash_attn" and self._v_quantized(params):  # never -fa off with a quantized V (see _kv_dims)
                if len(self._fa_qv) > 1:
                    params["flash_attn_qv"] = self._suggest(trial, "flash_attn_qv", self._fa_qv)
                continue
            params[name] = self._suggest(trial, name, spec)
        if params.get("draft", "none") != "none":
            for name, spec in self._draft_dims.items():
                if isinstance(spec, list) and len(spec) == 1:
                    params[name] = spec[0]
                else:
                    params[name] = self._suggest(trial, name, spec)
        return params

    def candidate(self, params: dict[str, Any]) -> Candidate:
        p = dict(self.consts)
        p.update(params)
        n_ubatch = int(p["n_ubatch"])
        n_ctx = _round_ctx(max(int(p["n_ctx"]), self.ctx_need))
        kv_k = p.get("kv_type", p.get("type_k"))
        kv_v = p.get("kv_type", p.get("type_v"))
        fields: dict[str, Any] = dict(self.fixed)
        fields.update(n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=n_ubatch * int(p["n_batch_factor"]),
                      type_k=kv_k, type_v=kv_v, flash_attn=self._flash_attn(p))
        for name in ("n_cpu_moe", "n_gpu_layers"):
            if name in p:
                fields[name] = int(p[name])
        draft = p.get("draft", "none")
        p_min = None
        if draft != "none":
            fields["draft_n_max"] = int(p["draft_n_max"])
            dkv = p.get("draft_kv_type", "f16")
            fields.update(draft_type_k=dkv, draft_type_v=dkv)
            p_min = round(float(p["draft_p_min"]), 6)
            if draft == "mtp":
                fields.update(spec_type="draft-mtp", draft_model=None)
            else:
                fields.update(spec_type="draft-simple", draft_model=self._drafts[draft])
        try:
            config = RunConfig(**fields)
        except ConfigError as e:  # one line naming the flag
            raise StudyError(f"[fixed] or space gives an invalid config: {e}") from None
        threads = p.get("threads")
        return Candidate(model_path=self._model_by_label[p["quant"]], config=config,
                         threads=int(threads) if threads is not None else None, draft_p_min=p_min,
                         params={k: v for k, v in params.items()})

    def draft_path(self, cand: Candidate) -> str | None:
        return cand.config.draft_model

    # -- enumeration (benchmarks, the defaults seed)
    def grid(self) -> list[dict[str, Any]]:
        """Every combination of the searched parameters (ranges must be small: each integer of a range is a point)."""
        names = [n for n in self.dims if n != "flash_attn"]
        out = []
        for combo in itertools.product(*(_grid_values(self.dims[n]) for n in names)):
            for params in self._with_fa(dict(zip(names, combo))):
                out += self._with_draft(params)
        return out

    def _with_fa(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        """`params` with each -fa the space offers for its V cache type (see _kv_dims)."""
        fa = self.dims.get("flash_attn")
        if not isinstance(fa, list):
            return [params]
        if self._v_quantized({**self.consts, **params}):
            return [{**params, "flash_attn_qv": x} for x in self._fa_qv] if len(self._fa_qv) > 1 else [params]
        return [{**params, "flash_attn": x} for x in fa]

    def _with_draft(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        """`params` with each combination of the drafter's settings, when it drafts."""
        if params.get("draft", self.consts.get("draft", "none")) == "none":
            return [params]
        dnames = [n for n, s in self._draft_dims.items() if not (isinstance(s, list) and len(s) == 1)]
        return [{**params, **dict(zip(dnames, dcombo))}
                for dcombo in itertools.product(*(_grid_values(self._draft_dims[n]) for n in dnames))]

    def nearest(self, target: dict[str, Any]) -> dict[str, Any]:
        """The searched parameters closest to `target` (name -> value): for enqueueing llama.cpp's defaults."""
        out: dict[str, Any] = {}
        for name, spec in self.dims.items():
            want = target.get(name)
            if isinstance(spec, list):
                if want in spec:
                    out[name] = want
                elif want is not None and all(isinstance(x, (int, float)) for x in spec):
                    out[name] = min(spec, key=lambda x: (abs(math.log2(max(x, 1e-9)) - math.log2(max(want, 1e-9))), x))
                else:
                    out[name] = spec[0]
            elif isinstance(spec, IntRange):
                assert isinstance(spec.high, int)  # _ints resolved "auto"
                v = spec.low if want is None else min(max(int(want), spec.low), spec.high)
                out[name] = spec.low + (v - spec.low) // spec.step * spec.step
            else:
                out[name] = spec.low if want is None else min(max(float(want), spec.low), spec.high)
        return out

    def describe(self) -> list[str]:
        """One line per parameter: searched ones with their values or range, fixed ones with their value."""
        lines = []
        for name, spec in self.dims.items():
            if isinstance(spec, list):
                lines.append(f"{name}: {', '.join(map(str, spec))}")
            else:
                lines.append(f"{name}: {spec.low} .. {spec.high}" + (" (log)" if spec.log else f" step {spec.step}"))
        if self._fa_conditional and len(self._fa_qv) > 1:
            lines.append(f"flash_attn_qv (with a quantized V, instead of flash_attn): {', '.join(self._fa_qv)}")
        for name, spec in self._draft_dims.items():
            lines.append(f"{name} (with a drafter): " + (", ".join(map(str, spec)) if isinstance(spec, list)
                                                          else f"{spec.low} .. {spec.high}"))
        for name, v in self.consts.items():
            lines.append(f"{name} = {v} (fixed)")
        for name, v in self.fixed.items():
            lines.append(f"{name} = {v} ([fixed])")
        return lines
