"""llama-server's router mode (`--models-preset FILE`, `--models-max N`): several models, each in its own child
llama-server, resident together on one budget.

The preset file is common_preset_context::load_from_ini's (common/preset.cpp of the pinned build): INI sections, one
per model (`[name]`), `[*]` the options every model shares (a model's own win), `version` skipped; a key is any
spelling of a llama-server flag without its dashes (`c`, `ctx-size`) or its environment variable
(`LLAMA_ARG_CTX_SIZE`); a boolean flag takes true/false (its negated spelling reversed, parse_bool_arg); the keys
`load-on-startup`, `stop-timeout` and `dedup-cache-models` are the preset's own. The router loads a model on its first
request and, at `--models-max` models running (default 4; 0 = no limit), unloads the least recently used first
(server_models::unload_lru): it counts models, not bytes. ggfit says which models fit together.
"""

from __future__ import annotations

import configparser
from itertools import combinations
from pathlib import Path

from fitter.errors import GGFitError
from fitter.llama.cparams import SERVER_FLAGS
from fitter.record import Record
from fitter.session.server import host_on_budget

PRESET_KEYS = {"load-on-startup", "stop-timeout", "dedup-cache-models"}  # common_params_add_preset_options
MODELS_MAX_DEFAULT = 4  # common_params::models_max
# common/arg.cpp's environment names of the flags ggfit reads (set_env), as their flag
ENV_FLAGS = {
    "LLAMA_ARG_MODEL": "-m", "LLAMA_ARG_CTX_SIZE": "-c", "LLAMA_ARG_BATCH": "-b", "LLAMA_ARG_UBATCH": "-ub",
    "LLAMA_ARG_N_PARALLEL": "-np", "LLAMA_ARG_N_GPU_LAYERS": "-ngl", "LLAMA_ARG_FLASH_ATTN": "-fa",
    "LLAMA_ARG_CACHE_TYPE_K": "-ctk", "LLAMA_ARG_CACHE_TYPE_V": "-ctv", "LLAMA_ARG_KV_UNIFIED": "--kv-unified",
    "LLAMA_ARG_SWA_FULL": "--swa-full", "LLAMA_ARG_CACHE_RAM": "--cache-ram",
    "LLAMA_ARG_CTX_CHECKPOINTS": "--ctx-checkpoints", "LLAMA_ARG_CACHE_IDLE_SLOTS": "--cache-idle-slots",
    "LLAMA_ARG_N_CPU_MOE": "--n-cpu-moe", "LLAMA_ARG_CPU_MOE": "--cpu-moe",
}
# flags with a value that fitter.session reads (not RunConfig fields)
SESSION_VALUE_FLAGS = {"-cram": "--cache-ram", "--cache-ram": "--cache-ram", "-ctxcp": "--ctx-checkpoints",
                       "--ctx-checkpoints": "--ctx-checkpoints", "--swa-checkpoints": "--ctx-checkpoints",
                       "-cms": "--checkpoint-min-step", "--checkpoint-min-step": "--checkpoint-min-step"}
NEGATED = {"--no-kv-unified": "--kv-unified", "-no-kvu": "--kv-unified", "--no-repack": "--repack",
           "-nr": "--repack", "--no-cache-idle-slots": "--cache-idle-slots", "--no-swa-full": "--swa-full"}
TRUTHY, FALSY = {"1", "true", "on", "yes", "enabled"}, {"0", "false", "off", "no", "disabled"}


class PresetError(GGFitError):
    """A preset file ggfit cannot read as llama-server would."""


class Preset(Record):
    name: str
    model: str
    args: list[str]  # llama-server flags (the model's own after the [*] ones)
    load_on_startup: bool = False


def _flag(key: str) -> str:
    """A preset key as the llama-server flag it names (the dashes common_preset_context strips)."""
    if key in ENV_FLAGS:
        return ENV_FLAGS[key]
    for cand in ("-" + key, "--" + key):
        if cand in SERVER_FLAGS or cand in SESSION_VALUE_FLAGS or cand in NEGATED or cand in ENV_FLAGS.values():
            return cand
    return ("-" if len(key) <= 3 else "--") + key


def _args(options: dict[str, str]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        flag = _flag(key)
        kind = SERVER_FLAGS.get(flag, ("", ""))[1]
        positive = NEGATED.get(flag)
        if kind in ("true", "false") or positive or flag in ("--cache-idle-slots", "--kv-unified", "--swa-full"):
            on = value.strip().lower() in TRUTHY
            if value.strip().lower() not in TRUTHY | FALSY:
                raise PresetError(f"{key} = {value}: a boolean flag takes true or false")
            base = positive or flag
            if positive:
                on = not on  # parse_bool_arg: a negated spelling reverses its value
            out.append(base if on else "--no-" + base.lstrip("-"))
        else:
            out += [flag, value.strip()]
    return out


def read_preset(path: str | Path) -> list[Preset]:
    """The models of a --models-preset file, each with its flags (common_preset_context::load_from_ini)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise PresetError(f"{path}: {e.strerror or e}") from None
    ini = configparser.ConfigParser(delimiters=("=",), comment_prefixes=(";", "#"), strict=False, interpolation=None,
                                    default_section="\x00none")
    ini.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case (LLAMA_ARG_...)
    try:
        ini.read_string("[\x00top]\n" + text)
    except configparser.Error as e:
        raise PresetError(f"{path}: not an INI file llama-server reads ({e.message.splitlines()[0]})") from None
    common = {k: v for k, v in ini["*"].items()} if ini.has_section("*") else {}
    out = []
    for name in ini.sections():
        if name in ("*", "\x00top"):
            continue
        opts = {**common, **{k: v for k, v in ini[name].items() if k != "version"}}
        own = {k: v for k, v in opts.items() if k not in PRESET_KEYS}
        model = own.pop("model", None) or own.pop("m", None) or own.pop("LLAMA_ARG_MODEL", None)
        if not model:
            raise PresetError(f"[{name}]: no model path (model = FILE); ggfit reads local GGUF files only")
        load = opts.get("load-on-startup", "false").strip().lower() in TRUTHY
        out.append(Preset(name=name, model=model, args=_args(own),
                          load_on_startup=load))
    if not out:
        raise PresetError(f"{path}: no model section")
    return out


class Resident(Record):
    name: str
    load_bytes: int  # fitter.fit.memory.predict's total against the budget
    session_bytes: int  # the session ceiling (fitter.session.server)
    process_bytes: int  # the process's own share (the backend's default margin, once per child)

    @property
    def bytes(self) -> int:
        return self.load_bytes + self.session_bytes + self.process_bytes


def models_max(models: list[Resident], available: int) -> int:
    """The largest --models-max whose every group of that many models fits `available` (the router picks by count:
    the largest models may end up together)."""
    sizes = sorted((m.bytes for m in models), reverse=True)
    n = 0
    while n < len(sizes) and sum(sizes[: n + 1]) <= available:
        n += 1
    return n


def largest_group(models: list[Resident], available: int) -> list[str]:
    """The most models (then the most bytes) that fit together (brute force: presets are small)."""
    for k in range(len(models), 0, -1):
        fits = [g for g in combinations(models, k) if sum(m.bytes for m in g) <= available]
        if fits:
            best = max(fits, key=lambda g: sum(m.bytes for m in g))
            return [m.name for m in best]
    return []


def session_flags(args: list[str]):
    """The --cache-ram / --ctx-checkpoints / --checkpoint-min-step / --cache-idle-slots of a model's flags."""
    from fitter.session.server import CacheFlags

    names = {"--cache-ram": "cache_ram_mib", "--ctx-checkpoints": "ctx_checkpoints",
             "--checkpoint-min-step": "checkpoint_min_step"}
    out: dict = {}
    for i, a in enumerate(args):
        if a in SESSION_VALUE_FLAGS and i + 1 < len(args):
            try:
                out[names[SESSION_VALUE_FLAGS[a]]] = int(args[i + 1])
            except ValueError:
                raise PresetError(f"{a} {args[i + 1]}: use a whole number, as llama-server's {a} does") from None
        elif a in ("--cache-idle-slots", "--no-cache-idle-slots"):
            out["cache_idle_slots"] = a == "--cache-idle-slots"
    return CacheFlags(**out)


def size_model(preset: Preset, backend, *, prompt: int | None = None, gen: int = 256) -> Resident:
    """One preset model's bytes on the budget: its load (fitter.fit.memory.predict, llama-server's defaults), its
    session ceiling and its process's share (fitter.fit.margin.default_margin: each model is its own llama-server)."""
    from fitter.fit.margin import default_margin
    from fitter.fit.memory import predict
    from fitter.llama.cparams import RunConfig
    from fitter.llama.model import load_model_spec
    from fitter.session.server import server_session

    skip = {"--cache-idle-slots", "--no-cache-idle-slots"}
    rest, i = [], 0
    while i < len(preset.args):
        a = preset.args[i]
        if a in SESSION_VALUE_FLAGS:
            i += 2
            continue
        if a not in skip:
            rest.append(a)
        i += 1
    cfg = RunConfig.from_server_args(rest).config
    header, spec = load_model_spec(preset.model)
    pred = predict(header, spec, cfg, backend)
    cp = pred.context
    p = prompt if prompt is not None else max(1, min(4096, cp.n_ctx_seq - gen))
    s = server_session(spec, cp, p, gen, [], session_flags(preset.args))
    return Resident(name=preset.name, load_bytes=pred.total_device_bytes,
                    session_bytes=s.ceiling_bytes if host_on_budget(backend) else 0,
                    process_bytes=default_margin(backend.value))
