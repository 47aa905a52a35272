"""ggfit's command line: a thin typer app over `fitter` and `search`."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from fitter.errors import GGFitError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fit llama.cpp models to a memory budget, from GGUF metadata alone.",
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
    """Fit llama.cpp models to a memory budget, from GGUF metadata alone."""


MODEL_HELP = "A GGUF path, an http(s) URL (read by Range requests), or a bundled model name (gemma3-270m)."


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


@app.command()
def inspect(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the model description as JSON.")] = False,
) -> None:
    """Describe a model from its header: architecture, size, layer kinds, attention, vocab."""
    from fitter.bundled import resolve_model
    from fitter.llama.hparams import LayerKind
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
    rows: list[tuple[str, str]] = []
    rows.append(("model", ", ".join(s.location for s in header.shards)))
    arch = spec.architecture + (f" ({spec.name})" if spec.name else "")
    if not spec.known:
        arch += "  [not modelled by ggfit: layer kinds below are generic guesses]"
    rows.append(("architecture", arch))
    rows.append(("parameters", f"{spec.n_params:,} ({spec.n_params / 1e9:.3f} B)"))
    rows.append(("file size", f"{_mib(spec.file_size)} ({spec.file_size:,} bytes; header {_mib(spec.header_size)})"))
    rows.append(("file type", spec.file_type_name or "not set"))
    rows.append(("bytes by type", ", ".join(f"{t} {_mib(b)}" for t, b in spec.bytes_by_type.items())))
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
        rows.append(("read", f"{_mib(header.bytes_fetched)} of the file"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _detect_backend() -> str:
    import platform
    import shutil

    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "metal"
    if shutil.which("nvidia-smi"):
        return "cuda"
    return "cpu"


def _backend(name: str | None):
    """--backend, or this machine's own when not given."""
    from fitter.config import Backend, ConfigError

    try:
        return Backend(name or _detect_backend())
    except ValueError:
        raise ConfigError(f"--backend {name}: use metal, cuda or cpu") from None


def _frontend(name: str):
    from fitter.config import ConfigError, Frontend

    try:
        return Frontend(name)
    except ValueError:
        raise ConfigError(f"--frontend {name}: use server or library") from None


def _run_config(**fields):
    """A RunConfig from CLI flags; a value llama.cpp would refuse is one line, not a traceback."""
    from pydantic import ValidationError

    from fitter.config import ConfigError, RunConfig

    try:
        return RunConfig(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None


def _flags(model: str, cp, cfg, draft_path: str | None) -> list[str]:
    """llama-server flags for a resolved context, one item per flag."""
    flags = [f"-m {model}", f"-c {cp.n_ctx}", f"-b {cp.n_batch}", f"-ub {cp.n_ubatch}",
             f"-ctk {cp.type_k}", f"-ctv {cp.type_v}", f"-fa {'on' if cp.flash_attn else 'off'}",
             f"-np {cp.n_seq_max}", "--kv-unified" if cp.kv_unified else "--no-kv-unified"]
    if cp.swa_full:
        flags.append("--swa-full")
    if cfg.n_gpu_layers >= 0:
        flags.append(f"-ngl {cfg.n_gpu_layers}")
    if cfg.no_mmap:
        flags.append("--no-mmap")
    if cfg.no_repack:
        flags.append("--no-repack")
    if draft_path:
        flags += [f"--model-draft {draft_path}", f"--spec-draft-type-k {cfg.draft_type_k}",
                  f"--spec-draft-type-v {cfg.draft_type_v}", f"--spec-draft-n-max {cfg.draft_n_max}"]
    elif cfg.spec_type == "draft-mtp":
        flags += ["--spec-type draft-mtp", f"--spec-draft-type-k {cfg.draft_type_k}",
                  f"--spec-draft-type-v {cfg.draft_type_v}", f"--spec-draft-n-max {cfg.draft_n_max}"]
    return flags


def _print_breakdown(pred, available: int) -> None:
    print(f"{'owner':<7} {'buffer':<12} {'kind':<8} {'MiB':>11}  {'budget':<6}  detail")
    for b in pred.buffers:
        print(f"{b.owner:<7} {b.device:<12} {b.kind:<8} {b.bytes / 2**20:>11,.2f}  {'yes' if b.counts else 'no':<6}  {b.detail}")
    total = pred.total_device_bytes
    verdict = "fits" if total <= available else "does NOT fit"
    print(f"total against the budget: {_mib(total)} of {_mib(available)} available: {verdict}, "
          f"headroom {(available - total) / 2**20:,.2f} MiB")
    if pred.total_host_bytes:
        print(f"host memory outside the budget: {_mib(pred.total_host_bytes)}")


@app.command()
def fit(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    budget: Annotated[str, typer.Option("--budget", help="25559MiB, 24GiB, 26800MB, or auto (the device's own limit).")] = "auto",
    margin: Annotated[Optional[str], typer.Option("--margin", help="Kept free on top of the prediction (default 1024MiB, like llama.cpp's --fit-target).")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="metal, cuda or cpu (default: this machine's).")] = None,
    frontend: Annotated[str, typer.Option("--frontend", help="Whose defaults apply: server (llama-server) or library (llama_context_default_params).")] = "server",
    n_ctx: Annotated[Optional[int], typer.Option("-c", "--ctx-size", help="Context size; omit to solve for the largest that fits.")] = None,
    n_batch: Annotated[Optional[int], typer.Option("-b", "--batch-size")] = None,
    n_ubatch: Annotated[Optional[int], typer.Option("-ub", "--ubatch-size")] = None,
    type_k: Annotated[Optional[str], typer.Option("-ctk", "--cache-type-k")] = None,
    type_v: Annotated[Optional[str], typer.Option("-ctv", "--cache-type-v")] = None,
    flash_attn: Annotated[str, typer.Option("-fa", "--flash-attn", help="on, off or auto")] = "auto",
    n_parallel: Annotated[Optional[int], typer.Option("-np", "--parallel", help="-1 = auto")] = None,
    kv_unified: Annotated[Optional[bool], typer.Option("-kvu/-no-kvu", "--kv-unified/--no-kv-unified")] = None,
    swa_full: Annotated[Optional[bool], typer.Option("--swa-full/--no-swa-full")] = None,
    n_gpu_layers: Annotated[int, typer.Option("-ngl", "--gpu-layers", "--n-gpu-layers")] = -1,
    no_mmap: Annotated[bool, typer.Option("--no-mmap")] = False,
    repack: Annotated[bool, typer.Option("--repack/--no-repack", help="llama.cpp's extra CPU buffer types (off by default: they crash on AMX machines).")] = False,
    model_draft: Annotated[Optional[str], typer.Option("-md", "--model-draft")] = None,
    spec_type: Annotated[Optional[str], typer.Option("--spec-type", help="draft-simple or draft-mtp")] = None,
    draft_type_k: Annotated[str, typer.Option("--spec-draft-type-k")] = "f16",
    draft_type_v: Annotated[str, typer.Option("--spec-draft-type-v")] = "f16",
    draft_n_max: Annotated[int, typer.Option("--spec-draft-n-max")] = 3,
    check: Annotated[bool, typer.Option("--check", help="Also run llama.cpp's own dry run on this config and compare.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Predict what llama.cpp allocates and solve for the largest context that fits a budget."""
    from fitter.budget import parse_budget, parse_margin
    from fitter.build import build_label
    from fitter.bundled import resolve_model
    from fitter.config import ConfigError
    from fitter.memory import predict
    from fitter.llama.model import load_model_spec
    from fitter.solver import prediction_for, recommend, solve

    be, fe = _backend(backend), _frontend(frontend)
    if flash_attn not in ("on", "off", "auto"):
        raise ConfigError(f"-fa {flash_attn}: use on, off or auto")
    if spec_type not in (None, "draft-simple", "draft-mtp"):
        raise ConfigError(f"--spec-type {spec_type}: ggfit models draft-simple and draft-mtp")
    bud = parse_budget(budget, be.value)
    margin_bytes = parse_margin(margin)
    cfg = _run_config(
        n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k or "f16", type_v=type_v or "f16",
        flash_attn=flash_attn, n_parallel=n_parallel, kv_unified=kv_unified, swa_full=swa_full,
        n_gpu_layers=n_gpu_layers, no_mmap=no_mmap, no_repack=not repack,
        spec_type=spec_type or ("draft-simple" if model_draft else "none"), draft_model=model_draft,
        draft_type_k=draft_type_k, draft_type_v=draft_type_v, draft_n_max=draft_n_max,
    )

    path = resolve_model(model)
    header, spec = load_model_spec(path)
    draft = load_model_spec(resolve_model(model_draft)) if model_draft else None
    available = bud.bytes - margin_bytes

    solutions = []
    rec = None
    if n_ctx is None:
        kv_pairs = ((cfg.type_k, cfg.type_v),) if (type_k or type_v) else None
        ubs = (n_ubatch,) if n_ubatch else None
        kwargs = {}
        if kv_pairs:
            kwargs["kv_pairs"] = kv_pairs
        if ubs:
            kwargs["ubatches"] = ubs
        solutions = solve(header, spec, cfg, be, fe, bud.bytes, margin_bytes, draft=draft, **kwargs)
        rec = recommend(solutions, spec.n_ctx_train)
        pred = prediction_for(header, spec, cfg, be, fe, rec, draft) if rec else predict(
            header, spec, cfg.model_copy(update={"n_ctx": 256}), be, fe, draft)
    else:
        pred = predict(header, spec, cfg, be, fe, draft)
    total = pred.total_device_bytes
    fits = total <= available

    measured = None
    if check:
        from fitter.check import dry_run_check

        measured = dry_run_check(path, pred, cfg)

    if as_json:
        out = {
            "backend": be.value,
            "frontend": fe.value,
            "llama_cpp": build_label(),
            "budget_bytes": bud.bytes,
            "budget_source": bud.source,
            "margin_bytes": margin_bytes,
            "config": pred.context.model_dump(mode="json"),
            "buffers": [b.model_dump(mode="json") for b in pred.buffers],
            "total_device_bytes": total,
            "fits": fits,
            "headroom_bytes": available - total,
            "solutions": [s.model_dump(mode="json") for s in solutions],
            "recommended": rec.model_dump(mode="json") if rec else None,
            "flags": _flags(path, pred.context, cfg, model_draft if (rec is None or rec.draft) else None) if fits else None,
        }
        if measured is not None:
            out["check"] = measured
        print(json.dumps(out, indent=2))
        return

    print(f"model    {path} ({spec.architecture}, {spec.file_type_name or '?'}, {_mib(spec.file_size)})")
    print(f"backend  {be.value}, {fe.value} defaults, {build_label()}")
    note = f" [{bud.note}]" if bud.note else ""
    print(f"budget   {_mib(bud.bytes)} ({bud.source}){note}, margin {_mib(margin_bytes)} -> {_mib(available)} available")
    if pred.context.defaults_applied:
        print("defaults " + ", ".join(f"{k} = {v}" for k, v in pred.context.defaults_applied.items()))
    if solutions:
        print()
        _print_solutions(solutions)
        if rec is None:
            print("\nnothing fits, not even -c 256 with the smallest settings: the weights alone need "
                  f"{_mib(pred.by_kind('model'))}; pick a smaller quant, offload fewer layers (-ngl) or raise the budget")
            raise typer.Exit(1)
        print(f"\nrecommended: -c {rec.n_ctx} -ub {rec.n_ubatch} -ctk {rec.type_k} -ctv {rec.type_v}"
              + (" with the draft" if rec.draft else "") + f" (target: the training context {spec.n_ctx_train:,})")
        if draft is not None and not rec.draft:
            keep = recommend([s for s in solutions if s.draft], spec.n_ctx_train)
            print("the draft is left out: " + (
                f"with it the largest context is {keep.n_ctx:,}; keep it with -c {keep.n_ctx} -ub {keep.n_ubatch} "
                f"-ctk {keep.type_k} -ctv {keep.type_v}" if keep else "with it nothing fits"))
    print()
    _print_breakdown(pred, available)
    if measured is not None:
        print()
        _print_check(measured)
    if fits:
        print("\nllama-server \\\n  " + " \\\n  ".join(_flags(path, pred.context, cfg, model_draft if (rec is None or rec.draft) else None)))
    else:
        print()
        _what_to_change(header, spec, cfg, be, fe, bud.bytes, margin_bytes, draft, pred)
        raise typer.Exit(1)


def _print_solutions(solutions) -> None:
    from collections import defaultdict

    table: dict[tuple, dict[int, int]] = defaultdict(dict)
    ubs: list[int] = sorted({s.n_ubatch for s in solutions})
    for s in solutions:
        table[(s.type_k, s.type_v, s.draft)][s.n_ubatch] = s.n_ctx
    print("largest -c that fits (0 = none), by K/V type and -ub:")
    print(f"  {'-ctk/-ctv':<16}" + "".join(f"{'-ub ' + str(u):>12}" for u in ubs))
    for (tk, tv, d), row in table.items():
        label = f"{tk}/{tv}" + (" +draft" if d else "")
        print(f"  {label:<16}" + "".join(f"{row.get(u, 0):>12,}" for u in ubs))


def _what_to_change(header, spec, cfg, be, fe, budget_bytes, margin_bytes, draft, pred) -> None:
    from fitter.config import ConfigError
    from fitter.solver import largest_context

    available = budget_bytes - margin_bytes
    cp = pred.context
    over = pred.total_device_bytes - available
    print(f"over budget by {over / 2**20:,.2f} MiB. What fits instead (one change at a time):")
    with_draft = draft is not None or cfg.spec_type == "draft-mtp"
    options = []
    s = largest_context(header, spec, cfg, be, fe, available, n_ubatch=cp.n_ubatch, type_k=cp.type_k, type_v=cp.type_v,
                        with_draft=with_draft, draft=draft, ctx_max=cp.n_ctx)
    options.append(f"-c {s.n_ctx}" if s.fits else "no context fits with these settings")
    # a quantized V cache needs flash attention: suggest both together when it is off
    fa_cfg = cfg if cp.flash_attn else cfg.model_copy(update={"flash_attn": "on"})
    fa_flag = "" if cp.flash_attn else "-fa on "
    for tk, tv in (("q8_0", "q8_0"), ("q4_0", "q4_0")):
        if (tk, tv) != (cp.type_k, cp.type_v):
            try:
                s = largest_context(header, spec, fa_cfg, be, fe, available, n_ubatch=cp.n_ubatch, type_k=tk, type_v=tv,
                                    with_draft=with_draft, draft=draft, ctx_max=cp.n_ctx)
            except ConfigError:
                continue  # llama.cpp refuses this pair for the model (block size, MLA)
            if s.n_ctx >= cp.n_ctx:
                options.append(f"{fa_flag}-ctk {tk} -ctv {tv} (fits at -c {cp.n_ctx})")
                break
    for ub in (1024, 512, 256):
        if ub < cp.n_ubatch:
            s = largest_context(header, spec, cfg, be, fe, available, n_ubatch=ub, type_k=cp.type_k, type_v=cp.type_v,
                                with_draft=with_draft, draft=draft, ctx_max=cp.n_ctx)
            if s.n_ctx >= cp.n_ctx:
                options.append(f"-ub {ub} (fits at -c {cp.n_ctx})")
                break
    if with_draft:
        s = largest_context(header, spec, cfg, be, fe, available, n_ubatch=cp.n_ubatch, type_k=cp.type_k, type_v=cp.type_v,
                            with_draft=False, draft=None, ctx_max=cp.n_ctx)
        if s.n_ctx >= cp.n_ctx:
            options.append("drop the draft model (fits at -c {cp.n_ctx})".format(cp=cp))
    for o in options:
        print(f"  {o}")


def _print_check(measured: dict) -> None:
    print(f"llama.cpp dry run ({measured.get('llama_cpp', '?')}), predicted vs measured:")
    print(f"  {'kind':<9}{'predicted MiB':>15}{'llama.cpp MiB':>15}{'diff MiB':>11}")
    for row in measured["rows"]:
        p, m = row["predicted_bytes"], row["measured_bytes"]
        mm = "-" if m is None else f"{m / 2**20:,.2f}"
        d = "-" if m is None else f"{(p - m) / 2**20:+,.2f}"
        print(f"  {row['kind']:<9}{p / 2**20:>15,.2f}{mm:>15}{d:>11}")
    for line in measured.get("notes", []):
        print(f"  {line}")


@app.command()
def quants(
    model: Annotated[str, typer.Argument(help=MODEL_HELP + " Any quant of the model: only its header is read.")],
    budget: Annotated[str, typer.Option("--budget", help="25559MiB, 24GiB, 26800MB, or auto.")] = "auto",
    margin: Annotated[Optional[str], typer.Option("--margin", help="Kept free (default 1024MiB).")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="metal, cuda or cpu (default: this machine's).")] = None,
    frontend: Annotated[str, typer.Option("--frontend", help="server or library defaults.")] = "server",
    n_ctx: Annotated[Optional[int], typer.Option("-c", "--ctx-size")] = None,
    n_batch: Annotated[Optional[int], typer.Option("-b", "--batch-size")] = None,
    n_ubatch: Annotated[Optional[int], typer.Option("-ub", "--ubatch-size")] = None,
    type_k: Annotated[str, typer.Option("-ctk", "--cache-type-k")] = "f16",
    type_v: Annotated[str, typer.Option("-ctv", "--cache-type-v")] = "f16",
    flash_attn: Annotated[str, typer.Option("-fa", "--flash-attn")] = "auto",
    n_parallel: Annotated[Optional[int], typer.Option("-np", "--parallel")] = None,
    model_draft: Annotated[Optional[str], typer.Option("-md", "--model-draft")] = None,
    candidate: Annotated[Optional[list[str]], typer.Option("--candidate", help="NAME=PATH_OR_URL or NAME=21109MiB (repeatable).")] = None,
    no_imatrix: Annotated[bool, typer.Option("--no-imatrix", help="Leave out quants that need an importance matrix.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Every quant's file size and device total at these settings, from one header, before downloading."""
    from fitter.budget import parse_budget, parse_margin
    from fitter.bundled import resolve_model
    from fitter.llama.model import load_model_spec
    from fitter.quant_fit import best_fit, evaluate, why_none_fits

    be, fe = _backend(backend), _frontend(frontend)
    cfg = _run_config(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v,
                      flash_attn=flash_attn, n_parallel=n_parallel, draft_model=model_draft,
                      spec_type="draft-simple" if model_draft else "none")
    bud = parse_budget(budget, be.value)
    margin_bytes = parse_margin(margin)
    header, spec = load_model_spec(resolve_model(model))
    draft = load_model_spec(resolve_model(model_draft)) if model_draft else None
    cands = evaluate(header, spec, cfg, be, fe, bud.bytes, margin_bytes, candidates=candidate or [], draft=draft,
                     include_imatrix=not no_imatrix)
    best = best_fit(cands)
    available = bud.bytes - margin_bytes
    if as_json:
        print(json.dumps({"backend": be.value, "budget_bytes": bud.bytes, "margin_bytes": margin_bytes,
                          "header_bytes_fetched": header.bytes_fetched,
                          "candidates": [c.model_dump(mode="json") for c in cands],
                          "best": best.name if best else None}, indent=2))
        return
    ctx = cands[0].n_ctx if cands else 0
    print(f"{spec.architecture}, {spec.n_params / 1e9:.2f} B parameters; backend {be.value}, -c {ctx}, "
          f"-ctk {cfg.type_k} -ctv {cfg.type_v}; budget {_mib(bud.bytes)} - margin {_mib(margin_bytes)} = {_mib(available)}")
    print(f"  {'quant':<24}{'file MiB':>11}{'device MiB':>12}{'headroom':>11}{'largest -c':>12}  verdict")
    for c in cands:
        verdict = "fits" if c.fits else f"over by {-c.headroom_bytes / 2**20:,.0f} MiB"
        flag = " (imatrix)" if c.needs_imatrix else "" if c.exact else " (size only)"
        mark = "*" if best is not None and c.name == best.name else " "
        print(f"{mark} {c.name + flag:<24}{c.file_bytes / 2**20:>11,.0f}{c.total_device_bytes / 2**20:>12,.0f}"
              f"{c.headroom_bytes / 2**20:>11,.0f}{c.largest_ctx:>12,}  {verdict}")
    if best:
        print(f"best fit: {best.name} ({best.file_bytes / 2**20:,.0f} MiB), headroom {best.headroom_bytes / 2**20:,.0f} MiB")
    elif cands:
        print(why_none_fits(cands, ctx))
        raise typer.Exit(1)


@app.command()
def optimise(
    models: Annotated[list[str], typer.Argument(help="One model, or several quants of one model (searched as a parameter).")],
    study: Annotated[str, typer.Option("--study", help="prefill, decode, balanced, long-context, speculative, or a .toml path.")] = "prefill",
    budget: Annotated[str, typer.Option("--budget", help="25559MiB, 24GiB, ... or auto.")] = "auto",
    margin: Annotated[Optional[str], typer.Option("--margin", help="Kept free (default 1024MiB).")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="metal, cuda or cpu (default: this machine's).")] = None,
    storage: Annotated[Optional[str], typer.Option("--storage", help="Any Optuna RDB URL (default: SQLite under ~/.local/share/ggfit). `optuna-dashboard URL` shows it live.")] = None,
    trials: Annotated[Optional[int], typer.Option("--trials", help="Probes to run in all (default: the study's budget).")] = None,
    runner: Annotated[str, typer.Option("--runner", help="python or server")] = "python",
    llama_server: Annotated[Optional[str], typer.Option("--llama-server")] = None,
    draft: Annotated[Optional[list[str]], typer.Option("--draft", help="A draft model to consider (repeatable).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Leave unset when several workers share a study.")] = None,
    no_compare: Annotated[bool, typer.Option("--no-compare", help="Skip measuring llama.cpp's default flags.")] = False,
) -> None:
    """Search for the fastest config that fits: an Optuna study whose trials are real probes, and
    which never probes a config the memory model says will not fit. Killed, it resumes where it stopped."""
    from fitter.bundled import resolve_model
    from fitter.config import ConfigError
    from search.study import run_study

    if runner not in ("python", "server"):
        raise ConfigError(f"--runner {runner}: use python or server")
    try:
        result = run_study([resolve_model(m) for m in models], study, budget=budget, margin=margin,
                           backend=backend or _detect_backend(), storage=storage, n_trials=trials, runner=runner,
                           drafts=draft or (), llama_server=llama_server, seed=seed, compare_defaults=not no_compare)
    except KeyboardInterrupt:
        print("interrupted; run the same command to resume", file=sys.stderr)
        raise typer.Exit(130) from None
    print(result.text())


@app.command()
def report(
    study: Annotated[str, typer.Argument(help="The study's name (printed by ggfit optimise).")],
    storage: Annotated[Optional[str], typer.Option("--storage")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Write trials.csv, summary.json and plots (HTML, PNG) here.")] = None,
) -> None:
    """The trial table of a study (status, reason, metrics) and, with --out, its plots."""
    from search.report import report as study_report

    study_report(study, storage=storage, out=out)


@app.command()
def calibrate(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    backend: Annotated[Optional[str], typer.Option("--backend", help="The backend llama.cpp runs on here (default: this machine's).")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Run llama.cpp's dry run over a small grid here and store compute-buffer corrections for this
    architecture, backend and llama.cpp build; later predictions use them."""
    from fitter import calibration
    from fitter.bundled import resolve_model

    be = _backend(backend)
    path = resolve_model(model)
    cal, rows = calibration.calibrate(path, be)
    where = calibration.save(cal)
    if as_json:
        print(json.dumps({"calibration": cal.model_dump(mode="json"), "grid": rows, "stored": str(where)}, indent=2))
        return
    print(f"{'n_ctx':>8} {'-ub':>6} {'-fa':>4} {'predicted MiB':>14} {'llama.cpp MiB':>14}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['n_ctx']:>8} {r['n_ubatch']:>6} {r['flash_attn']:>4}  llama.cpp {r['status']}: {r['message']}")
            continue
        print(f"{r['n_ctx']:>8} {r['n_ubatch']:>6} {r['flash_attn']:>4} {r['predicted_device'] / 2**20:>14,.2f} "
              f"{r['measured_device'] / 2**20:>14,.2f}")
    for name, c in (("device", cal.device), ("host", cal.host)):
        if c:
            print(f"{name} compute: measured = {c.a / 2**20:+.3f} MiB + {c.b:.5f} x predicted "
                  f"(worst residual {c.max_abs_error_bytes / 2**20:.3f} MiB over {c.points} points)")
    print(f"stored for {cal.architecture} on {cal.backend}, llama.cpp {cal.llama_cpp[:12]}: {where}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def probe(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help=MODEL_HELP + " Any further arguments are llama-server flags.")],
    runner: Annotated[str, typer.Option("--runner", help="python (llama-cpp-python in a child) or server (llama-server).")] = "python",
    budget: Annotated[Optional[str], typer.Option("--budget", help="CPU only: run the probe under this memory limit, e.g. 2GiB.")] = None,
    llama_server: Annotated[Optional[str], typer.Option("--llama-server", help="Path of the llama-server binary (server runner).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before the probe is a timeout.")] = 300.0,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens")] = 512,
    gen_tokens: Annotated[int, typer.Option("--gen-tokens")] = 64,
    repeats: Annotated[int, typer.Option("--repeats")] = 3,
    kind: Annotated[str, typer.Option("--kind", help="prose or code")] = "prose",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Prove a config with a real request in an isolated process: ok, oom, crash, timeout or error."""
    from fitter.config import ConfigError
    from search.probe import probe_cli
    from search.workload import Workload

    if runner not in ("python", "server"):
        raise ConfigError(f"--runner {runner}: use python or server")
    try:
        workload = Workload(prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, kind=kind)
    except ValueError as e:
        raise ConfigError(f"workload: {str(e).splitlines()[-1].strip()}") from None
    code, text = probe_cli(model, list(ctx.args), runner=runner, budget=budget, llama_server=llama_server,
                           timeout=timeout, workload=workload, as_json=as_json)
    print(text)
    raise typer.Exit(code)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2."""
    try:
        app(args=argv, standalone_mode=True)
    except GGFitError as e:
        print(f"ggfit: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("ggfit: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
