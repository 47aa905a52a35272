"""llama-server's flags as RunConfig (fitter.llama.cparams) reads them: their names and spellings, how each value
reads, and the checks that refuse what llama-server refuses, with one line naming the flag the user typed."""

from __future__ import annotations

import re
from typing import Any, Callable, Literal, Sequence, get_args

from fitter.errors import GGFitError

# common/arg.cpp kv_cache_types: the K/V cache types llama.cpp accepts (-ctk / -ctv)
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
LLAMA_MAX_SEQ = 256  # src/llama-cparams.h
INT32_MAX = 2**31 - 1  # common/arg.cpp common_params_parse_ex: integer flags are read with std::stoi

# RunConfig field -> the llama-server flag a user types (for error messages)
FLAG_OF = {
    "n_ctx": "-c", "n_batch": "-b", "n_ubatch": "-ub", "type_k": "-ctk", "type_v": "-ctv", "flash_attn": "-fa",
    "n_parallel": "-np", "kv_unified": "--kv-unified", "swa_full": "--swa-full", "n_gpu_layers": "-ngl",
    "no_mmap": "--no-mmap", "no_repack": "--no-repack", "embeddings": "--embeddings", "spec_type": "--spec-type",
    "draft_model": "--model-draft", "draft_type_k": "--spec-draft-type-k", "draft_type_v": "--spec-draft-type-v",
    "draft_n_max": "--spec-draft-n-max", "n_cpu_moe": "--n-cpu-moe", "cpu_moe": "--cpu-moe", "override_tensor": "-ot",
    "no_kv_offload": "-nkvo", "no_op_offload": "--no-op-offload", "split_mode": "-sm", "main_gpu": "-mg",
    "tensor_split": "-ts", "rpc": "--rpc", "rpc_backends": "--rpc-backend", "lora": "--lora", "mmproj": "--mmproj", "no_mmproj_offload": "--no-mmproj-offload",
}


class ConfigError(GGFitError):
    """A configuration llama.cpp would refuse (the message says which flag and why)."""


FlashAttn = Literal["on", "off", "auto"]
SpecType = Literal["none", "draft-simple", "draft-mtp"]
SplitMode = Literal["none", "layer", "row", "tensor"]


_LOAD_MODES = {"none": True, "auto": False, "mmap": False}  # -lm MODE -> no_mmap (mlock, dio: not modelled)

# llama-server flag (every spelling common/arg.cpp of the pinned build has) -> (RunConfig field, or @option of the
# probe; how its value reads)
_FLAG_TABLE: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("-c", "--ctx-size"), "n_ctx", "int"),
    (("-b", "--batch-size"), "n_batch", "int"),
    (("-ub", "--ubatch-size"), "n_ubatch", "int"),
    (("-ctk", "--cache-type-k"), "type_k", "str"),
    (("-ctv", "--cache-type-v"), "type_v", "str"),
    (("-fa", "--flash-attn"), "flash_attn", "str"),
    (("-np", "--parallel"), "n_parallel", "int"),
    (("-kvu", "--kv-unified"), "kv_unified", "true"),
    (("-no-kvu", "--no-kv-unified"), "kv_unified", "false"),
    (("--swa-full",), "swa_full", "true"),
    (("-ngl", "--gpu-layers", "--n-gpu-layers"), "n_gpu_layers", "ngl"),
    (("-lm", "--load-mode"), "no_mmap", "load_mode"),
    (("-nr", "--no-repack"), "no_repack", "true"),
    (("--repack",), "no_repack", "false"),
    (("--embedding", "--embeddings"), "embeddings", "true"),
    (("--spec-type",), "spec_type", "str"),
    (("-md", "--model-draft", "--spec-draft-model"), "draft_model", "str"),
    (("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k"), "draft_type_k", "str"),
    (("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v"), "draft_type_v", "str"),
    (("--spec-draft-n-max",), "draft_n_max", "int"),  # --draft / --draft-max / --draft-min are removed in the pinned build
    (("--spec-draft-n-min",), "@draft_n_min", "int"),
    (("--draft-p-min", "--spec-draft-p-min"), "@draft_p_min", "float"),
    (("-t", "--threads"), "@threads", "int"),
    (("-ncmoe", "--n-cpu-moe"), "n_cpu_moe", "int"),
    (("-cmoe", "--cpu-moe"), "cpu_moe", "true"),
    (("-ot", "--override-tensor"), "override_tensor", "list"),
    (("-nkvo", "--no-kv-offload"), "no_kv_offload", "true"),
    (("-kvo", "--kv-offload"), "no_kv_offload", "false"),
    (("--no-op-offload",), "no_op_offload", "true"),
    (("--op-offload",), "no_op_offload", "false"),
    (("-sm", "--split-mode"), "split_mode", "str"),
    (("-mg", "--main-gpu"), "main_gpu", "int"),
    (("-ts", "--tensor-split"), "tensor_split", "floats"),
    (("--rpc",), "rpc", "str"),
    (("--lora",), "lora", "lora"),
    (("--lora-scaled",), "lora", "lora_scaled"),
    (("-mm", "--mmproj"), "mmproj", "str"),
    (("--no-mmproj-offload",), "no_mmproj_offload", "true"),
    (("--mmproj-offload",), "no_mmproj_offload", "false"),
)
SERVER_FLAGS: dict[str, tuple[str, str]] = {n: (field, kind) for names, field, kind in _FLAG_TABLE for n in names}


def _value(args: Sequence[str], i: int, name: str, eq: str, inline: str) -> tuple[str, int]:
    """The value of the flag at args[i] (`--flag=value` or `flag value`) and the index after it."""
    if eq:
        return inline, i + 1
    if i + 1 < len(args):
        return args[i + 1], i + 2
    raise ConfigError(f"{name} needs a value")


def _convert(name: str, kind: str, val: str) -> Any:
    try:
        if kind == "int":
            return int(val)
        if kind == "float":
            return float(val)
        if kind == "ngl":  # common/arg.cpp -ngl: auto, all or a number; ggfit's -1 offloads every layer
            return -1 if val in ("all", "auto") else int(val)
        if kind == "load_mode":
            return _LOAD_MODES[val]
        if kind == "floats":  # common/arg.cpp -ts: split by , and /
            return tuple(float(x) for x in re.split(r"[,/]+", val) if x)
        if kind == "lora":  # common/arg.cpp --lora: comma-separated paths, scale 1.0 each
            return tuple((p, 1.0) for p in val.split(",") if p)
        if kind == "lora_scaled":
            return lora_scaled(val)
    except ValueError:
        raise ConfigError(f"{name}: invalid value {val!r}") from None
    return val


def lora_scaled(value: str) -> tuple[tuple[str, float], ...]:
    """common/arg.cpp --lora-scaled FNAME:SCALE,...: comma-separated, each split at ':' into exactly two parts."""
    out = []
    for item in value.split(","):
        parts = item.split(":")
        if len(parts) != 2 or not parts[0]:
            raise ConfigError(f"--lora-scaled {value}: lora-scaled format: FNAME:SCALE")
        try:
            out.append((parts[0], float(parts[1])))
        except ValueError:
            raise ConfigError(f"--lora-scaled {value}: SCALE {parts[1]!r} is not a number") from None
    return tuple(out)


def _refusal(field: str, value: Any, why: str) -> ConfigError:
    """One line naming the flag as the user typed it (not the RunConfig field), with the value refused."""
    flag = FLAG_OF.get(field, field)
    if isinstance(value, bool):
        value = "on" if value else "off"
    elif isinstance(value, (tuple, list)):
        value = ",".join(map(str, value))
    return ConfigError(f"{flag} {value}: {why}")


# --- RunConfig's checks, run by its __post_init__ in its field order: the first refusal is the one reported ---------


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError("use a valid integer")
    # llama-server reads these with std::stoi (common/arg.cpp): a value beyond int32 is refused
    if not -INT32_MAX - 1 <= v <= INT32_MAX:
        raise ValueError(f"llama-server reads it as a 32-bit integer (at most {INT32_MAX})")
    return v


def _at_least(n: int, why: str) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if _int(v) < n:
            raise ValueError(why)
        return v
    return check


def _n_parallel(v: Any) -> int:
    # common/arg.cpp (llama-server -np): 0 is "invalid value for n_parallel", negative is auto;
    # llama_context::llama_context: n_seq_max must be <= LLAMA_MAX_SEQ. ggfit takes -1 as the one auto spelling.
    if _int(v) == 0 or v < -1 or v > LLAMA_MAX_SEQ:
        raise ValueError(f"use -1 (auto: 4 slots) or a number of slots from 1 to {LLAMA_MAX_SEQ}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("use a valid boolean")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("use a valid string")
    return v


def _kv_type(v: Any) -> str:
    v = _str(v).lower()
    if v not in KV_CACHE_TYPES:
        raise ValueError(f"unsupported cache type '{v}' (llama.cpp accepts {', '.join(KV_CACHE_TYPES)})")
    return v


def _one_of(*choices: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in choices:
            raise ValueError(f"use {', '.join(map(repr, choices[:-1]))} or {choices[-1]!r}")
        return v
    return check


def _overrides(v: Any) -> tuple[str, ...]:
    # common/arg.cpp parse_tensor_buffer_overrides: comma-separated PATTERN=BUFT (the buffer type is checked
    # against the devices at prediction time)
    out: list[str] = []
    for item in v:
        for one in _str(item).split(","):
            pattern, eq, buft = one.partition("=")
            if not eq or not buft:
                raise ValueError(f"invalid value {one!r}: use <tensor name pattern>=<buffer type>, e.g. exps=CPU")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"invalid pattern {pattern!r}: {e}") from None
            out.append(one)
    return tuple(out)


def _number(v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError("use a valid number")
    return float(v)


def _split(v: Any) -> tuple[float, ...]:
    v = tuple(_number(x) for x in v)
    if any(x < 0 for x in v) or not any(x > 0 for x in v):
        raise ValueError("use non-negative proportions, at least one above 0 (e.g. 3,1)")
    return v


def _loras(v: Any) -> tuple[tuple[str, float], ...]:
    return tuple((_str(path), _number(scale)) for path, scale in v)


def _server_backends(v: Any) -> tuple[str, ...]:
    if not v:
        return ()
    from fitter.ggml.backends.rpc.backend import REMOTE_IDS  # the registry names an rpc-server's device reports

    return tuple(_one_of(*REMOTE_IDS)(k) for k in v)


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else check(v)


# llama_context_params.n_ctx is unsigned (0 = the training context); llama_init_from_model: a zero n_batch/n_ubatch
# leaves no batch to decode; common/arg.cpp --spec-draft-n-max, --n-cpu-moe: "invalid value" below 0; -mg indexes a
# device
_N_CTX = _at_least(0, "use a number of tokens, or 0 for the model's training context")
_BATCH = _at_least(1, "must be at least 1")
_COUNT = _at_least(0, "must be 0 or more")
_CHECKS: dict[str, Callable[[Any], Any]] = {
    "n_ctx": _optional(_N_CTX), "n_batch": _optional(_BATCH), "n_ubatch": _optional(_BATCH),
    "type_k": _kv_type, "type_v": _kv_type, "flash_attn": _one_of(*get_args(FlashAttn)),
    "n_parallel": _optional(_n_parallel), "kv_unified": _optional(_bool), "swa_full": _optional(_bool),
    "n_gpu_layers": _int, "no_mmap": _bool, "no_repack": _bool, "embeddings": _bool,
    "spec_type": _one_of(*get_args(SpecType)), "draft_model": _optional(_str), "draft_type_k": _kv_type,
    "draft_type_v": _kv_type, "draft_n_max": _COUNT, "n_cpu_moe": _COUNT, "cpu_moe": _bool,
    "override_tensor": _overrides, "no_kv_offload": _bool, "no_op_offload": _bool,
    "split_mode": _one_of(*get_args(SplitMode)), "main_gpu": _COUNT, "tensor_split": _optional(_split),
    "rpc": _optional(_str), "rpc_backends": _server_backends, "lora": _loras, "mmproj": _optional(_str), "no_mmproj_offload": _bool,
}


def _check_config(config: Any) -> None:
    """RunConfig's fields checked and normalised (cache types lowercased, -ot split at commas, sequences made
    tuples): a value llama.cpp would refuse is one ConfigError naming the flag."""
    for field, check in _CHECKS.items():
        v = getattr(config, field)
        try:
            checked = check(v)
        except (ValueError, TypeError) as e:
            raise _refusal(field, v, str(e) if isinstance(e, ValueError) else "invalid value") from None
        if checked is not v:
            object.__setattr__(config, field, checked)
