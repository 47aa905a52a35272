"""`ggfit fit --check`: llama.cpp's own dry run on the same config, beside the prediction.

The dry run (model param no_alloc, load_mode none, then a context) runs in a child process on this
machine's backend. Exact bytes come from llama.cpp's memory breakdown where available, else from its
log lines (0.01 MiB precision).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fitter.ggml import backends
from fitter.llama.cparams import ConfigError, ContextParams, RunConfig
from fitter.oracle.llama_run import LlamaParams, LlamaRun, measure

if TYPE_CHECKING:
    from fitter.fit.memory import Prediction


def llama_params(cp: ContextParams, cfg: RunConfig) -> LlamaParams:
    """The llama_model_params / llama_context_params that reproduce a resolved context exactly."""
    return LlamaParams(
        n_gpu_layers=cfg.n_gpu_layers,
        use_mmap=not cfg.no_mmap,
        use_extra_bufts=not cfg.no_repack,
        load_mtp=cfg.spec_type == "draft-mtp",
        n_ctx=cp.n_ctx,
        n_batch=cp.n_batch,
        n_ubatch=cp.n_ubatch,
        n_seq_max=cp.n_seq_max,
        n_rs_seq=cp.n_rs_seq,
        n_outputs_max=cp.n_outputs_max,
        type_k=cp.type_k,
        type_v=cp.type_v,
        flash_attn="on" if cp.flash_attn else "off",
        swa_full=cp.swa_full,
        kv_unified=cp.kv_unified,
        embeddings=cp.embeddings,
        tensor_buft_overrides=tuple(cfg.tensor_overrides()) or None,
        offload_kqv=False if cfg.no_kv_offload else None,
        op_offload=False if cfg.no_op_offload else None,
        split_mode=cfg.split_mode if cfg.split_mode != "layer" else None,
        main_gpu=cfg.main_gpu or None,
        tensor_split=cfg.tensor_split,
    )


def measured_by_kind(run: LlamaRun) -> dict[str, int | None]:
    """Exact bytes per buffer kind of a dry run (target context only)."""
    rep = run.report
    kv = sum(c.bytes for c in rep.kv_caches) if rep.kv_caches else 0
    rs = sum(r.bytes for r in rep.recurrent) if rep.recurrent else 0
    out = rep.printed_bytes("output")
    compute = run.breakdown_total("compute")
    if compute is None:
        compute = rep.printed_bytes("compute")
    context = run.breakdown_total("context")
    if context is not None and not rep.recurrent:
        kv = context  # exact (the log's K/V lines are rounded to 0.01 MiB)
    model = run.breakdown_total("model")
    if model is None:
        model = run.api.get("model_size")
    return {"model": model, "kv": kv, "rs": rs, "output": out, "compute": compute}


def dry_run_check(path: str, pred: Prediction, cfg: RunConfig, *, timeout: float = 300.0) -> dict[str, Any]:
    if backends.get(pred.backend).is_gpu:
        raise ConfigError(
            f"--check runs llama.cpp's dry run on this machine's CPU backend; predict with --backend cpu to compare "
            f"(asked: {pred.backend.value})"
        )
    notes = []
    has_draft = pred.draft_context is not None
    if not pred.context.build.is_pinned:  # the dry run is the pinned build's: compare it with that build's prediction
        asked = pred.context.build.label()
        pred = _pinned_prediction(path, pred, cfg)
        notes.append(f"the dry run is the pinned {pred.context.build.label()}, not {asked} (--llama-build): its rows "
                     "are compared with ggfit's prediction for the pinned build; the rules that differ for "
                     f"{asked} are listed above")
    run = measure(path, llama_params(pred.context, cfg), mode="dry", timeout=timeout, log_level="info", loras=cfg.lora)
    run.raise_for_status()
    got: dict[str, int | None] = {**measured_by_kind(run), "lora": run.report.printed_bytes("lora")}
    rows = []
    plain_compute = None
    if cfg.lora:
        # llama_set_adapters_lora comes after the context, whose constructor reserved the graph without them: a dry
        # run (no decode to re-reserve) measures the graph without the adapters; compare it with that prediction
        from fitter.llama.context import compute_buffers
        from fitter.llama.graph_details import graph_details
        from fitter.llama.model import load_model_spec

        header, spec = load_model_spec(path)
        plain_compute = sum(b.bytes for b in compute_buffers(spec, pred.context, "cpu", details=graph_details(header)))
        notes.append("LoRA: the dry run reserves the compute graph before the adapters apply; its compute row is "
                     "compared with ggfit's graph without them; the LoRA rows to llama.cpp's printed 0.01 MiB")
    for kind in ("model", "lora", "kv", "rs", "output", "compute"):
        target = [b for b in pred.buffers if b.owner == "target" and b.kind == kind]
        # the dry run reports the tensors' bytes (llama_model_size), not a mapped file range
        p = sum((b.tensor_bytes or 0) if kind == "model" else b.bytes for b in target)
        if kind == "compute" and plain_compute is not None:
            p = plain_compute
        m = got[kind]
        if p == 0 and not m:
            continue
        rows.append({"kind": kind, "predicted_bytes": p, "measured_bytes": m})
    if has_draft:
        notes.append("only the target context is measured; the draft/MTP context is not part of this dry run")
    return {"llama_cpp": f"{run.build.commit} (llama-cpp-python {run.build.llama_cpp_python})", "rows": rows,
            "wall_s": round(run.wall_s, 2), "notes": notes}


def _pinned_prediction(path: str, pred: Prediction, cfg: RunConfig) -> Prediction:
    """The same config (every value the other build resolved, written out) predicted with the pinned build's rules:
    what the pinned llama.cpp's dry run is compared with."""
    from fitter.fit.memory import predict
    from fitter.llama.cparams import served_config
    from fitter.llama.model import load_model_spec
    from fitter.llama_builds import PINNED

    header, spec = load_model_spec(path)
    return predict(header, spec, served_config(pred.context, cfg, None), pred.backend, pred.frontend, build=PINNED)

