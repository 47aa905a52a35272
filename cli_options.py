"""ggfit's command-line options: the llama-server flags by their llama.cpp names (common/arg.cpp), ggfit's own, and
what turns them into fitter's values. cli.py's commands declare their parameters with these.

No `from __future__ import annotations`: typer reads the aliases as objects (see cli.py)."""

import functools
import inspect
import shutil
from enum import Enum
from typing import Annotated, Any, Callable, Optional

import typer


class BackendName(str, Enum):
    """fitter's Backend values (tests/test_bad_invocations.py checks they agree), without importing fitter for --help."""

    metal = "metal"
    cuda = "cuda"
    cpu = "cpu"
    rpc = "rpc"
    rpc_cuda = "rpc-cuda"


class FrontendName(str, Enum):
    """fitter's Frontend values: whose defaults apply."""

    server = "server"
    library = "library"


class FlashAttnMode(str, Enum):
    on = "on"
    off = "off"
    auto = "auto"


class RunnerName(str, Enum):
    python = "python"
    server = "server"
    openai = "openai"
    mlx = "mlx"


class EngineName(str, Enum):
    llama = "llama"
    mlx = "mlx"


class PromptKind(str, Enum):
    prose = "prose"
    code = "code"


MODEL_HELP = "A GGUF path, an http(s) URL (read by Range requests), or a bundled model name (gemma3-270m)."
SIZE_HELP = "a number with a unit: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB (25559MiB, 24GiB, 26800MB)"

# One definition per option shared by several commands: the llama-server flags (their llama.cpp names and
# meaning, common/arg.cpp) and ggfit's own budget/backend options.
BudgetOpt = Annotated[str, typer.Option("--budget", metavar="SIZE", help=f"Memory to fit into: {SIZE_HELP}, or auto (the device's own limit); one per GPU separated by commas (24GiB,24GiB).")]
MarginOpt = Annotated[Optional[str], typer.Option("--margin", metavar="SIZE", help=f"Kept free on top of the prediction: {SIZE_HELP} (default: what the backend holds outside its buffers: CUDA 1028MiB and CPU 304MiB with a 256 MiB safety share, Metal 628MiB bounded by the configs that ran and ran out of memory).")]
BackendOpt = Annotated[Optional[BackendName], typer.Option("--backend", help="The device's backend (default: this machine's).")]
FrontendOpt = Annotated[FrontendName, typer.Option("--frontend", help="Whose defaults apply: server (llama-server) or library (llama_context_default_params).")]
Ctx = Annotated[Optional[int], typer.Option("-c", "--ctx-size", metavar="N", help="n_ctx: context size in tokens, 0 = the model's training context (fit: omit to solve for the largest that fits).")]
Batch = Annotated[Optional[int], typer.Option("-b", "--batch-size", metavar="N", help="n_batch: logical maximum batch size (default 2048; llama.cpp caps it at n_ctx).")]
UBatch = Annotated[Optional[int], typer.Option("-ub", "--ubatch-size", metavar="N", help="n_ubatch: physical maximum batch size (default 512; llama.cpp caps it at n_batch).")]
CacheK = Annotated[Optional[str], typer.Option("-ctk", "--cache-type-k", metavar="TYPE", help="KV cache type for K: f32, f16 (default), bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1.")]
CacheV = Annotated[Optional[str], typer.Option("-ctv", "--cache-type-v", metavar="TYPE", help="KV cache type for V (same types as -ctk; quantized V needs flash attention).")]
FlashAttn = Annotated[FlashAttnMode, typer.Option("-fa", "--flash-attn", help="Flash attention.")]
Parallel = Annotated[Optional[int], typer.Option("-np", "--parallel", metavar="N", help="n_seq_max: server slots, 1..256, or -1 = auto (llama-server: 4 slots with a unified KV cache).")]
KVUnified = Annotated[Optional[bool], typer.Option("-kvu/-no-kvu", "--kv-unified/--no-kv-unified", help="One KV buffer shared by all slots (default: on with -np auto).")]
SwaFull = Annotated[Optional[bool], typer.Option("--swa-full/--no-swa-full", help="Full-size sliding-window KV cache (llama-server default: off).")]
GpuLayers = Annotated[int, typer.Option("-ngl", "--gpu-layers", "--n-gpu-layers", metavar="N", help="Layers on the GPU; -1 = all.")]
NCpuMoe = Annotated[int, typer.Option("-ncmoe", "--n-cpu-moe", metavar="N", help="Keep the MoE expert weights of the first N layers on the CPU.")]
CpuMoe = Annotated[bool, typer.Option("-cmoe", "--cpu-moe", help="Keep every MoE expert weight on the CPU.")]
OverrideTensor = Annotated[Optional[list[str]], typer.Option("-ot", "--override-tensor", metavar="PATTERN=BUFT", help="Tensors whose name matches the regex go to that buffer type: CPU, CUDA0, CUDA1, ... (repeatable; comma-separated lists too).")]
Lora = Annotated[Optional[list[str]], typer.Option("--lora", metavar="FILE", help="A LoRA adapter GGUF, scale 1 (repeatable; comma-separated lists too): its buffers and its graph nodes.")]
LoraScaled = Annotated[Optional[list[str]], typer.Option("--lora-scaled", metavar="FILE:SCALE", help="A LoRA adapter with its scale (repeatable; comma-separated lists too; after the --lora ones).")]
NoKvOffload = Annotated[bool, typer.Option("-nkvo", "--no-kv-offload", help="Keep the KV cache (and recurrent state) in host memory.")]
NoOpOffload = Annotated[bool, typer.Option("--no-op-offload", help="Do not run ops on host weights on the GPU.")]
SplitModeOpt = Annotated[str, typer.Option("-sm", "--split-mode", metavar="none|layer|row", help="How to split the model across GPUs (default layer; row is refused: the pinned build fails it).")]
MainGpu = Annotated[int, typer.Option("-mg", "--main-gpu", metavar="INDEX", help="The GPU for the whole model with -sm none.")]
RpcBackend = Annotated[Optional[str], typer.Option("--rpc-backend", metavar="CPU|CUDA|MTL,...", help="The backend each --rpc server runs (rpc-server -d CPU, -d CUDA0, or -d MTL0 on a Mac: MTL or METAL), one per server or one for all; --budget auto asks the servers instead. Default CPU.")]
Rpc = Annotated[Optional[str], typer.Option("--rpc", metavar="HOST:PORT,...", help="llama.cpp's RPC servers (rpc-server), as llama-server reads them: their devices RPC0, RPC1, ... come before local ones; --budget per device or auto (asks each server).")]
TensorSplit = Annotated[Optional[str], typer.Option("-ts", "--tensor-split", metavar="N0,N1,...", help="Proportion of the layers per GPU, e.g. 3,1 (default: the --budget values).")]
HostBudgetOpt = Annotated[Optional[str], typer.Option("--host-budget", metavar="SIZE", help=f"System RAM that may hold weights on the CPU, KV on the host and host buffers: {SIZE_HELP}, or auto (default: the RAM available now).")]
Mmproj = Annotated[Optional[str], typer.Option("-mm", "--mmproj", metavar="FILE", help="A multimodal projector (mmproj GGUF): its weights and compute buffer are counted.")]
NoMmprojOffload = Annotated[bool, typer.Option("--no-mmproj-offload", help="Keep the multimodal projector on the CPU.")]
NoMmap = Annotated[bool, typer.Option("--no-mmap", help="Read the weights into memory instead of mapping the file.")]
Repack = Annotated[bool, typer.Option("--repack/--no-repack", help="llama.cpp's extra CPU buffer types (off by default: they crash on AMX machines).")]
ModelDraft = Annotated[Optional[str], typer.Option("-md", "--model-draft", metavar="MODEL", help="A draft model for speculative decoding (path, URL or bundled name).")]
SpecType = Annotated[Optional[str], typer.Option("--spec-type", metavar="TYPE", help="Speculative decoding: draft-simple (with -md) or draft-mtp (the model's MTP head).")]
DraftTypeK = Annotated[str, typer.Option("--spec-draft-type-k", metavar="TYPE", help="KV cache type for K of the draft context.")]
DraftTypeV = Annotated[str, typer.Option("--spec-draft-type-v", metavar="TYPE", help="KV cache type for V of the draft context.")]
DraftNMax = Annotated[int, typer.Option("--spec-draft-n-max", metavar="N", help="Tokens drafted per step (default 3).")]
ENGINE_HELP = ("llama (llama.cpp, a GGUF) or mlx (mlx-lm, an MLX model directory or its URL); optimise takes llama,mlx: "
               "engine searched as a parameter, MODELS a GGUF and its MLX directory, as in compare-engines.")
EngineOpt = Annotated[EngineName, typer.Option("--engine", help=ENGINE_HELP)]
EnginesOpt = Annotated[Optional[str], typer.Option("--engine", metavar="ENGINE[,ENGINE]", help=ENGINE_HELP)]
MaxKvSize = Annotated[Optional[int], typer.Option("--max-kv-size", metavar="N", help="mlx: RotatingKVCache of N tokens (models without their own make_cache).")]
KvBits = Annotated[Optional[int], typer.Option("--kv-bits", metavar="N", help="mlx: QuantizedKVCache bits (4 or 8; mlx also takes 2, 3, 5, 6).")]
KvGroupSize = Annotated[int, typer.Option("--kv-group-size", metavar="N", help="mlx: KV quantization group size (default 64).")]
QuantizedKvStart = Annotated[int, typer.Option("--quantized-kv-start", metavar="N", help="mlx: tokens before the KV cache is quantized (default 5000).")]
PrefillStep = Annotated[int, typer.Option("--prefill-step-size", metavar="N", help="mlx: prompt tokens per prefill step (default 2048).")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", metavar="N", help="mlx: tokens generated per request, budgeted with the prompt in -c (default 512).")]
PromptCacheBytes = Annotated[Optional[str], typer.Option("--prompt-cache-bytes", metavar="SIZE", help="mlx: mlx_lm.server's prompt cache ceiling, in bytes or with a unit (default: unbounded).")]
PromptCacheSize = Annotated[int, typer.Option("--prompt-cache-size", metavar="N", help="mlx: mlx_lm.server's prompt cache entries (default 10; 0: off).")]
# llama-server's memory after load, over a session (issue 48; fitter.session): its cache flags and the session shown
CacheRam = Annotated[Optional[int], typer.Option("-cram", "--cache-ram", metavar="N", help="llama-server's host prompt cache limit in MiB (default 8192; -1 = no size limit, then at most n_ctx tokens; 0 = off): counted in the session ceiling.")]
CtxCheckpoints = Annotated[Optional[int], typer.Option("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", metavar="N", help="Context checkpoints per slot (default 32; SWA and recurrent models): counted in the session ceiling.")]
CheckpointMinStep = Annotated[Optional[int], typer.Option("-cms", "--checkpoint-min-step", metavar="N", help="Minimum spacing of context checkpoints in tokens (default 8192).")]
CacheIdleSlots = Annotated[Optional[bool], typer.Option("--cache-idle-slots/--no-cache-idle-slots", help="Save idle slots into the prompt cache when a task starts (default on; off with --cache-ram 0).")]
SessionRequests = Annotated[Optional[int], typer.Option("--session-requests", metavar="N", min=1, help="The session fit shows: what llama-server holds after N requests of distinct prompts (default 100), beside its ceiling; mlx: the peak after N requests of -c (default: its limit only).")]
SessionPrompt = Annotated[Optional[int], typer.Option("--session-prompt", metavar="P", min=1, help="Prompt tokens per request of the session (default: 4096, at most the slot's context less --session-gen).")]
SessionGen = Annotated[int, typer.Option("--session-gen", metavar="G", min=1, help="Tokens generated per request of the session (default 256).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
RunnerOpt = Annotated[RunnerName, typer.Option("--runner", help="python (llama-cpp-python in a child process), server (llama-server) or, for probe, openai (any OpenAI-compatible server at --url) or mlx (mlx_lm.server on an MLX model directory; further arguments are its flags).")]
LlamaServerOpt = Annotated[Optional[str], typer.Option("--llama-server", metavar="PATH", help="A llama-server binary: the one the server runner starts (default: ggfit's pinned build, then PATH), and the one --llama-build auto asks for its build.")]
LlamaBuildOpt = Annotated[Optional[str], typer.Option(
    "--llama-build", metavar="BUILD",
    help="The llama.cpp build whose rules apply: a build number (b9430), a commit prefix, a date (2026-06-15), a "
         "llama-cpp-python version (0.3.25), a llama.cpp log file, or auto (runs --llama-server PATH or the "
         "llama-server on PATH with --version). Default: ggfit's pinned build (calibrate --log: the log's build line).")]
PromptTokensOpt = Annotated[int, typer.Option("--prompt-tokens", help="Prompt length per request, in the model's tokens (1 or more).")]
GenTokensOpt = Annotated[int, typer.Option("--gen-tokens", help="Tokens to decode after the prompt (1 or more).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="The sampler's seed (optimise: leave unset when several workers share a study; compare-engines: default 0).")]
TrialsOpt = Annotated[Optional[int], typer.Option("--trials", help="Probes to run in all (optimise: default the study's budget; compare-engines: default 8, 2 or more, both engines' defaults first).")]
StorageOpt = Annotated[Optional[str], typer.Option("--storage", metavar="URL", help="Optuna storage URL (sqlite:///path.db, postgresql://...) or a .db path (default: sqlite under ~/.local/share/ggfit).")]

# the speed model's (issue 46): the hardware whose rates are predicted, the host side of partial offload, -t
HardwareOpt = Annotated[str, typer.Option("--hardware", metavar="NAME|auto", help="The hardware whose prefill and decode rates are predicted: a profile (ggfit hardware lists them: apple-m4-pro-20, nvidia-rtx-4090, cpu, ...) or auto (this machine: its Apple chip and GPU cores, its NVIDIA GPU, else cpu). It sets the backend when --backend is not given.")]
HostBandwidthOpt = Annotated[Optional[str], typer.Option("--host-bandwidth", metavar="RATE", help="Host memory bandwidth for weights on the CPU: 90GB/s, 900MB/s, 1.2TB/s (default: measured once on this machine and cached, with --hardware auto).")]
Threads = Annotated[Optional[int], typer.Option("-t", "--threads", metavar="N", help="llama.cpp's -t: CPU threads for the layers and experts on the CPU (default: llama.cpp's, the physical cores).")]
SpeedPromptOpt = Annotated[int, typer.Option("--speed-prompt", metavar="N", help="The prompt of the predicted prefill rate: llama-bench's pp<N> (default 512).")]
SpeedDepthOpt = Annotated[int, typer.Option("--speed-depth", metavar="D", help="Context depth of the predicted rates: llama-bench's -d (default 0).")]
RpcBandwidthOpt = Annotated[Optional[str], typer.Option("--rpc-bandwidth", metavar="RATE", help="With --rpc: the network to the rpc-servers, for the predicted rates: 1GbE, 2.5GbE, 10GbE, 25GbE, localhost, a bit rate (1Gbit/s, 10Gbps) or a byte rate (110MB/s) (default: localhost when every server is on 127.0.0.1 or localhost, else 1GbE).")]
RpcLatencyOpt = Annotated[Optional[str], typer.Option("--rpc-latency", metavar="MS", help="With --rpc: one round trip to the rpc-servers, as ping shows it: 0.3, 0.3ms, 300us (default: the --rpc-bandwidth preset's; 1GbE 0.2 ms, 10GbE 0.1 ms, localhost 0.03 ms).")]
NoSpeedOpt = Annotated[bool, typer.Option("--no-speed", help="Predict no prefill and decode rates (and detect no hardware).")]

CheckOpt = Annotated[bool, typer.Option("--check", help="Also run llama.cpp's own dry run on this config and compare.")]
LlamaBinOpt = Annotated[Optional[str], typer.Option("--llama-bin", metavar="DIR", help="Your llama.cpp's binaries: its build's rules apply (unless --llama-build says otherwise), and --check runs its llama-fit-params.")]


# --- option groups: the options several commands share, declared once ---------------------------------------------
# A group is a class of the aliases above (OptionGroup). A command's parameter typed with a group (`speed: SpeedOptions`)
# takes the group's fields as its options, in the group's order, and the command receives the group (`with_groups`).
# A new option of a shared kind is a field of its group; a new kind of options is a new group.


class OptionGroup:
    """The base of the option groups (with_groups expands a parameter typed with a subclass): each annotated class
    attribute is an option, its value the default. (Not a dataclass: the decorator compiles methods per class, about
    0.4 ms each at every command's import.)"""

    def __init__(self, **values: Any) -> None:
        for name in type(self).__annotations__:
            setattr(self, name, values.get(name, getattr(type(self), name)))

    @classmethod
    def options(cls) -> list[inspect.Parameter]:
        """The group's options as keyword parameters of a command (typer reads their Annotated types)."""
        return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(cls, name), annotation=ann)
                for name, ann in cls.__annotations__.items()]


class BudgetOptions(OptionGroup):
    """--budget, --margin, --backend: what to fit into, on which backend (fit, quants, optimise)."""

    budget: BudgetOpt = "auto"
    margin: MarginOpt = None
    backend: BackendOpt = None


class ContextOptions(OptionGroup):
    """llama.cpp's context flags (fit, quants)."""

    n_ctx: Ctx = None
    n_batch: Batch = None
    n_ubatch: UBatch = None
    type_k: CacheK = None
    type_v: CacheV = None
    flash_attn: FlashAttn = FlashAttnMode.auto
    n_parallel: Parallel = None


class PlacementOptions(OptionGroup):
    """Where the weights and the KV cache go (fit, quants, optimise)."""

    n_gpu_layers: GpuLayers = -1
    n_cpu_moe: NCpuMoe = 0
    cpu_moe: CpuMoe = False
    override_tensor: OverrideTensor = None
    no_kv_offload: NoKvOffload = False


class AdapterOptions(OptionGroup):
    """LoRA adapters and a multimodal projector beside the model (fit, quants, optimise)."""

    lora: Lora = None
    lora_scaled: LoraScaled = None
    mmproj: Mmproj = None
    no_mmproj_offload: NoMmprojOffload = False


class ServerOptions(OptionGroup):
    """fit's further llama-server flags: the KV cache's layout, several GPUs, host memory, how weights load."""

    kv_unified: KVUnified = None
    swa_full: SwaFull = None
    no_op_offload: NoOpOffload = False
    split_mode: SplitModeOpt = "layer"
    main_gpu: MainGpu = 0
    tensor_split: TensorSplit = None
    rpc: Rpc = None
    rpc_backend: RpcBackend = None
    host_budget: HostBudgetOpt = None
    no_mmap: NoMmap = False
    repack: Repack = False


class SessionOptions(OptionGroup):
    """llama-server's memory after load, over a session of requests (fit; issue 48, fitter.session)."""

    cache_ram: CacheRam = None
    ctx_checkpoints: CtxCheckpoints = None
    checkpoint_min_step: CheckpointMinStep = None
    cache_idle_slots: CacheIdleSlots = None
    session_requests: SessionRequests = None
    session_prompt: SessionPrompt = None
    session_gen: SessionGen = 256


class DraftOptions(OptionGroup):
    """Speculative decoding: a draft model or the model's MTP head (fit)."""

    model_draft: ModelDraft = None
    spec_type: SpecType = None
    draft_type_k: DraftTypeK = "f16"
    draft_type_v: DraftTypeV = "f16"
    draft_n_max: DraftNMax = 3


class BuildOptions(OptionGroup):
    """Whose llama.cpp rules apply (fit, quants, optimise)."""

    llama_build: LlamaBuildOpt = None
    llama_server: LlamaServerOpt = None


class SpeedOptions(OptionGroup):
    """The speed model's settings (issue 46; fit, quants)."""

    hardware: HardwareOpt = "auto"
    host_bandwidth: HostBandwidthOpt = None
    threads: Threads = None
    speed_prompt: SpeedPromptOpt = 512
    speed_depth: SpeedDepthOpt = 0
    rpc_bandwidth: RpcBandwidthOpt = None
    rpc_latency: RpcLatencyOpt = None
    no_speed: NoSpeedOpt = False


class MlxOptions(OptionGroup):
    """mlx-lm's own settings (fit --engine mlx)."""

    max_kv_size: MaxKvSize = None
    kv_bits: KvBits = None
    kv_group_size: KvGroupSize = 64
    quantized_kv_start: QuantizedKvStart = 5000
    prefill_step_size: PrefillStep = 2048
    max_tokens: MaxTokens = 512
    prompt_cache_bytes: PromptCacheBytes = None
    prompt_cache_size: PromptCacheSize = 10


class with_groups:  # noqa: N801  (a decorator)
    """The command with each parameter typed with an OptionGroup spread into the group's options (what typer sees, in
    place), and the group built again from them when it runs. The spread signature is made when typer first asks for
    it: typer builds the parameters of the one command that runs (cli.app_for), so the others cost nothing."""

    __wrapped__: Callable[..., Any]

    def __init__(self, command: Callable[..., Any]) -> None:
        functools.update_wrapper(self, command, assigned=("__module__", "__name__", "__qualname__", "__doc__"))

    @functools.cached_property
    def _spread(self) -> tuple[inspect.Signature, dict[str, tuple[type[OptionGroup], list[str]]]]:
        sig = inspect.signature(self.__wrapped__)
        params: list[inspect.Parameter] = []
        groups: dict[str, tuple[type[OptionGroup], list[str]]] = {}
        for p in sig.parameters.values():
            group = p.annotation
            if not (isinstance(group, type) and issubclass(group, OptionGroup)):
                params.append(p)
                continue
            options = group.options()
            groups[p.name] = (group, [o.name for o in options])
            params += options
        return sig.replace(parameters=params), groups

    @functools.cached_property
    def __signature__(self) -> inspect.Signature:
        return self._spread[0]

    @functools.cached_property
    def __annotations__(self) -> dict[str, Any]:  # type: ignore[override]
        return {p.name: p.annotation for p in self._spread[0].parameters.values()}

    def __call__(self, **kwargs: Any) -> Any:
        for name, (group, names) in self._spread[1].items():
            kwargs[name] = group(**{n: kwargs.pop(n) for n in names})
        return self.__wrapped__(**kwargs)

def detect_backend() -> str:
    import platform  # only without --backend

    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "metal"
    if shutil.which("nvidia-smi"):
        return "cuda"
    return "cpu"


def backend_of(name: BackendName | None):
    """--backend, or this machine's own when not given."""
    from fitter.ggml.backends.base import Backend

    return Backend(name.value if name else detect_backend())


def hardware_of(name: str = "auto", host_bandwidth: str | None = None):
    """--hardware NAME|auto and --host-bandwidth: the HardwareProfile, its host bandwidth set (fitter.speed.hardware
    .resolve); an unknown profile or an unreadable rate is one line (HardwareError)."""
    from fitter.speed.hardware import resolve

    return resolve(name, host_bandwidth)


def backend_of_hardware(name: BackendName | None, profile):
    """--backend when given, else the --hardware profile's (issue 46: --hardware sets the backend)."""
    from fitter.ggml.backends.base import Backend

    return Backend(name.value) if name else profile.backend


def threads_of(threads: int | None) -> int:
    """-t N, or llama.cpp's default (the physical cores); 0 or less is one line, as llama.cpp's own -t needs one."""
    from fitter.llama.flags import ConfigError
    from fitter.speed.hardware import default_threads

    if threads is None:
        return default_threads()
    if threads < 1:
        raise ConfigError(f"-t {threads}: use 1 or more threads")
    return threads


def frontend_of(name: FrontendName):
    from fitter.llama.cparams import Frontend

    return Frontend(name.value)


# fit's parameters by engine: mlx-lm's own (fit_mlx reads them), and those both engines read; every other one is
# llama.cpp's
MLX_ONLY = frozenset({"max_kv_size", "kv_bits", "kv_group_size", "quantized_kv_start", "prefill_step_size",
                      "max_tokens", "prompt_cache_bytes", "prompt_cache_size"})
BOTH_ENGINES = frozenset({"model", "budget", "margin", "n_ctx", "model_draft", "draft_n_max", "as_json", "engine",
                          "session_requests"})


def check_engine_flags(ctx: typer.Context, engine: str) -> None:
    """A flag of the other engine, given on the command line, is one line (ConfigError) instead of being ignored."""
    def given(name: str) -> bool:
        src = ctx.get_parameter_source(name)
        return src is not None and src.name in ("COMMANDLINE", "ENVIRONMENT")

    mlx = engine == "mlx"
    wrong = [p for p in ctx.command.params if p.name and given(p.name)
             and (p.name not in BOTH_ENGINES and p.name not in MLX_ONLY if mlx else p.name in MLX_ONLY)]
    if not wrong:
        return
    from fitter.llama.flags import ConfigError

    shown = []
    for p in wrong:
        v = ctx.params.get(p.name or "")
        opts = getattr(p, "secondary_opts", []) if v is False and getattr(p, "secondary_opts", []) else p.opts
        flag = min(opts, key=len)  # -ctk, not --cache-type-k
        shown.append(flag if isinstance(v, bool) else f"{flag} {getattr(v, 'value', v)}")
    if mlx:
        raise ConfigError(f"{', '.join(shown)}: llama.cpp's, not mlx-lm's: --engine mlx takes -c, -md, "
                          "--spec-draft-n-max and its own --max-kv-size, --kv-bits, --kv-group-size, "
                          "--quantized-kv-start, --prefill-step-size, --max-tokens, --prompt-cache-bytes, "
                          "--prompt-cache-size, --session-requests")
    raise ConfigError(f"{', '.join(shown)}: mlx-lm's (--engine mlx), not llama.cpp's"
                      + (" (llama.cpp's K/V types: -ctk, -ctv)" if any(p.name == "kv_bits" for p in wrong)
                         else ""))


# llama-server flags (common/arg.cpp of the pinned build, the server's and the common ones) that change no buffer
# llama.cpp allocates: threads and CPU affinity, sampling, the HTTP server, chat templates, logging. fit and quants
# take them, so that a llama-server command line pastes as it is, and say they ignored them. (flags, takes a value)
_NO_MEMORY: tuple[tuple[tuple[str, ...], bool], ...] = (
    (("-tb", "--threads-batch", "-C", "--cpu-mask", "-Cr", "--cpu-range", "--cpu-strict", "--prio",
      "--poll", "-Cb", "--cpu-mask-batch", "-Crb", "--cpu-range-batch", "--cpu-strict-batch", "--prio-batch",
      "--poll-batch", "--numa", "-td", "--threads-draft", "--spec-draft-threads", "-tbd", "--threads-batch-draft",
      "--spec-draft-threads-batch", "--threads-http"), True),
    (("-n", "--predict", "--n-predict", "--keep", "-r", "--reverse-prompt", "--samplers", "-s", "--seed",
      "--sampler-seq", "--sampling-seq", "--temp", "--temperature", "--top-k", "--top-p", "--min-p", "--top-nsigma",
      "--top-n-sigma", "--xtc-probability", "--xtc-threshold", "--typical", "--typical-p", "--repeat-last-n",
      "--repeat-penalty", "--presence-penalty", "--frequency-penalty", "--dry-multiplier", "--dry-base",
      "--dry-allowed-length", "--dry-penalty-last-n", "--dry-sequence-breaker", "--adaptive-target",
      "--adaptive-decay", "--dynatemp-range", "--dynatemp-exp", "--mirostat", "--mirostat-lr", "--mirostat-ent",
      "-l", "--logit-bias", "--grammar", "--grammar-file", "-j", "--json-schema", "-jf", "--json-schema-file",
      "--spec-draft-n-min", "--draft-p-min", "--spec-draft-p-min", "--draft-p-split", "--spec-draft-p-split"), True),
    (("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx",
      "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast", "-dt", "--defrag-thold",
      "--cache-reuse", "-sps", "--slot-prompt-similarity", "--embd-normalize"), True),
    (("--host", "--port", "--path", "--api-prefix", "-a", "--alias", "--tags", "--cors-origins", "--cors-methods",
      "--cors-headers", "--ui-config", "--webui-config", "--ui-config-file", "--webui-config-file", "--tools",
      "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json", "--api-key", "--api-key-file",
      "--ssl-key-file", "--ssl-cert-file", "-to", "--timeout", "--sse-ping-interval", "--slot-save-path",
      "--media-path", "--sleep-idle-seconds"), True),
    (("--chat-template", "--chat-template-file", "--chat-template-kwargs", "--reasoning-format", "-rea",
      "--reasoning", "--reasoning-effort", "--reasoning-budget", "--reasoning-budget-message", "--log-file",
      "--log-prompts-dir", "--log-colors", "-lv", "--verbosity", "--log-verbosity"), True),
    (("--perf", "--no-perf", "-e", "--escape", "--no-escape", "-sp", "--special", "--spm-infill", "--ignore-eos",
      "--context-shift", "--no-context-shift", "-cb", "--cont-batching", "-nocb", "--no-cont-batching",
      "--reuse-port", "--cors-credentials", "--no-cors-credentials", "--ui", "--webui", "--no-ui", "--no-webui",
      "-ag", "--agent", "-no-ag", "--no-agent", "--metrics", "--props", "--slots", "--no-slots", "--jinja",
      "--no-jinja", "--skip-chat-parsing", "--no-skip-chat-parsing", "--prefill-assistant", "--no-prefill-assistant",
      "--reasoning-preserve", "--no-reasoning-preserve", "--cache-prompt", "--no-cache-prompt", "--check-tensors",
      "--log-disable", "--log-jsonl", "--no-log-jsonl", "-v", "--verbose", "--log-verbose", "--log-prefix",
      "--no-log-prefix", "--log-timestamps", "--no-log-timestamps",
      "--mlock"), False),  # --mlock: builds before -lm/--load-mode (it pins the mapped pages; no buffer changes)
)
NO_MEMORY_FLAGS: dict[str, bool] = {n: v for names, v in _NO_MEMORY for n in names}
# llama-server flags that do change memory and that ggfit does not model: refused, not ignored (several would
# otherwise read as -c / -b with a value: -cram as -c ram)
NOT_MODELLED_FLAGS: dict[str, bool] = {n: v for names, v in (
    (("-cram", "--cache-ram", "-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", "-cms", "--checkpoint-min-step",
      "--kv-unified-per-slot", "-dev", "--device", "--override-kv", "--control-vector",
      "--control-vector-scaled", "--image-min-tokens", "--image-max-tokens", "-fit", "--fit", "-fitt",
      "--fit-target", "-fitc", "--fit-ctx", "-ncffn", "--n-cpu-ffn", "-lzm", "--lazy-mode", "--pooling",
      "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl", "-otd", "--override-tensor-draft",
      "--spec-draft-override-tensor", "-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe",
      "-devd", "--device-draft", "--spec-draft-device"), True),
    (("--no-host", "-bs", "--backend-sampling", "--rerank", "--reranking", "-cmoed", "--cpu-moe-draft",
      "--spec-draft-cpu-moe", "--warmup", "--no-warmup"), False)) for n in names}
SERVER_FLAG_COMMANDS = frozenset({"fit", "quants"})
# modelled by fit's session (fitter.session), not by quants
SESSION_FLAGS = frozenset({"-cram", "--cache-ram", "-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", "-cms",
                           "--checkpoint-min-step"})


def split_server_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """fit's and quants' arguments without the llama-server flags that change no memory (NO_MEMORY_FLAGS), and those
    flags as given (`-t 8`, `--port=8080`); a llama-server flag that changes memory and that ggfit does not model is
    one line (ConfigError); `-m MODEL` is the command's MODEL. Other arguments are left to the command's parser."""
    if not args or args[0] not in SERVER_FLAG_COMMANDS:
        return args, []
    kept, ignored = [args[0]], []
    i = 1
    while i < len(args):
        a = args[i]
        name, eq, _ = a.partition("=") if a.startswith("--") else (a, "", "")
        if name in ("-m", "--model"):  # llama-server's model flag: the command's MODEL argument
            if not eq and i + 1 >= len(args):
                from fitter.llama.flags import ConfigError

                raise ConfigError(f"{a} needs a value")
            kept.insert(1, a.partition("=")[2] if eq else args[i + 1])
            i += 1 if eq else 2
            continue
        if name in NOT_MODELLED_FLAGS and not (args[0] == "fit" and name in SESSION_FLAGS):
            value = "" if eq or not NOT_MODELLED_FLAGS[name] or i + 1 >= len(args) else " " + args[i + 1]
            from fitter.llama.flags import ConfigError

            raise ConfigError(f"{a}{value}: a llama-server flag that changes memory, which ggfit does not "
                              "model; leave it out (ggfit predicts llama.cpp without it)")
        if name not in NO_MEMORY_FLAGS:
            kept.append(a)
            i += 1
            continue
        takes = NO_MEMORY_FLAGS[name] and not eq
        if takes and i + 1 >= len(args):
            from fitter.llama.flags import ConfigError

            raise ConfigError(f"{a} needs a value")
        ignored.append(a + (" " + args[i + 1] if takes else ""))
        i += 2 if takes else 1
    return kept, ignored

