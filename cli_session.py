"""`ggfit fit`'s session flags into the request (fitter.session.fit.SessionAsk), and `ggfit router --models-preset
FILE`: the router's models on one budget (fitter.session.router). Issue 48."""

import json
from typing import Annotated, Optional

import typer

from cli_options import AsJson, BackendOpt, BudgetOpt, MarginOpt, SessionOptions, backend_of


def _mib(b: float) -> str:
    from fitter.session.server import MIB

    return f"{b / MIB:,.0f} MiB" if b >= 10 * MIB else f"{b / MIB:,.1f} MiB"


def session_ask(o: SessionOptions):
    """fit's session options as a fitter.session.fit.SessionAsk (llama-server's defaults where a flag is not given)."""
    from fitter.session.fit import SessionAsk
    from fitter.session.server import CacheFlags

    d = CacheFlags()
    flags = CacheFlags(cache_ram_mib=d.cache_ram_mib if o.cache_ram is None else o.cache_ram,
                       ctx_checkpoints=d.ctx_checkpoints if o.ctx_checkpoints is None else o.ctx_checkpoints,
                       checkpoint_min_step=(d.checkpoint_min_step if o.checkpoint_min_step is None
                                            else o.checkpoint_min_step),
                       cache_idle_slots=d.cache_idle_slots if o.cache_idle_slots is None else o.cache_idle_slots)
    return SessionAsk(flags=flags, requests=o.session_requests or 100, prompt=o.session_prompt, gen=o.session_gen)


# `ggfit router --models-preset FILE`: the router's models on one budget (fitter.session.router)
PresetOpt = Annotated[Optional[str], typer.Option("--models-preset", metavar="FILE", help="llama-server's router preset (INI: a section per model, [*] shared).")]
SwapOpt = Annotated[Optional[str], typer.Option("--llama-swap", metavar="FILE", help="A llama-swap config (YAML: models -> cmd, groups with swap/exclusive/members).")]
ModelsMaxOpt = Annotated[Optional[int], typer.Option("--models-max", metavar="N", help="The router's --models-max to check (default: llama-server's 4).")]


def _sized(presets, be, margin):
    from fitter.fit.budget import parse_margin
    from fitter.session import router as rt

    models = [rt.size_model(p, be) for p in presets]
    if margin is not None:
        share = parse_margin(margin, be.value)
        models = [m.model_copy(update={"process_bytes": share}) for m in models]
    return models


def _table(models) -> None:
    print(f"  {'model':<24}{'load':>12}{'session':>12}{'process':>12}{'total':>12}")
    for m in models:
        print(f"  {m.name:<24}{_mib(m.load_bytes):>12}{_mib(m.session_bytes):>12}{_mib(m.process_bytes):>12}"
              f"{_mib(m.bytes):>12}")


def router(models_preset: PresetOpt = None, llama_swap: SwapOpt = None, budget: BudgetOpt = "auto",
           margin: MarginOpt = None, backend: BackendOpt = None, models_max: ModelsMaxOpt = None,
           as_json: AsJson = False) -> None:
    """Which models of a llama-server router preset (or of a llama-swap config) can be resident together: each
    model's load, session ceiling and process share, the largest --models-max whose every group fits, and the
    largest group that fits; for llama-swap, whether each group and the most it keeps resident at once fit."""
    from fitter.errors import GGFitError
    from fitter.fit.budget import parse_budget
    from fitter.session import router as rt

    if (models_preset is None) == (llama_swap is None):
        raise GGFitError("router takes one of --models-preset FILE or --llama-swap FILE")
    be = backend_of(backend)
    bud = parse_budget(budget, be.value)
    if models_preset is None:
        return _swap(llama_swap or "", be, bud, margin, as_json)
    presets = rt.read_preset(models_preset)
    models = _sized(presets, be, margin)
    n_fit = rt.models_max(models, bud.bytes)
    want = rt.MODELS_MAX_DEFAULT if models_max is None else models_max
    worst = sum(sorted((m.bytes for m in models), reverse=True)[: want if want > 0 else len(models)])
    group = rt.largest_group(models, bud.bytes)
    out = {"backend": be.value, "budget_bytes": bud.bytes, "models": [{**m.model_dump(mode="json"), "bytes": m.bytes}
                                                                      for m in models],
           "models_max_fits": n_fit, "models_max": want, "worst_group_bytes": worst, "models_max_ok": worst <= bud.bytes,
           "largest_group": group, "load_on_startup": [p.name for p in presets if p.load_on_startup]}
    if as_json:
        print(json.dumps(out, indent=2))
        raise typer.Exit(0 if n_fit else 1)
    print(f"router   {len(models)} models of {models_preset}, backend {be.value}, budget {_mib(bud.bytes)} ({bud.source})")
    _table(models)
    said = f"--models-max {want}" + (" (llama-server's default)" if models_max is None else "")
    print(f"{said}: the {min(want, len(models)) if want > 0 else len(models)} largest together take {_mib(worst)}: "
          + ("fits" if worst <= bud.bytes else "does NOT fit (the router counts models, not bytes)"))
    print(f"any {n_fit} fit together: --models-max {n_fit}" if n_fit else "no model fits the budget alone")
    if group:
        print(f"the largest group that fits: {', '.join(group)}")
    raise typer.Exit(0 if n_fit else 1)


def _swap(path: str, be, bud, margin, as_json: bool) -> None:
    """`ggfit router --llama-swap FILE`: each model's bytes, each group's most at once (all its members with swap
    false, its largest with swap true) and the most resident at once across groups (fitter.session.swap)."""
    from fitter.session import swap as sw

    conf = sw.read_swap(path)
    models = _sized(conf.models, be, margin)
    sized = {m.name: m for m in models}
    groups = [{**g.model_dump(mode="json"), "bytes": sw.group_bytes(g, sized),
               "fits": sw.group_bytes(g, sized) <= bud.bytes} for g in conf.groups]
    worst, held = sw.worst_resident(conf.groups, sized)
    ok = worst <= bud.bytes and all(g["fits"] for g in groups)
    if as_json:
        print(json.dumps({"backend": be.value, "budget_bytes": bud.bytes, "models": [
            {**m.model_dump(mode="json"), "bytes": m.bytes} for m in models], "groups": groups,
            "worst_resident_bytes": worst, "worst_resident_groups": held, "fits": ok,
            "unlisted": conf.unlisted, "ttl": conf.ttl}, indent=2))
        raise typer.Exit(0 if ok else 1)
    print(f"llama-swap   {len(models)} models of {path}, backend {be.value}, budget {_mib(bud.bytes)} ({bud.source})")
    _table(models)
    for g in groups:
        how = "all resident together (swap: false)" if not g["swap"] else "one at a time (swap: true)"
        print(f"group {g['name']}: {', '.join(g['members'])}: {how}: {_mib(g['bytes'])}: "
              + ("fits" if g["fits"] else "does NOT fit"))
    print(f"most resident at once ({', '.join(held)}): {_mib(worst)}: " + ("fits" if worst <= bud.bytes
                                                                             else "does NOT fit"))
    raise typer.Exit(0 if ok else 1)
