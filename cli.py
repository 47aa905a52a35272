"""ggfit's command line: a thin typer app over `fitter` and `search`.

No `from __future__ import annotations` here: typer reads every command's annotations when it builds the app, and
strings would be compiled and evaluated one by one (~10 ms of each run)."""

import copy
import functools
import gc
import json
import re
import sys
from typing import Annotated, Any, Optional

import typer

import cli_session
from cli_options import (
    MODEL_HELP,
    SIZE_HELP,
    AdapterOptions,
    AsJson,
    BackendName,  # noqa: F401  (the CLI's names, as tests and callers read them: cli.BackendName)
    BackendOpt,
    BudgetOpt,
    BudgetOptions,
    BuildOptions,
    CheckOpt,
    ContextOptions,
    DraftOptions,
    EngineName,
    EngineOpt,
    EnginesOpt,
    FrontendName,
    FrontendOpt,
    GenTokensOpt,
    HardwareOpt,
    HostBandwidthOpt,
    LlamaBinOpt,
    LlamaBuildOpt,
    LlamaServerOpt,
    MarginOpt,
    MlxOptions,
    ModelDraft,
    NoOpOffload,
    PlacementOptions,
    PromptKind,
    PromptTokensOpt,
    Rpc,
    RpcBackend,
    RunnerName,
    RunnerOpt,
    SeedOpt,
    ServerOptions,
    SessionOptions,
    SpeedOptions,
    StorageOpt,
    TrialsOpt,
    check_engine_flags,
    split_server_flags,
    with_groups,
)
from fitter.errors import GGFitError

# typer >= 0.20 vendors its own click (typer._click); older releases use click itself: take the classes from typer
_UsageError: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_NoArgsIsHelp: Any = getattr(sys.modules[_UsageError.__module__], "NoArgsIsHelpError", ())

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fit llama.cpp models to a memory budget, from GGUF metadata alone.",
    pretty_exceptions_enable=False,
    # plain click help: rich's option table cuts long option names ("--spec-draft-type-k") at 80 columns
    rich_markup_mode=None,
    context_settings={"max_content_width": 100},
)


@app.callback()
def _root() -> None:
    """Fit llama.cpp models to a memory budget, from GGUF metadata alone."""


@app.command()
def inspect(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    as_json: AsJson = False,
) -> None:
    """Describe a model from its header: architecture, size, layer kinds, attention, vocab."""
    from cli_inspect import show_inspect

    show_inspect(model, as_json)


@app.command()
@with_groups
def fit(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    *,
    budget: BudgetOptions,
    frontend: FrontendOpt = FrontendName.server,
    context: ContextOptions,
    placement: PlacementOptions,
    adapters: AdapterOptions,
    server: ServerOptions,
    draft: DraftOptions,
    check: CheckOpt = False,
    build: BuildOptions,
    llama_bin: LlamaBinOpt = None,
    speed: SpeedOptions,
    as_json: AsJson = False,
    engine: EngineOpt = EngineName.llama,
    mlx: MlxOptions,
    session: SessionOptions,
) -> None:
    """Predict what llama.cpp (or mlx-lm, --engine mlx) allocates and solve for the largest context that fits a budget."""
    check_engine_flags(ctx, engine.value)
    if engine == EngineName.mlx:
        from cli_output import fit_mlx

        fit_mlx(model, budget=budget.budget, margin=budget.margin, n_ctx=context.n_ctx, model_draft=draft.model_draft,
                options=mlx, draft_n_max=draft.draft_n_max, as_json=as_json,
                session_requests=session.session_requests)
        return
    from cli_fit import plan_json, print_fit, warn_ctx_train
    from cli_request import fit_request
    from fitter.fit import plan as planner

    req = fit_request(model, budget, frontend, context, placement, adapters, server, draft, build, speed,
                      check=check, llama_bin=llama_bin, session=session)
    p = planner.plan(req)
    warn_ctx_train(p.pred.context, p.spec)
    planner.check(p)
    if as_json:
        print(json.dumps(plan_json(p), indent=2))
        raise typer.Exit(p.exit_code)  # the text's exit code: 1 when nothing fits (Plan.verdict)
    print_fit(p)


app.command("router")(cli_session.router)  # issue 48: a router preset's models on one budget


@app.command()
@with_groups
def quants(
    model: Annotated[str, typer.Argument(help=MODEL_HELP + " Any quant of the model: only its header is read.")],
    *,
    budget: BudgetOptions,
    frontend: FrontendOpt = FrontendName.server,
    context: ContextOptions,
    placement: PlacementOptions,
    adapters: AdapterOptions,
    model_draft: ModelDraft = None,
    candidate: Annotated[Optional[list[str]], typer.Option("--candidate", help="NAME=PATH_OR_URL or NAME=21109MiB (repeatable).")] = None,
    no_imatrix: Annotated[bool, typer.Option("--no-imatrix", help="Leave out quants that need an importance matrix.")] = False,
    rpc: Rpc = None,
    rpc_backend: RpcBackend = None,
    build: BuildOptions,
    speed: SpeedOptions,
    as_json: AsJson = False,
) -> None:
    """Every quant's file size, device total and predicted prefill and decode rates at these settings, from one
    header, before downloading."""
    from cli_fit import print_quants_plan, warn_ctx_train
    from cli_request import quants_request
    from fitter.fit.plan import plan_quants

    req = quants_request(model, budget, frontend, context, placement, adapters, model_draft, build, speed,
                         candidates=candidate, no_imatrix=no_imatrix, rpc=rpc, rpc_kinds=rpc_backend)
    q = plan_quants(req)
    if q.context is not None:
        warn_ctx_train(q.context, q.spec)
    print_quants_plan(q, as_json)


def signals(then: str = ""):
    """A command that runs probes: Ctrl-C and SIGTERM (search.signals) clean up as Ctrl-C does, then say one line
    (`ggfit: interrupted; THEN`, or a study's own hint) and exit 130, or die of SIGTERM (143 in a shell)."""
    def deco(f):
        @functools.wraps(f)
        def run(*args, **kwargs):
            from search.signals import Terminated, die_of_sigterm, sigterm_as_interrupt

            try:
                with sigterm_as_interrupt():
                    return f(*args, **kwargs)
            except KeyboardInterrupt as e:  # typer would turn it into a silent exit 130
                term = isinstance(e, Terminated) or bool(getattr(e, "terminated", False))
                hint = e.hint() if hasattr(e, "hint") else ("terminated (SIGTERM)" if term else "interrupted") + (
                    f"; {then}" if then else "")
                print(f"ggfit: {hint}", file=sys.stderr, flush=True)
                if term:
                    die_of_sigterm()
                raise typer.Exit(130) from None
        return run
    return deco


@app.command()
@with_groups
@signals("run the same command to resume")
def optimise(
    models: Annotated[list[str], typer.Argument(help="One model, or several quants of one model (searched as a parameter).")],
    *,
    study: Annotated[str, typer.Option("--study", help="prefill, decode, balanced, long-context, speculative, or a .toml path.")] = "prefill",
    budget: BudgetOptions,
    storage: StorageOpt = None,
    trials: TrialsOpt = None,
    runner: RunnerOpt = RunnerName.python,
    draft: Annotated[Optional[list[str]], typer.Option("--draft", help="A draft model to consider (repeatable).")] = None,
    seed: SeedOpt = None,
    no_compare: Annotated[bool, typer.Option("--no-compare", help="Skip measuring llama.cpp's default flags.")] = False,
    placement: PlacementOptions,
    no_op_offload: NoOpOffload = False,
    adapters: AdapterOptions,
    build: BuildOptions,
    engine: EnginesOpt = None,
    speed_cut: Annotated[Optional[float], typer.Option("--speed-cut", help="Skip configs the speed model predicts below this share of the best predicted (0: off; default: the study file's speed_cut, 0.5).")] = None,
    rpc: Rpc = None,
    rpc_backend: RpcBackend = None,
) -> None:
    """Search for the fastest config that fits: an Optuna study whose trials are real probes, and
    which never probes a config the memory model says will not fit. Killed, it resumes where it stopped."""
    from cli_search import optimise_run

    optimise_run(models, study, budget, storage=storage, trials=trials, runner=runner, drafts=draft, seed=seed,
                 no_compare=no_compare, placement=placement, no_op_offload=no_op_offload, adapters=adapters,
                 build=build, engine=engine, speed_cut=speed_cut, rpc=rpc, rpc_kinds=rpc_backend)


@app.command("compare-engines")
@signals()
def compare_engines_cmd(
    gguf: Annotated[str, typer.Argument(help="The model as a GGUF (path, URL or bundled name).")],
    mlx_model: Annotated[str, typer.Argument(help="The same model as an MLX directory (config.json + safetensors).")],
    budget: BudgetOpt = "auto",
    margin: MarginOpt = None,
    trials: TrialsOpt = None,
    prompt_tokens: PromptTokensOpt = 64,
    gen_tokens: GenTokensOpt = 16,
    llama_server: LlamaServerOpt = None,
    seed: SeedOpt = None,
    as_json: AsJson = False,
) -> None:
    """Which engine is faster for this model and workload under the budget: an Optuna study over `engine`
    (llama.cpp or MLX) and each engine's settings, every trial a real server measured the same way."""
    from cli_search import compare_engines_run

    compare_engines_run(gguf, mlx_model, budget=budget, margin=margin, trials=trials, prompt_tokens=prompt_tokens,
                     gen_tokens=gen_tokens, llama_server=llama_server, seed=seed, as_json=as_json)


@app.command()
def report(
    study: Annotated[str, typer.Argument(help="The study's name (printed by ggfit optimise).")],
    storage: StorageOpt = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Write trials.csv, summary.json and plots (HTML, PNG) here.")] = None,
) -> None:
    """The trial table of a study (status, reason, metrics) and, with --out, its plots."""
    from search.report import report as study_report  # optuna, plots: only for this command

    study_report(study, storage=storage, out=out)


@app.command()
def calibrate(
    model: Annotated[Optional[str], typer.Argument(help=MODEL_HELP + " With --clear: an architecture (gemma3) or a model.")] = None,
    backend: BackendOpt = None,
    list_: Annotated[bool, typer.Option("--list", help="List the stored calibrations.")] = False,
    clear: Annotated[bool, typer.Option("--clear", help="Remove the stored calibrations (all, or MODEL's architecture's).")] = False,
    log: Annotated[Optional[str], typer.Option("--log", metavar="FILE", help="A llama-server, llama-cli or llama-fit-params log of your own llama.cpp: compare every buffer it printed with the prediction for its build and settings, and store the compute residual for that build and backend. MODEL is then optional (default: the model the log names, if it is on this machine); --backend defaults to the log's.")] = None,
    llama_build: LlamaBuildOpt = None,
    no_store: Annotated[bool, typer.Option("--no-store", help="With --log or --bench: compare only, store nothing.")] = False,
    bench: Annotated[Optional[str], typer.Option("--bench", metavar="FILE", help="llama-bench's output (-o md, csv, json, jsonl, sql) or a ggfit probe --json result, run on this machine: each row's rate against the speed model's, and this machine's scale of the prefill and decode rates stored for --hardware and the rows' llama.cpp build (fit and quants then use it). MODEL: the model the rows ran (default: each row's model_filename, where it is on this machine).")] = None,
    hardware: HardwareOpt = "auto",
    host_bandwidth: HostBandwidthOpt = None,
    as_json: AsJson = False,
) -> None:
    """Run llama.cpp's dry run over a small grid here and store compute-buffer corrections for this
    architecture, backend and llama.cpp build; later predictions use them. With --log, learn them from
    a log of your own llama.cpp instead; with --bench, calibrate the speed model from llama-bench's rates."""
    from fitter.llama.flags import ConfigError  # defined there (fitter.llama.cparams re-exports it)

    if bench is not None:
        if log is not None or list_ or clear:
            raise ConfigError("--bench with --log, --list or --clear: use one at a time")
        from cli_request import llama_build_of
        from fitter.fit.request import Speed

        speed = Speed(hardware, host_bandwidth, build=llama_build_of(llama_build) if llama_build else None)
        from cli_speed import calibrate_bench

        calibrate_bench(bench, model, speed, no_store=no_store, as_json=as_json)
        return
    if hardware != "auto" or host_bandwidth is not None:
        raise ConfigError("--hardware and --host-bandwidth go with --bench FILE (the speed calibration)")
    if log is not None:
        if list_ or clear:
            raise ConfigError("--log with --list or --clear: use one at a time")
        from cli_calibrate import calibrate_log

        calibrate_log(log, model, backend, llama_build, no_store, as_json)
        return
    if llama_build is not None or no_store:
        raise ConfigError(f"{'--llama-build' if llama_build is not None else '--no-store'} goes with --log FILE or --bench FILE "
                          "(without it, calibrate measures the llama.cpp installed here)")
    if list_ or clear:
        from cli_output import calibrate_clear, calibrate_list
        from cli_speed import list_speed_calibrations
        from fitter.fit import calibration

        if list_ and clear:
            raise ConfigError("--list and --clear: use one at a time")
        if list_:
            calibrate_list(calibration, model, as_json)
            if not as_json:
                list_speed_calibrations()
        else:
            calibrate_clear(calibration, model, as_json)
        return
    if model is None:
        raise ConfigError("calibrate needs a MODEL (or --list, or --clear [ARCH])")
    from cli_calibrate import calibrate_grid

    calibrate_grid(model, backend, as_json)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@signals("the probe was stopped")
def probe(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help=MODEL_HELP + " Any further arguments are llama-server flags.")] = None,
    runner: RunnerOpt = RunnerName.python,
    budget: Annotated[Optional[str], typer.Option("--budget", help=f"CPU only: run the probe under this memory limit: {SIZE_HELP}.")] = None,
    llama_server: LlamaServerOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before the probe is a timeout.")] = 300.0,
    prompt_tokens: PromptTokensOpt = 512,
    gen_tokens: GenTokensOpt = 64,
    repeats: Annotated[int, typer.Option("--repeats", help="Measured runs after one warm-up (1 or more); the median is reported.")] = 3,
    kind: Annotated[PromptKind, typer.Option("--kind", help="The prompt text.")] = PromptKind.prose,
    as_json: AsJson = False,
    url: Annotated[Optional[str], typer.Option("--url", help="openai runner: the OpenAI-compatible server's base URL.")] = None,
    pid: Annotated[Optional[int], typer.Option("--pid", help="openai runner: the server's pid, for its memory (/proc).")] = None,
    depth: Annotated[Optional[list[int]], typer.Option("--depth", help="openai runner: context depth in tokens before the prompt (repeatable; default 0).")] = None,
    concurrency: Annotated[Optional[list[int]], typer.Option("--concurrency", help="openai runner: concurrent clients (repeatable; default 1).")] = None,
    soak: Annotated[int, typer.Option("--soak", help="openai, mlx and server runners: N more requests, one after another, and the server's memory growth (server runner: beside the predicted session).")] = 0,
    reasoning: Annotated[bool, typer.Option("--reasoning/--no-reasoning", help="openai runner: leave the template's thinking on.")] = False,
) -> None:
    """Prove a config with a real request in an isolated process: ok, oom, crash, timeout or error."""
    from fitter.progress import Progress  # the standard library only
    if runner == RunnerName.openai:
        from search.runner_openai import OpenAIProbe

        if not url:
            raise GGFitError("--runner openai needs --url (the server's base URL, e.g. http://127.0.0.1:8080)")
        with Progress("probe", json_output=as_json) as live:  # each request as it ends, on stderr
            res = OpenAIProbe(url, model=model, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats,
                              depths=tuple(depth or (0,)), concurrency=tuple(concurrency or (1,)), timeout=timeout,
                              pid=pid, soak=soak, reasoning=reasoning, progress=live).run()
        print(res.model_dump_json(indent=2) if as_json else res.summary())
        raise typer.Exit(0 if res.ok else 1)
    if model is None:
        raise GGFitError(f"Missing argument 'MODEL' (--runner {runner.value} needs one; --runner openai takes --url)")
    if runner == RunnerName.mlx:
        from fitter.mlx import require_mlx_lm
        from fitter.mlx.config import load_mlx_model
        from search.runner_mlx import MlxFlags, mlx_probe
        from search.runner_openai import OpenAIProbe

        require_mlx_lm()
        load_mlx_model(model)  # a missing or hostile model directory: one line, before the server starts
        with Progress("probe", json_output=as_json) as live:  # the server's start, each request, on stderr
            res, cmd = mlx_probe(model, MlxFlags(extra_args=tuple(ctx.args)), lambda u, p: OpenAIProbe(
                u, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, depths=tuple(depth or (0,)),
                concurrency=tuple(concurrency or (1,)), pid=p, soak=soak, reasoning=reasoning, progress=live),
                timeout=timeout, progress=live)
        print(res.model_dump_json(indent=2) if as_json else res.summary() + "\n  command: " + " ".join(cmd))
        raise typer.Exit(0 if res.ok else 1)
    from fitter.llama.flags import ConfigError
    from search.probe import probe_cli  # the probe machinery: only for this command
    from search.workload import Workload  # pydantic: not for --help

    if not (0 < timeout < float("inf")):
        raise ConfigError(f"--timeout {timeout:g}: use a number of seconds above 0")
    workload = Workload.from_flags(prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, kind=kind.value)
    code, text = probe_cli(model, list(ctx.args), runner=runner.value, budget=budget, llama_server=llama_server,
                           timeout=timeout, workload=workload, as_json=as_json, soak=soak)
    print(text)
    raise typer.Exit(code)


@app.command()
def hardware(
    name: Annotated[Optional[str], typer.Argument(metavar="[NAME|auto]", help="A profile to show with its sources, or auto: this machine.")] = None,
    detect: Annotated[bool, typer.Option("--detect", help="What this machine is detected as, and its host memory bandwidth (as NAME auto).")] = False,
    sources: Annotated[bool, typer.Option("--sources", help="Where each figure comes from.")] = False,
    remeasure: Annotated[bool, typer.Option("--remeasure", help="With auto: measure the host bandwidth again (it is cached).")] = False,
    as_json: AsJson = False,
) -> None:
    """The speed model's hardware profiles: memory bandwidth, FP16 compute, GPU cores, memory sizes, each figure's
    source; with auto, this machine's."""
    from cli_hardware import show_hardware

    show_hardware(name, detect=detect, sources=sources, remeasure=remeasure, as_json=as_json)


def _usage_line(e) -> str:
    """click's usage error (unknown option, missing argument, a value that is not a number) as one line."""
    msg = " ".join(e.format_message().split())
    # click's int/float parsing ("'abc' is not a valid int.") in the house's words
    msg = msg.replace(" is not a valid int.", " is not a whole number")
    msg = msg.replace(" is not a valid float.", " is not a number")
    # an Enum option's refusal, in the house's words: the flag, the value, the allowed values
    m = re.fullmatch(r"Invalid value for '([^']+)'(?: / '[^']+')*: '(.*)' is not one of (.+)\.", msg)
    if m:
        allowed = re.findall(r"'([^']*)'", m.group(3))
        msg = f"{m.group(1)} {m.group(2)}: use {', '.join(allowed[:-1])} or {allowed[-1]}"
    cmd = e.ctx.command_path if e.ctx is not None else "ggfit"
    return f"ggfit: error: {msg} (see {cmd} --help)"


_ONE_SHOT = frozenset({"fit", "quants", "inspect"})


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors (ggfit's and click's usage errors) become one line on stderr and exit code 2;
    Ctrl-C is exit code 130."""
    args = sys.argv[1:] if argv is None else argv
    one_shot = bool(args[:1]) and args[0] in _ONE_SHOT
    if one_shot:
        # one answer and exit: what they allocate is bounded (a header, a few graphs), and the cyclic collector's
        # passes over the imported modules' objects cost 20-65 ms of a 0.25-0.4 s command
        gc.disable()
    try:
        _run(argv)
    finally:
        if one_shot and argv is None:
            # and the interpreter's last collection at exit walks every object left (typer's and ggfit's modules:
            # ~25 ms); frozen, they are left to the process's end (their files are closed by then, by the
            # `with` blocks that opened them)
            gc.freeze()


def app_for(args: list[str]) -> typer.Typer:
    """The app that runs `args`: where they start with a command's name, `app` holding that command alone, else `app`
    (the root's help, a mistyped command and click's suggestions). typer builds the parameters of every command it
    holds on each run: 47M instructions for the eight, a run uses one."""
    for info in app.registered_commands:
        name = info.name or (typer.main.get_command_name(info.callback.__name__) if info.callback else None)
        if args[:1] == [name]:
            one = copy.copy(app)
            one.registered_commands = [info]
            return one
    return app


def _run(argv: Optional[list[str]]) -> None:
    from fitter.gguf import header_cache  # the standard library only

    ignored: list[str] = []
    try:
        # fit, quants: a pasted llama-server command line's flags that change no memory are ignored, and said so
        args, ignored = split_server_flags(list(sys.argv[1:] if argv is None else argv))
        with header_cache.enabled():  # a command reads a local header's parse from disk when the file is unchanged
            rc = app_for(args)(args=args, prog_name="ggfit", standalone_mode=False)
    except _NoArgsIsHelp as e:  # `ggfit` / `ggfit fit` alone: the help, as click prints it
        print(e.ctx.get_help(), file=sys.stderr)
        sys.exit(2)
    except _UsageError as e:
        print(_usage_line(e), file=sys.stderr)
        sys.exit(2)
    except GGFitError as e:
        print("ggfit: error: " + " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()), file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        print("ggfit: interrupted", file=sys.stderr)
        sys.exit(130)
    if ignored:
        print(f"ggfit: note: ignored (no effect on memory): {' '.join(ignored)}", file=sys.stderr)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
