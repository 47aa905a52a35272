"""A run configuration in llama-server's own words, and the context parameters llama.cpp derives from it.

`RunConfig` holds what the user types (`-c`, `-b`, `-ub`, `-ctk`, `-ctv`, `-fa`, `-np`,
`--kv-unified`, `--swa-full`, `-ngl`, `--no-mmap`, speculative flags). Unset fields take the defaults
of the chosen front end: llama-server's (`common_params` plus tools/server/server.cpp) or the
library's (`llama_context_default_params`). The two differ in ways that move hundreds of MiB, so
`resolve_context` reports which defaults it applied.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple, Sequence

from fitter.errors import UnsupportedModelError
from fitter.ggml.backends.base import Backend as Backend  # re-exported: callers take it with RunConfig
from fitter.ggml.types import BLCK, GGML_TYPES, pad
from fitter.llama.flags import (  # noqa: F401  (re-exported: callers take them with RunConfig)
    _CHECKS,
    _LOAD_MODES,
    FLAG_OF,
    INT32_MAX,
    KV_CACHE_TYPES,
    LLAMA_MAX_SEQ,
    SERVER_FLAGS,
    ConfigError,
    FlashAttn,
    SpecType,
    SplitMode,
    _check_config,
    _convert,
    _value,
    lora_scaled,
)
from fitter.llama.hparams import LayerKind, ModelSpec
from fitter.llama_builds import PINNED, LlamaBuild
from fitter.llama_builds.changes import ARCHS_ADDED
from fitter.record import Record

SERVER_AUTO_SLOTS = 4  # tools/server/server.cpp: -np auto -> n_parallel = 4, kv_unified = true
# -b / -ub when not given: common_params (llama-server) and llama_context_default_params (the library) agree
DEFAULT_N_BATCH, DEFAULT_N_UBATCH = 2048, 512

# common/common.h: the tensor-name patterns --cpu-moe and --n-cpu-moe turn into overrides to the CPU buffer type
LLM_FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def llm_ffn_block_regex(il: int, ffn_regex: str = LLM_FFN_EXPS_REGEX) -> str:  # common/common.h llm_ffn_block_regex
    return rf"blk\.{il}{ffn_regex}"


class Frontend(str, Enum):
    SERVER = "server"  # llama-server: common_params defaults, -np auto = 4 slots with a unified KV cache
    LIBRARY = "library"  # llama_context_default_params(): what llama-cpp-python and raw API users get


class RunConfig(Record):
    """llama-server flags that change memory. None = the front end's default. Made, it checks and normalises its
    fields (_check_config): a value llama-server would refuse is a ConfigError naming the flag."""

    n_ctx: int | None = None  # -c; 0 = the model's training context
    n_batch: int | None = None  # -b
    n_ubatch: int | None = None  # -ub
    type_k: str = "f16"  # -ctk
    type_v: str = "f16"  # -ctv
    flash_attn: FlashAttn = "auto"  # -fa
    n_parallel: int | None = None  # -np; -1 = auto (server: 4 slots, unified KV)
    kv_unified: bool | None = None  # --kv-unified / --no-kv-unified
    swa_full: bool | None = None  # --swa-full
    n_gpu_layers: int = -1  # -ngl; -1 = all
    no_mmap: bool = False  # --no-mmap
    no_repack: bool = True  # --no-repack (llama_model_params.use_extra_bufts = false)
    embeddings: bool = False  # --embeddings
    # speculative decoding
    spec_type: SpecType = "none"  # --spec-type
    draft_model: str | None = None  # --model-draft
    draft_type_k: str = "f16"  # --spec-draft-type-k
    draft_type_v: str = "f16"  # --spec-draft-type-v
    draft_n_max: int = 3  # --spec-draft-n-max
    # placement (llama_model_params): where weights, KV and ops go
    n_cpu_moe: int = 0  # --n-cpu-moe: the expert weights of the first N layers stay on the CPU
    cpu_moe: bool = False  # --cpu-moe: every expert weight stays on the CPU
    override_tensor: tuple[str, ...] = ()  # -ot PATTERN=BUFT, in order (first match wins)
    no_kv_offload: bool = False  # -nkvo: the KV cache in host memory
    no_op_offload: bool = False  # --no-op-offload
    split_mode: SplitMode = "layer"  # -sm
    main_gpu: int = 0  # -mg
    tensor_split: tuple[float, ...] | None = None  # -ts: a proportion per GPU
    rpc: str | None = None  # --rpc HOST:PORT,...: rpc-servers whose devices (RPC0, ...) come first (Backend.RPC)
    # the backend each RPC device's server runs, llama.cpp's registry names in RPC order ("CPU", "CUDA"); not a
    # llama.cpp flag: ggfit reads it from the servers (--budget auto) or --rpc-backend; () or a missing one: CPU
    rpc_backends: tuple[str, ...] = ()
    # LoRA adapters (common_params.lora_adapters): --lora FILE (scale 1) / --lora-scaled FILE:SCALE, in order
    lora: tuple[tuple[str, float], ...] = ()
    # multimodal projector (mtmd_context_params): its weights and compute buffer (fitter.mtmd)
    mmproj: str | None = None  # --mmproj FILE
    no_mmproj_offload: bool = False  # --no-mmproj-offload: the projector on the CPU

    def __post_init__(self) -> None:
        _check_config(self)

    def tensor_overrides(self) -> list[tuple[str, str]]:
        """llama_model_params.tensor_buft_overrides as (pattern, buffer type name), first match wins: -ot, then
        --cpu-moe, then --n-cpu-moe's one pattern per layer (common/common.h llm_add_n_cpu_ffn_overrides).
        llama-server keeps the command line's order; ggfit writes and reads them in this one."""
        out = [(p, b) for p, _, b in (o.partition("=") for o in self.override_tensor)]
        if self.cpu_moe:
            out.append((LLM_FFN_EXPS_REGEX, "CPU"))
        out += [(llm_ffn_block_regex(il), "CPU") for il in range(self.n_cpu_moe)]
        return out

    def to_server_args(self, model: str | None = None, *, draft_model: str | None = None,
                       extra: Sequence[Sequence[str]] = ()) -> list[list[str]]:
        """llama-server's flags for this config, one group per flag ([flag] or [flag, value]): every field that is
        set (None is the front end's default and writes nothing), in the words of the pinned build's common/arg.cpp.
        `model`/`draft_model` are the paths to write for -m/-md (draft_model defaults to the config's own);
        `extra` groups go last. RunConfig.from_server_args reads them back into this very config."""
        out: list[list[str]] = [["-m", model]] if model else []
        for field, flag in _VALUE_FLAGS:
            v = getattr(self, field)
            if v is not None and v != _FIELD_DEFAULTS[field]:
                out.append([flag, str(v)])
        if self.kv_unified is not None:
            out.append(["--kv-unified" if self.kv_unified else "--no-kv-unified"])
        if self.swa_full:
            out.append(["--swa-full"])
        if self.n_gpu_layers != -1:
            out.append(["-ngl", str(self.n_gpu_layers)])
        if self.no_mmap:
            out.append(["-lm", "none"])  # arg.cpp of the pinned build: -lm/--load-mode (it has no --no-mmap)
        if self.embeddings:
            out.append(["--embeddings"])
        out += self.placement_args()
        if self.mmproj:
            out.append(["--mmproj", self.mmproj])
        if self.no_mmproj_offload:
            out.append(["--no-mmproj-offload"])
        out += self._draft_args(draft_model or self.draft_model)
        out.append(["--no-repack"] if self.no_repack else ["--repack"])
        return out + [list(g) for g in extra]

    def placement_args(self) -> list[list[str]]:
        out: list[list[str]] = [["--rpc", self.rpc]] if self.rpc else []
        out += [["-ot", o] for o in self.override_tensor]
        if self.cpu_moe:
            out.append(["--cpu-moe"])
        if self.n_cpu_moe:
            out.append(["--n-cpu-moe", str(self.n_cpu_moe)])
        if self.no_kv_offload:
            out.append(["-nkvo"])
        if self.no_op_offload:
            out.append(["--no-op-offload"])
        if self.split_mode != "layer":
            out.append(["-sm", self.split_mode])
        if self.main_gpu:
            out.append(["-mg", str(self.main_gpu)])
        if self.tensor_split is not None:
            out.append(["-ts", ",".join(f"{x:g}" for x in self.tensor_split)])
        for path, sc in self.lora:  # common/arg.cpp: --lora FNAME is scale 1.0
            out.append(["--lora", path] if sc == 1.0 else ["--lora-scaled", f"{path}:{sc!r}"])
        return out

    def _draft_args(self, draft: str | None) -> list[list[str]]:
        out: list[list[str]] = [["--spec-type", self.spec_type]] if self.spec_type != "none" else []
        if self.spec_type != "none" or self.draft_n_max != 3:
            out.append(["--spec-draft-n-max", str(self.draft_n_max)])
        if draft:
            out.append(["-md", draft])
        for field, flag in (("draft_type_k", "-ctkd"), ("draft_type_v", "-ctvd")):
            if getattr(self, field) != "f16":
                out.append([flag, getattr(self, field)])
        return out

    @classmethod
    def from_server_args(cls, args: Sequence[str]) -> ServerArgs:
        """llama-server flags as (RunConfig, the probe's options that are not RunConfig fields, flags ggfit does not
        know). `-lm none` is no_mmap. Unknown flags (with their value when the next word is not a flag) are returned
        as they are: llama-server accepts or refuses them itself. A known flag with a bad value raises ConfigError."""
        fields: dict[str, Any] = {}
        opts: dict[str, Any] = {}
        unknown: list[str] = []
        i = 0
        while i < len(args):
            a = args[i]
            name, eq, inline = a.partition("=") if a.startswith("--") else (a, "", "")
            entry = SERVER_FLAGS.get(name)
            if entry is None or (entry[1] == "load_mode" and _value(args, i, name, eq, inline)[0] not in _LOAD_MODES):
                unknown.append(a)
                if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
                    unknown.append(args[i + 1])
                    i += 1
                i += 1
                continue
            field, kind = entry
            if kind in ("true", "false"):
                fields[field] = kind == "true"
                i += 1
                continue
            val, i = _value(args, i, name, eq, inline)
            v = _convert(name, kind, val)
            if kind == "list":  # -ot appends (common_params.tensor_buft_overrides)
                v = (*fields.get(field, ()), v)
            elif kind in ("lora", "lora_scaled"):  # --lora / --lora-scaled append (common_params.lora_adapters)
                v = (*fields.get(field, ()), *v)
            if field.startswith("@"):
                opts[field[1:]] = v
            else:
                fields[field] = v
        return ServerArgs(_checked(fields, opts), opts, unknown)


class ServerArgs(NamedTuple):
    config: RunConfig
    options: dict[str, Any]  # threads, draft_p_min, draft_n_min: the probe's, not RunConfig fields
    unknown: list[str]


# RunConfig fields written as `flag value` when set and not llama-server's own default
_VALUE_FLAGS = (("n_ctx", "-c"), ("n_batch", "-b"), ("n_ubatch", "-ub"), ("type_k", "-ctk"), ("type_v", "-ctv"),
                ("flash_attn", "-fa"), ("n_parallel", "-np"))
_FIELD_DEFAULTS = {f: RunConfig.model_fields[f].default for f, _ in _VALUE_FLAGS}
def _checked(fields: dict[str, Any], opts: dict[str, Any]) -> RunConfig:
    """The RunConfig of parsed flags, refused as llama.cpp refuses it (one line naming the flag)."""
    if opts.get("threads") is not None and opts["threads"] < 1:
        raise ConfigError(f"-t {opts['threads']}: use 1 or more threads")
    if opts.get("draft_n_min") is not None and opts["draft_n_min"] < 0:
        raise ConfigError(f"--spec-draft-n-min {opts['draft_n_min']}: use 0 or more")
    if opts.get("draft_p_min") is not None and not 0 <= opts["draft_p_min"] <= 1:
        raise ConfigError(f"--spec-draft-p-min {opts['draft_p_min']}: use a probability from 0 to 1")
    config = RunConfig(**fields)
    # a probe runs these flags without a ggfit prediction: refuse an -b llama.cpp aborts on here already
    # (resolve_context applies the same rule, with the model's own defaults, to every prediction)
    if config.n_batch is not None:
        n_seq = SERVER_AUTO_SLOTS if config.n_parallel is None or config.n_parallel < 0 else config.n_parallel
        _check_batch_holds_slots(config, config.n_batch, n_seq, n_seq)
    return config


class ContextParams(Record):
    """llama_cparams as llama_context's constructor derives them (src/llama-context.cpp)."""

    frontend: Frontend
    n_ctx: int  # padded to 256
    n_ctx_seq: int
    n_seq_max: int
    n_batch: int
    n_ubatch: int
    n_outputs_max: int
    kv_unified: bool
    swa_full: bool
    flash_attn: bool
    type_k: str
    type_v: str
    n_rs_seq: int
    offload_kqv: bool
    embeddings: bool
    defaults_applied: dict[str, str]
    build: LlamaBuild = PINNED  # the llama.cpp build whose rules apply (fitter.llama_builds)
    # the V cache transposed (llama_model::create_memory: !cparams.flash_attn); None: not flash_attn. -fa auto that
    # resolve_fused_ops turns off keeps the cache made before it, with flash attention on: False
    v_trans: bool | None = None


def served_config(cp: ContextParams, config: RunConfig, draft_model: str | None) -> RunConfig:
    """The config that gives llama-server the resolved context `cp` with every value explicit (what `fit` prints to
    run): -np auto written as its slots and unified cache, -fa auto as what it resolved to (but where it went off
    after the caches were made, v_trans False: -fa off would transpose V, so it stays auto). Without `draft_model`
    the external draft is dropped (a solution without it); a native MTP head stays."""
    fa = "auto" if cp.v_trans is False and not cp.flash_attn else "on" if cp.flash_attn else "off"
    update: dict[str, Any] = {
        "n_ctx": cp.n_ctx, "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch, "type_k": cp.type_k, "type_v": cp.type_v,
        "flash_attn": fa, "n_parallel": cp.n_seq_max, "kv_unified": cp.kv_unified,
        "swa_full": cp.swa_full, "draft_model": draft_model,
    }
    if draft_model is None and config.spec_type == "draft-simple":
        update["spec_type"] = "none"
    if draft_model is None and update.get("spec_type", config.spec_type) == "none":
        update.update(draft_type_k="f16", draft_type_v="f16")  # no draft context: its cache types mean nothing
    return config.model_copy(update=update)


class _Defaults(NamedTuple):
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_parallel: int
    kv_unified: bool
    swa_full: bool


def _front_end_defaults(config: RunConfig, frontend: Frontend, applied: dict[str, str],
                        build: LlamaBuild = PINNED) -> _Defaults:
    """The config with the front end's defaults filled in: common/common.h common_params (+ tools/server/server.cpp)
    vs llama_context_default_params (src/llama-context.cpp); each default applied is noted in `applied`."""

    def default(name: str, value: Any, why: str) -> Any:
        applied[name] = f"{value} ({why})"
        return value

    n_ctx = config.n_ctx if config.n_ctx is not None else default("n_ctx", 0, "training context")
    why = "llama-server default" if frontend == Frontend.SERVER else "library default"
    n_batch = config.n_batch if config.n_batch is not None else default("n_batch", DEFAULT_N_BATCH, why)
    n_ubatch = config.n_ubatch if config.n_ubatch is not None else default("n_ubatch", DEFAULT_N_UBATCH, why)
    if frontend == Frontend.SERVER:
        n_parallel = config.n_parallel if config.n_parallel is not None else -1
        kv_unified = config.kv_unified if config.kv_unified is not None else False
        if n_parallel < 0 and not build.has("server_np_auto"):
            # before #16736 (0.3.16 common/common.h common_params): one slot, no unified cache
            n_parallel = default("n_parallel", 1, f"llama-server default in {build.label()}")
        if n_parallel < 0:
            # tools/server/server.cpp: "n_parallel is set to auto, using n_parallel = 4 and kv_unified = true"
            n_parallel = SERVER_AUTO_SLOTS
            kv_unified = True
            applied["n_parallel"] = f"{SERVER_AUTO_SLOTS} (llama-server -np auto)"
            applied["kv_unified"] = "true (llama-server -np auto)"
        swa_full = config.swa_full if config.swa_full is not None else default("swa_full", False, why)
    else:
        n_parallel = config.n_parallel if config.n_parallel is not None else default("n_parallel", 1, why)
        if n_parallel < 1:
            raise ConfigError(f"-np {n_parallel}: the library needs at least one sequence")
        kv_unified = config.kv_unified if config.kv_unified is not None else default("kv_unified", False, why)
        swa_full = config.swa_full if config.swa_full is not None else default("swa_full", True, why)
    if n_parallel == 0:
        raise ConfigError("-np 0: invalid value for n_parallel")
    return _Defaults(n_ctx, n_batch, n_ubatch, n_parallel, kv_unified, swa_full)


def _check_batch_holds_slots(config: RunConfig, n_batch: int, n_seq_max: int, n_parallel: int) -> None:
    """llama_context::llama_context reserves outputs for one token per sequence, output_reserve(n_seq_max), which
    asserts n_seq_max <= cparams.n_outputs_max; that is at most n_batch (server_output_limits caps it at n_batch,
    the library's is n_batch itself): n_batch must hold a token of every sequence."""
    if n_batch >= n_seq_max:
        return
    slots = f"-np {n_parallel}" + (" (auto)" if config.n_parallel is None or config.n_parallel < 0 else "")
    why = (f"llama.cpp needs n_batch >= n_seq_max ({n_seq_max}, {slots}), else it aborts in output_reserve "
           f"(GGML_ASSERT n_outputs_max <= cparams.n_outputs_max)")
    if config.n_batch is not None and config.n_batch < n_seq_max:
        raise ConfigError(f"-b {config.n_batch}: {why}; use -b {n_seq_max} or more, or fewer slots")
    raise ConfigError(f"-c {config.n_ctx}: llama.cpp caps n_batch at n_ctx ({n_batch}), and {why}; "
                      f"use -c {n_seq_max} or more (llama.cpp rounds n_ctx up to 256 anyway), or fewer slots")


def _check_cache_types(spec: ModelSpec, config: RunConfig, build: LlamaBuild = PINNED) -> bool:
    """flash_attn as llama_init_from_model resolves it, after refusing the K/V cache types llama.cpp refuses."""
    quant_v = BLCK[GGML_TYPES[config.type_v]] > 1
    if config.flash_attn == "auto" and not build.has("fa_default_auto"):
        # before flash_attn_type (0.3.16 llama_context_params.flash_attn, a bool): no auto, off unless asked for
        config = config.model_copy(update={"flash_attn": "off"})
    # llama_init_from_model: quantized V needs flash attention; auto is switched on for it
    if config.flash_attn == "off" and quant_v:
        raise ConfigError(f"-ctv {config.type_v} with -fa off: llama.cpp refuses a quantized V cache without flash attention")
    flash_attn = config.flash_attn != "off"  # auto resolves to enabled when every layer's KV sits with its FA op
    if spec.is_mla and config.type_k != config.type_v:
        raise ConfigError(f"{spec.architecture} (MLA) does not support different K ({config.type_k}) and V ({config.type_v}) cache types")
    # llama_init_from_model: the block check applies to -fa auto only before 0.3.23, to -fa on as well since
    if config.flash_attn == "auto" or (flash_attn and build.has("quant_kv_block_check_fa_on")):
        for tname, name, attr in ((config.type_k, "K", "n_embd_head_k"), (config.type_v, "V", "n_embd_head_v")):
            block = BLCK[GGML_TYPES[tname]]
            if block > 1:
                for layer in spec.layers[: spec.n_layer]:
                    if layer.kind != LayerKind.RECURRENT and getattr(layer, attr) % block:
                        raise ConfigError(
                            f"{name} cache type {tname} with block size {block} does not divide "
                            f"{attr}={getattr(layer, attr)}"
                        )
    elif flash_attn:
        # unchecked (0.3.20 llama_init_from_model): a cache row that is not whole blocks makes a K/V view overrun its
        # cache, and llama.cpp aborts in ggml_new_tensor_impl (GGML_ASSERT ... <= ggml_nbytes(view_src))
        for tname, name, attr in ((config.type_k, "K", "n_embd_k_gqa"), (config.type_v, "V", "n_embd_v_gqa")):
            block = BLCK[GGML_TYPES[tname]]
            for layer in spec.layers[: spec.n_layer]:
                if block > 1 and layer.kind != LayerKind.RECURRENT and getattr(layer, attr) % block:
                    raise ConfigError(f"{build.label()} aborts with a {name} cache of type {tname}: {attr}="
                                      f"{getattr(layer, attr)} is not a multiple of its block size {block}")
    return flash_attn


_ARCHS_ADDED = {a.arch: a for a in ARCHS_ADDED}


def check_arch_known(architecture: str, build: LlamaBuild) -> None:
    """Refuse a model the build cannot load: its architecture was added to llama.cpp after the build (llama_model_loader:
    "unknown model architecture"). fitter.llama_builds.changes.ARCHS_ADDED dates each one."""
    a = _ARCHS_ADDED.get(architecture)
    if a is None:
        return
    known = build.number >= a.first_build if a.first_build is not None and build.number is not None else build.date >= a.date
    if not known:
        raise UnsupportedModelError(
            f"{build.label()} does not know architecture {architecture} (added by PR "
            f"{', '.join(f'#{n}' for n in a.prs)}, {'about ' if a.window else ''}{a.date}); use a later build")


def resolve_context(spec: ModelSpec, config: RunConfig, frontend: Frontend, *, mtp: bool = False,
                    build: LlamaBuild = PINNED) -> ContextParams:
    """Mirror llama_context::llama_context's cparams, after the front end's defaults, for `build`."""
    check_arch_known(spec.architecture, build)
    applied: dict[str, str] = {}
    d = _front_end_defaults(config, frontend, applied, build)
    if not d.kv_unified and not build.has("kv_set_rows_default"):
        # before #14959 (0.3.15 llama_context::llama_context, LLAMA_SET_ROWS=0): "non-unified KV cache requires
        # ggml_set_rows() - forcing unified KV cache"
        d = d._replace(kv_unified=True)
        applied["kv_unified"] = f"true ({build.label()} needs LLAMA_SET_ROWS=1 for a non-unified KV cache)"
    n_seq_max = max(1, d.n_parallel)
    # llama_context::llama_context: LLAMA_MAX_SEQ was 64 before #15916 (0.3.16 src/llama-cparams.h)
    max_seq = LLAMA_MAX_SEQ if build.has("max_seq_256") else 64
    if n_seq_max > max_seq:
        raise ConfigError(f"-np {n_seq_max}: n_seq_max must be <= {max_seq}" +
                          ("" if max_seq == LLAMA_MAX_SEQ else f" in {build.label()}"))
    if config.spec_type == "draft-mtp" and not build.has("mtp_context"):
        raise ConfigError(f"--spec-type draft-mtp: {build.label()} has no MTP draft context "
                          "(LLAMA_CONTEXT_TYPE_MTP came with llama-cpp-python 0.3.25's llama.cpp)")

    n_ctx = d.n_ctx or spec.n_ctx_train
    # causal models: n_batch <= n_ctx, n_ubatch <= n_batch (llama_context::llama_context)
    n_batch = min(n_ctx, d.n_batch)
    if not build.has("kq_mask_batch_pad_64"):
        n_batch = max(n_batch, 64)  # 0.3.16 llama_context::llama_context: n_batch at least GGML_KQ_MASK_PAD
    n_ubatch = min(n_batch, d.n_ubatch)
    _check_batch_holds_slots(config, n_batch, n_seq_max, d.n_parallel)

    # n_outputs_max: the server caps outputs per batch by slots x (1 + draft tokens)
    # (server_output_limits / common_speculative_get_output_limits); the library reserves n_batch.
    n_draft = config.draft_n_max if config.spec_type != "none" else 0
    if frontend == Frontend.SERVER and not config.embeddings:
        n_outputs_max = max(1, min(n_batch, d.n_parallel * (1 + n_draft)))
    else:
        n_outputs_max = n_batch

    flash_attn = _check_cache_types(spec, config, build)
    n_ctx, n_ctx_seq = _padded_ctx(n_ctx, n_seq_max, d.kv_unified, flash_attn, build)

    # common_params_speculative::need_n_rs_seq: MTP keeps draft.n_max recurrent snapshots per sequence
    # (clamped to 0 for architectures without recurrent rollback: llm_arch_supports_rs_rollback)
    n_rs_seq = config.draft_n_max if config.spec_type == "draft-mtp" and spec.supports_rs_rollback and not mtp else 0

    return ContextParams(
        frontend=frontend, n_ctx=n_ctx, n_ctx_seq=n_ctx_seq, n_seq_max=n_seq_max, n_batch=n_batch,
        n_ubatch=n_ubatch, n_outputs_max=n_outputs_max, kv_unified=d.kv_unified, swa_full=d.swa_full,
        flash_attn=flash_attn, type_k=config.type_k, type_v=config.type_v, n_rs_seq=n_rs_seq, offload_kqv=True,
        embeddings=config.embeddings, defaults_applied=applied, build=build,
    )


def _padded_ctx(n_ctx: int, n_seq_max: int, kv_unified: bool, flash_attn: bool, build: LlamaBuild) -> tuple[int, int]:
    """(n_ctx, n_ctx_seq) as llama_context::llama_context pads them: n_ctx to 256, each stream's share too."""
    if not build.has("kv_size_pad_backend"):
        # before #16812/#17046 (0.3.16 llama_model::create_memory): n_ctx is not padded; the cache of each stream
        # is, to llama_kv_cache_unified::get_padding (256 with flash attention, 32 without)
        n_pad = 256 if flash_attn else 32
        n_ctx_seq = pad(n_ctx if kv_unified else -(-n_ctx // n_seq_max), n_pad)
        return (n_ctx_seq if kv_unified else n_ctx_seq * n_seq_max), n_ctx_seq
    n_ctx = pad(n_ctx, 256)
    if kv_unified:
        return n_ctx, n_ctx
    n_ctx_seq = pad(n_ctx // n_seq_max, 256)
    if n_ctx_seq == 0:
        raise ConfigError("n_ctx_seq == 0")
    return n_ctx_seq * n_seq_max, n_ctx_seq


def reserve_ubatch(cp: ContextParams) -> tuple[int, int, int, bool]:
    """The ubatch llama_context::sched_reserve builds the graph for: (n_tokens, n_outputs, n_seqs, whether n_tokens was
    rounded up to a multiple of n_seqs). Its K/V streams: 1 with kv_unified, else n_seqs."""
    n_seqs = cp.n_seq_max
    if not cp.build.has("reserve_n_seqs_unified"):
        n_seqs = 1 if cp.kv_unified else n_seqs  # llama_context::llama_context (0.3.16): unified reserves 1 seq
    n_tokens = min(cp.n_ctx, cp.n_ubatch)  # llama_context::sched_reserve
    n_outputs = min(n_tokens, cp.n_outputs_max)
    rounded = n_tokens % n_seqs != 0
    if rounded:  # llama_context::graph_reserve
        n_tokens = (n_tokens + n_seqs - 1) // n_seqs * n_seqs
    if not cp.build.has("logits_whole_ubatch"):
        # before #23861, llama_context::llama_context: graph_reserve(n_tokens, n_seqs, n_tokens) (0.3.23)
        n_outputs = n_tokens
    return n_tokens, n_outputs, n_seqs, rounded
