"""`ggfit inspect`: a model described from its header (architecture, size, layer kinds, attention, vocab)."""

from __future__ import annotations

import json
from typing import Any

from cli_output import mib


def show_inspect(model: str, as_json: bool) -> None:
    """The description as rows of (what, value), or with as_json the ModelSpec and what the header read."""
    from fitter.bundled import resolve_model
    from fitter.llama.model import load_model_spec

    header, spec = load_model_spec(resolve_model(model), allow_unknown=True)
    if as_json:
        out = spec.model_dump(mode="json")
        out["layer_kinds"] = spec.layer_kind_counts()
        out["has_mtp"] = spec.has_mtp
        out["bytes_fetched"] = header.bytes_fetched
        out["shards"] = [s.location for s in header.shards]
        print(json.dumps(out, indent=2))
        return
    rows = _file_rows(header, spec) + _layer_rows(spec) + _other_rows(header, spec)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _file_rows(header: Any, spec: Any) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    rows.append(("model", ", ".join(s.location for s in header.shards)))
    arch = spec.architecture + (f" ({spec.name})" if spec.name else "")
    if not spec.known:
        arch += "  [not modelled by ggfit: layer kinds below are generic guesses]"
    rows.append(("architecture", arch))
    rows.append(("parameters", f"{spec.n_params:,} ({spec.n_params / 1e9:.3f} B)"))
    rows.append(("file size", f"{mib(spec.file_size)} ({spec.file_size:,} bytes; header {mib(spec.header_size)})"))
    rows.append(("file type", spec.file_type_name or "not set"))
    rows.append(("bytes by type", ", ".join(f"{t} {mib(b)}" for t, b in spec.bytes_by_type.items())))
    return rows


def _layer_rows(spec: Any) -> list[tuple[str, str]]:
    from fitter.llama.hparams import LayerKind

    rows: list[tuple[str, str]] = []
    trunk = [layer for layer in spec.layers if not layer.nextn]
    kinds = spec.layer_kind_counts()
    parts = []
    if kinds.get("full"):
        parts.append(f"{kinds['full']} full attention")
    if kinds.get("swa"):
        parts.append(f"{kinds['swa']} sliding window ({spec.n_swa} tokens)")
    if kinds.get("recurrent"):
        parts.append(f"{kinds['recurrent']} recurrent")
    no_kv = sum(1 for layer in trunk if not layer.has_kv and layer.kind != LayerKind.RECURRENT)
    if no_kv:
        parts.append(f"{no_kv} reuse another layer's KV")
    rows.append(("layers", f"{spec.n_layer}: " + ", ".join(parts)))
    pattern = "".join({"full": "F", "swa": "S", "recurrent": "R"}[layer.kind.value] for layer in trunk)
    rows.append(("layer pattern", pattern + "  (F full, S sliding window, R recurrent)"))
    attn = [layer for layer in trunk if layer.kind != LayerKind.RECURRENT]
    if attn:
        def _span(values: list[int]) -> str:
            lo, hi = min(values), max(values)
            return str(lo) if lo == hi else f"{lo}-{hi}"

        rows.append(
            (
                "attention",
                f"{_span([a.n_head for a in attn])} heads, {_span([a.n_head_kv for a in attn])} KV heads, "
                f"head size K {_span([a.n_embd_head_k for a in attn])} / V {_span([a.n_embd_head_v for a in attn])}"
                + (f"; MLA (kv_lora_rank {spec.n_lora_kv}, no V cache)" if spec.is_mla else ""),
            )
        )
    return rows


def _other_rows(header: Any, spec: Any) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if spec.ssm:
        s = spec.ssm
        rows.append(("recurrent", f"conv kernel {s.d_conv}, inner {s.d_inner}, state {s.d_state}, groups {s.n_group}, dt rank {s.dt_rank}"))
    if spec.n_expert:
        shared = f", {spec.n_expert_shared} shared" if spec.n_expert_shared else ""
        shexp = f", shared expert FFN {spec.n_ff_shexp}" if spec.n_ff_shexp else ""
        rows.append(("experts", f"{spec.n_expert} ({spec.n_expert_used} used{shared}{shexp})"))
    rows.append(("embedding", str(spec.n_embd)))
    rows.append(("vocab", f"{spec.n_vocab:,}"))
    rows.append(("training context", f"{spec.n_ctx_train:,}"))
    rows.append(("MTP head", f"yes ({spec.n_layer_nextn} NextN layer{'s' if spec.n_layer_nextn > 1 else ''})" if spec.has_mtp else "no"))
    if header.bytes_fetched < spec.file_size:
        rows.append(("read", f"{mib(header.bytes_fetched)} of the file"))
    return rows
