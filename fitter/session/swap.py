"""A llama-swap config (YAML): several llama-server commands behind one proxy, which of them are resident together.

llama-swap's format: `macros:` (name -> text, `${name}` in a cmd), `models:` (name -> `cmd:` a server command line,
optional `ttl`, `unlisted`, `macros`, ...), `groups:` (name -> `swap`, `exclusive`, `persistent`, `members`). A model
in no group is in llama-swap's default group (swap and exclusive). In a group with `swap: true` one member runs at a
time; `swap: false` keeps every member resident together. Loading a model of an `exclusive` group (the default) stops
every other group that is not `persistent`; a non-exclusive group stops none. `${PORT}` and `${MODEL_ID}` are
llama-swap's own macros, filled when a model starts. ggfit reads each cmd's flags as it reads a pasted llama-server
command (fitter.session.router's preset models) and sizes each model as `ggfit router` does.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import field
from pathlib import Path
from typing import Any

from fitter.record import Record
from fitter.session.router import Preset, PresetError, Resident

MACRO = re.compile(r"\$\{([A-Za-z0-9_.-]+)\}")
RUNTIME_MACROS = {"PORT": "5800", "MODEL_ID": ""}  # llama-swap's own, filled when a model starts
DEFAULT_GROUP = "(default)"  # llama-swap's group of the models no group names: swap and exclusive


class SwapGroup(Record):
    name: str
    members: list[str]
    swap: bool = True  # one member at a time
    exclusive: bool = True  # loading a member stops every other group that is not persistent
    persistent: bool = False  # no exclusive group stops this one


class SwapConfig(Record):
    models: list[Preset]
    groups: list[SwapGroup]
    unlisted: list[str] = field(default_factory=list)
    ttl: dict[str, int] = field(default_factory=dict)


def _expand(cmd: str, macros: dict[str, str], model: str) -> str:
    """The cmd with its macros filled (a macro may name another, as llama-swap allows); an unknown one is refused."""
    seen = dict(RUNTIME_MACROS, MODEL_ID=model)
    for _ in range(8):
        new = MACRO.sub(lambda m: macros.get(m.group(1), seen.get(m.group(1), m.group(0))), cmd)
        if new == cmd:
            break
        cmd = new
    left = MACRO.search(cmd)
    if left:
        raise PresetError(f"model {model}: unknown macro {left.group(0)} in cmd")
    return cmd


def _split(cmd: str, model: str) -> list[str]:
    """A cmd as words: comment lines dropped, backslash continuations joined (llama-swap's SanitizeCommand)."""
    lines = [ln for ln in cmd.replace("\\\n", " ").splitlines() if not ln.strip().startswith("#")]
    try:
        words = shlex.split(" ".join(lines))
    except ValueError as e:
        raise PresetError(f"model {model}: cmd is not a command line ({e})") from None
    out: list[str] = []
    for w in words:  # --flag=value as llama-server reads it: two words
        out += w.split("=", 1) if w.startswith("--") and "=" in w else [w]
    return out


def _preset(name: str, cmd: Any, macros: dict[str, str]) -> Preset:
    if not isinstance(cmd, str) or not cmd.strip():
        raise PresetError(f"model {name}: no cmd (a llama-server command line)")
    words = _split(_expand(cmd, macros, name), name)
    args, model, i = [], None, 1  # words[0] is the server's path
    while i < len(words):
        w = words[i]
        if w in ("-m", "--model") and i + 1 < len(words):
            model, i = words[i + 1], i + 2
            continue
        if w in ("-hf", "--hf-repo", "-mu", "--model-url"):
            raise PresetError(f"model {name}: {w} downloads the model; ggfit reads local GGUF files only (-m FILE)")
        args.append(w)
        i += 1
    if not model:
        raise PresetError(f"model {name}: no -m FILE in its cmd; ggfit reads local GGUF files only")
    return Preset(name=name, model=model, args=args)


def _groups(raw: Any, names: list[str]) -> list[SwapGroup]:
    if not isinstance(raw, dict):
        raise PresetError("groups: a map of group name -> swap, exclusive, members")
    out, taken = [], set()
    for g, body in raw.items():
        body = {} if body is None else body
        members = body.get("members") or [] if isinstance(body, dict) else None
        if not isinstance(members, list):
            raise PresetError(f"group {g}: members must be a list of model names")
        for m in members:
            if m not in names:
                raise PresetError(f"group {g}: member {m} is not a model of this config")
            if m in taken:
                raise PresetError(f"group {g}: model {m} is already in another group")
            taken.add(m)
        out.append(SwapGroup(name=str(g), members=[str(m) for m in members], swap=bool(body.get("swap", True)),
                             exclusive=bool(body.get("exclusive", True)),
                             persistent=bool(body.get("persistent", False))))
    rest = [n for n in names if n not in taken]
    if rest:
        out.append(SwapGroup(name=DEFAULT_GROUP, members=rest))
    return out


def read_swap(path: str | Path) -> SwapConfig:
    """A llama-swap config's models (each as a preset model: its -m and its other flags) and groups."""
    import yaml  # type: ignore[import-untyped]  # lazily: PyYAML comes with optuna

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise PresetError(f"{path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise PresetError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict) or not doc["models"]:
        raise PresetError(f"{path}: no models: map (llama-swap's config: models -> name -> cmd)")
    macros = {str(k): str(v) for k, v in (doc.get("macros") or {}).items()}
    models, unlisted, ttl = [], [], {}
    for name, body in doc["models"].items():
        if not isinstance(body, dict):
            raise PresetError(f"model {name}: a map with cmd (and ttl, unlisted, ...)")
        own = {**macros, **{str(k): str(v) for k, v in (body.get("macros") or {}).items()}}
        models.append(_preset(str(name), body.get("cmd"), own))
        if body.get("unlisted"):
            unlisted.append(str(name))
        if body.get("ttl"):
            ttl[str(name)] = int(body["ttl"])
    groups = _groups(doc.get("groups") or {}, [m.name for m in models])
    return SwapConfig(models=models, groups=groups, unlisted=unlisted, ttl=ttl)


def group_bytes(group: SwapGroup, sized: dict[str, Resident]) -> int:
    """A group's most bytes at once: every member with swap false, its largest member with swap true."""
    b = [sized[m].bytes for m in group.members]
    return (sum(b) if not group.swap else max(b)) if b else 0


def worst_resident(groups: list[SwapGroup], sized: dict[str, Resident]) -> tuple[int, list[str]]:
    """The most bytes resident at once and the groups that hold them: every non-exclusive or persistent group (none
    stops them) with the largest exclusive one (it stops the others but not those)."""
    stays = [g for g in groups if not g.exclusive or g.persistent]
    others = [g for g in groups if g not in stays]
    top = max(others, key=lambda g: group_bytes(g, sized), default=None)
    held = stays + ([top] if top else [])
    return sum(group_bytes(g, sized) for g in held), [g.name for g in held]
