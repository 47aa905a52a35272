"""Every byte of an mlx-lm run, as `Buffer` rows like the llama.cpp side's (fitter.fit.memory), so the
same table, budget and JSON apply: weights, each cache class, the prefill peak, a draft model, the
MTP head mlx-lm leaves on disk, and the server's prompt cache.

MLX on Apple Silicon is unified memory: every row counts against the Metal budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from fitter.errors import GGFitError
from fitter.fit.largest import largest_fitting
from fitter.fit.memory import Buffer
from fitter.mlx.activations import prefill_peak
from fitter.mlx.cache import CacheSettings, layer_caches
from fitter.mlx.config import MlxModel
from fitter.mlx.weights import weight_bytes

DEVICE = "MLX"
DEFAULT_MAX_TOKENS = 512  # mlx_lm.server --max-tokens
DEFAULT_PROMPT_CACHE_SIZE = 10  # mlx_lm.server --prompt-cache-size (entries of LRUPromptCache)
CTX_STEP = 256  # KVCache.step: the solver's context grid


@dataclass(frozen=True)
class MlxRun:
    n_ctx: int  # prompt + generated tokens of one request (what the server budgets)
    max_tokens: int = DEFAULT_MAX_TOKENS
    cache: CacheSettings = field(default_factory=CacheSettings)
    prompt_cache_bytes: int | None = None
    prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE
    num_draft_tokens: int = 3  # mlx_lm.server --num-draft-tokens

    @property
    def n_prompt(self) -> int:
        return max(1, self.n_ctx - self.max_tokens)

    @property
    def n_generated(self) -> int:
        return max(1, self.n_ctx - self.n_prompt)


@dataclass
class MlxPrediction:
    run: MlxRun
    buffers: list[Buffer]
    warnings: list[str] = field(default_factory=list)

    @property
    def total_device_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers if b.counts)

    @property
    def total_host_bytes(self) -> int:
        return 0  # unified memory: nothing is outside the budget

    def by_kind(self, kind: str, owner: str | None = None) -> int:
        return sum(b.bytes for b in self.buffers if b.kind == kind and (owner is None or b.owner == owner))


def _model_rows(owner, model: MlxModel, run: MlxRun, *, n_extra: int = 0) -> list[Buffer]:
    spec = model.spec
    w = weight_bytes(spec, model.tensors)
    q = f", {spec.quant_bits}-bit groups of {spec.quant_group_size}" if spec.quant_bits else ""
    rows = [Buffer(owner=owner, device=DEVICE, kind="model", bytes=w.resident, counts=True,
                   detail=f"{w.n_tensors} arrays{q}", tensor_bytes=w.resident)]
    gen = run.n_generated + n_extra
    for c in layer_caches(spec, run.cache, run.n_prompt, gen):
        kind: Literal["rs", "kv"] = "rs" if c.cls == "ArraysCache" else "kv"
        what = f"{c.cls}: {c.n_layers} layers" + (f", {c.capacity} slots" if c.capacity else "")
        rows.append(Buffer(owner=owner, device=DEVICE, kind=kind, bytes=c.bytes, counts=True, detail=what))
    if w.dropped:
        gone = [s for s, b in (("the vision tower (mlx-vlm loads it)", w.vision), ("the tied lm_head", w.dropped - w.vision)) if b]
        rows.append(Buffer(owner=owner, device=DEVICE, kind="model", bytes=w.dropped, counts=False,
                           detail="on disk, dropped by mlx-lm's sanitize: " + " and ".join(gone)))
    if w.mtp:
        rows.append(Buffer(owner="mtp", device=DEVICE, kind="model", bytes=w.mtp, counts=False,
                           detail="MTP head: on disk, dropped by mlx-lm's sanitize (mlx-vlm's MTP decoding loads it)"))
    return rows


def predict_mlx(model: MlxModel, run: MlxRun, draft: MlxModel | None = None) -> MlxPrediction:
    if run.n_ctx < 1:
        raise GGFitError(f"-c {run.n_ctx}: must be at least 1")
    rows = _model_rows("target", model, run)
    pk = prefill_peak(model.spec, run.cache, run.n_prompt)
    kv_now = sum(c.bytes for c in layer_caches(model.spec, run.cache, run.n_prompt, run.n_generated))
    # the prefill peak is the worst chunk's working set; the cache it wrote then is at most the final one
    rows.append(Buffer(owner="target", device=DEVICE, kind="compute", bytes=pk.bytes + max(0, pk.cache_bytes - kv_now),
                       counts=True, detail=f"prefill step of {pk.chunk} tokens over {pk.keys} keys "
                       f"(--prefill-step-size {run.cache.prefill_step_size})"))
    if draft is not None:
        # generate.speculative_generate_step: the draft runs num_draft_tokens ahead on its own cache
        d_rows = _model_rows("draft", draft, run, n_extra=run.num_draft_tokens)
        rows += [r for r in d_rows if r.owner == "draft"]
    warnings = []
    spec, cs = model.spec, run.cache
    if cs.max_kv_size is not None and spec.has_make_cache:
        warnings.append(f"--max-kv-size {cs.max_kv_size} has no effect: {spec.model_type} builds its own cache "
                        "(make_prompt_cache calls model.make_cache)")
    if cs.kv_bits is not None and run.n_ctx < cs.quantized_kv_start:
        warnings.append(f"--kv-bits {cs.kv_bits} quantizes the cache only from --quantized-kv-start "
                        f"({cs.quantized_kv_start} tokens) on: at -c {run.n_ctx} it stays unquantized")
    one = sum(r.bytes for r in rows if r.kind in ("kv", "rs"))
    if run.prompt_cache_bytes is not None:
        rows.append(Buffer(owner="target", device=DEVICE, kind="kv", bytes=run.prompt_cache_bytes, counts=True,
                           detail=f"prompt cache ceiling (--prompt-cache-bytes), up to {run.prompt_cache_size} entries"))
    else:
        warnings.append(
            f"the prompt cache is unbounded in bytes: mlx_lm.server keeps up to {run.prompt_cache_size} caches "
            f"(--prompt-cache-size), each as large as its conversation ({one / 2**20:.1f} MiB at -c {run.n_ctx}, "
            f"{run.prompt_cache_size * one / 2**20:.0f} MiB for {run.prompt_cache_size}); set --prompt-cache-bytes")
    return MlxPrediction(run=run, buffers=rows, warnings=warnings)


def largest_context_mlx(model: MlxModel, run: MlxRun, available: int, n_ctx_max: int,
                        draft: MlxModel | None = None) -> tuple[int, MlxPrediction | None]:
    """The largest -c (a multiple of 256) whose total fits `available` bytes; 0 when not even 256 fits."""
    k_max = max(1, n_ctx_max // CTX_STEP)
    at: Callable[[int], MlxPrediction] = lambda k: predict_mlx(model, replace(run, n_ctx=k * CTX_STEP), draft)
    k, _ = largest_fitting(lambda k: at(k).total_device_bytes, available, k_max)
    return (k * CTX_STEP, at(k)) if k else (0, None)
