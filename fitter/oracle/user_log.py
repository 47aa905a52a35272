"""A user's llama.cpp log, read: which build and backend printed it, the settings, the model and every buffer.

`read_user_log` takes what llama-server, llama-cli or llama-fit-params wrote (with or without `-v`, from any
backend, copied from a terminal, a container or a GitHub issue) and returns a `UserLog`: llama.cpp's own
lines parsed by `fitter.oracle.llama_log.parse_log`, plus what only a whole tool's log holds: the build line
(`fitter.llama_builds.identify.build_in_text`), the model it loaded, the memory breakdown table
(`common_memory_breakdown_print`, formerly `llama_memory_breakdown_print`) with its `unaccounted` column,
llama-fit-params' projections and printed arguments, and failed allocations.

Nothing here guesses: a value the log does not print is None, and `settings()` says which ones it filled with
llama.cpp's defaults. A file that is not text, or that holds no line llama.cpp prints, is a `LogError`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from fitter.errors import GGFitError
from fitter.ggml.backends.base import is_host_buffer
from fitter.llama_builds.identify import build_in_text
from fitter.oracle.llama_log import LlamaReport, clean_line, mib_to_bytes, parse_log

MAX_LOG_BYTES = 64 << 20  # read at most this much of a log (a server's log of days): bounded memory

Tool = Literal["llama-server", "llama-cli", "llama-fit-params"]


class LogError(GGFitError):
    """A file ggfit cannot read as a llama.cpp log."""


class BreakdownRow(BaseModel):
    """One row of common_memory_breakdown_print (common/fit.cpp), in whole MiB (`bytes / MiB`, rounded down).

    A device row: `total = free + (self = model + context + compute) + unaccounted`; the host row and the
    rows of other buffer types have only `self = model + context + compute`."""

    name: str  # "MTL0", "CUDA0", "Host", or a buffer type ("CPU_REPACK")
    description: str | None = None  # "Apple M4 Pro"
    total_mib: int | None = None
    free_mib: int | None = None
    self_mib: int
    model_mib: int
    context_mib: int
    compute_mib: int
    unaccounted_mib: int | None = None  # total - free - self: what the device holds beyond llama.cpp's buffers
    line: int


class FitDevice(BaseModel):
    """llama-fit-params (common_params_fit_impl): one device's projection, `- CUDA0 (...): ..., X MiB used`,
    or a `--fit-print on` row `MTL0 <model> <context> <compute>` (MiB)."""

    name: str
    used_mib: int | None = None
    model_mib: int | None = None
    context_mib: int | None = None
    compute_mib: int | None = None
    line: int


class AllocFailure(BaseModel):
    """`failed to allocate CUDA1 buffer of size 54262464512` (ggml-alloc, exact bytes) or
    `allocating 51748.72 MiB on device 1: cudaMalloc failed: out of memory`."""

    buffer: str | None
    bytes: int
    line: int


class ModelInfo(BaseModel):
    """The model as the log names it."""

    path: str | None = None  # as printed (the user's machine)
    name: str | None = None  # general.name
    arch: str | None = None
    file_type: str | None = None
    file_size_mib: float | None = None
    n_params: int | None = None


class Settings(BaseModel):
    """The context settings llama.cpp printed (llama_context::llama_context, the KV cache lines, ...)."""

    n_ctx: int | None = None
    n_ctx_seq: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    n_seq_max: int | None = None
    n_outputs_max: int | None = None
    flash_attn: str | None = None  # "enabled" / "disabled" / "auto" as printed
    flash_attn_resolved: bool | None = None
    type_k: str | None = None
    type_v: str | None = None
    kv_unified: bool | None = None
    swa_full: bool | None = None
    causal_attn: bool | None = None
    n_rs_seq: int | None = None
    offloaded_layers: int | None = None  # "offloaded 33/33 layers to GPU"
    total_layers: int | None = None
    mmap: bool | None = None


class UserLog(BaseModel):
    source: str
    bytes_read: int
    truncated: bool = False  # longer than MAX_LOG_BYTES: only the start was read
    tool: Tool | None = None
    build: tuple[int | None, str | None] | None = None  # (number or None, commit prefix) from the build line
    backends: list[str] = Field(default_factory=list)  # "Metal", "CUDA", "Vulkan", "ROCm", "CPU"
    model: ModelInfo = Field(default_factory=ModelInfo)
    settings: Settings = Field(default_factory=Settings)
    report: LlamaReport
    breakdown: list[BreakdownRow] = Field(default_factory=list)
    fit_projected_mib: int | None = None  # "projected to use X MiB of device memory"
    fit_free_mib: int | None = None
    fit_devices: list[FitDevice] = Field(default_factory=list)
    fit_args: str | None = None  # the arguments llama-fit-params printed ("-c 4096 -ngl 48 ...")
    alloc_failures: list[AllocFailure] = Field(default_factory=list)
    worst_case: tuple[int, int, int] | None = None  # sched_reserve: worst-case n_tokens, n_seqs, n_outputs
    # the tool's command line where the log echoes it ("$ llama-server -m ... -c 32768"): memory flags only,
    # by llama.cpp's long names (common/arg.cpp): {"--ctx-size": "32768", "--flash-attn": "on", ...}
    command_flags: dict[str, str] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)  # what the log holds besides the run compared (_run_lines)

    @property
    def backend(self) -> str | None:
        """The one accelerator backend, else CPU when only host buffers were printed."""
        gpu = [b for b in self.backends if b != "CPU"]
        return gpu[0] if gpu else ("CPU" if self.backends else None)

    def buffers(self) -> list[tuple[str, str, int]]:
        """(kind, buffer, bytes) of every printed buffer, summed per kind and buffer; a no_alloc dummy KV line
        is replaced by the KV cache's own size line."""
        out: dict[tuple[str, str], int] = {}
        kv_lines, kv_real = [b for b in self.report.buffers if b.kind == "kv"], False
        for b in self.report.buffers:
            if b.dummy or (b.kind == "kv" and b.mib == 0 and self.report.kv_caches):
                continue
            kv_real |= b.kind == "kv"
            out[(b.kind, b.buffer)] = out.get((b.kind, b.buffer), 0) + b.bytes
        if self.report.kv_caches and kv_lines and not kv_real:
            out[("kv", kv_lines[0].buffer)] = sum(c.bytes for c in self.report.kv_caches)
        if not out:
            out = self._table_buffers()
        return [(k, buf, n) for (k, buf), n in out.items()]

    def _table_buffers(self) -> dict[tuple[str, str], int]:
        """A log without buffer lines (llama-fit-params without -v, a bare breakdown table): the whole MiB of
        llama-fit-params' --fit-print rows or of the memory breakdown, per device, as model / context (KV,
        recurrent state and outputs together) / compute."""
        rows = [(d.name, d.model_mib, d.context_mib, d.compute_mib) for d in self.fit_devices
                if d.model_mib is not None] or \
               [(b.name, b.model_mib, b.context_mib, b.compute_mib) for b in self.breakdown]
        out: dict[tuple[str, str], int] = {}
        for name, *figures in rows:
            buf = "CPU" if name.lower() == "host" else name
            for kind, v in zip(("model", "context", "compute"), figures):
                if v:
                    out[(kind, buf)] = out.get((kind, buf), 0) + v * 2**20
        return out


# --- patterns -----------------------------------------------------------------------------------

_BD_DEVICE = re.compile(
    r"memory_breakdown_print: \|\s+-\s+(?P<name>\S+)(?: \((?P<desc>.*?)\))?\s*\|\s*(?P<total>\d+)\s*=\s*(?P<free>\d+)\s*\+"
    r"\s*\(\s*(?P<self>\d+)\s*=\s*(?P<model>\d+)\s*\+\s*(?P<ctx>\d+)\s*\+\s*(?P<compute>\d+)\s*\)\s*\+\s*(?P<un>-?\d+)\s*\|"
)
_BD_OTHER = re.compile(
    r"memory_breakdown_print: \|\s+-\s+(?P<name>\S+)\s*\|\s*(?P<self>\d+)\s*=\s*(?P<model>\d+)\s*\+\s*(?P<ctx>\d+)"
    r"\s*\+\s*(?P<compute>\d+)\s*\|"
)
_FIT_PROJECTED = re.compile(r"projected to use (\d+) MiB of device memory vs\. (?:a total of )?(\d+) MiB(?: of free device memory)?")
_FIT_DEVICE = re.compile(r"_fit\w*:\s+-\s+(?P<name>\S+) \((?P<desc>[^)]*)\)\s*:.*?(?P<used>\d+)(?: MiB)? used")
_FIT_PRINT = re.compile(r"^(?P<name>[A-Za-z][\w]*)\s+(\d+)\s+(\d+)\s+(\d+)\s*$")
_FIT_ARGS = re.compile(r"^-c \d+ -ngl -?\d+")
_MODEL_PATH = (
    re.compile(r"llama_model_loader: loaded meta data with \d+ key-value pairs and \d+ tensors from (?P<p>.+?) \(version"),
    re.compile(r"load_model: loading model '(?P<p>[^']+)'"),
    re.compile(r"\bllama-[\w-]+\b.*?\s(?:-m|--model)\s+(?P<p>\S+\.gguf)\b"),  # the command line, echoed
)
_COMMAND = re.compile(r"^(?:\$|>)?\s*(?:\S+=\S+\s+)*\S*\bllama-(?:server|cli|fit-params|completion)\s+(?P<args>.*)$")
# the flags that change memory, every spelling common/arg.cpp accepts, by their long name
_FLAG_NAMES = {
    "-c": "--ctx-size", "--ctx-size": "--ctx-size", "-b": "--batch-size", "--batch-size": "--batch-size",
    "-ub": "--ubatch-size", "--ubatch-size": "--ubatch-size", "-ctk": "--cache-type-k",
    "--cache-type-k": "--cache-type-k", "-ctv": "--cache-type-v", "--cache-type-v": "--cache-type-v",
    "-fa": "--flash-attn", "--flash-attn": "--flash-attn", "-np": "--parallel", "--parallel": "--parallel",
    "-ngl": "--n-gpu-layers", "--gpu-layers": "--n-gpu-layers", "--n-gpu-layers": "--n-gpu-layers",
}
_FLAG_SWITCHES = {"-kvu": "--kv-unified", "--kv-unified": "--kv-unified", "--swa-full": "--swa-full",
                  "--no-mmap": "--no-mmap"}
_KV_META = re.compile(r"llama_model_loader: - kv\s+\d+:\s+general\.(?P<k>name|architecture)\s+str\s+=\s+(?P<v>.*?)\s*$")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_MMAP = re.compile(r"loading model tensors, .*\bmmap = (true|false)")
_ALLOC_FAIL = re.compile(r"failed to allocate (?P<buf>\S+) buffer of size (?P<n>\d+)")
_ALLOC_MIB = re.compile(r"allocating (?P<mib>[\d.]+) MiB on device (?P<dev>\d+): \w+ failed")
_WORST = re.compile(r"worst-case: n_tokens = (\d+), n_seqs = (\d+), n_outputs = (\d+)")
_SLOTS = re.compile(r"n_slots = (\d+).*?kv_unified = '(true|false)'")
_BACKEND_OF = (("MTL", "Metal"), ("Metal", "Metal"), ("CUDA", "CUDA"), ("ROCm", "ROCm"), ("Vulkan", "Vulkan"),
               ("SYCL", "SYCL"), ("CPU", "CPU"))
_INIT = (("ggml_metal_init", "Metal"), ("ggml_metal_device_init", "Metal"), ("ggml_cuda_init", "CUDA"),
         ("ggml_vulkan:", "Vulkan"))


def _backend_of(buffer: str) -> str | None:
    if is_host_buffer(buffer):
        return "CPU" if buffer.startswith("CPU") else None  # a GPU backend's pinned host memory: not a device
    for prefix, name in _BACKEND_OF:
        if buffer.startswith(prefix):
            return name
    return None


def _flags(args: str) -> dict[str, str]:
    """The memory flags of an echoed command line, by their long names ("" for a switch)."""
    words, out = args.split(), {}
    for i, w in enumerate(words):
        if w in _FLAG_SWITCHES:
            out[_FLAG_SWITCHES[w]] = ""
        elif w in _FLAG_NAMES and i + 1 < len(words):
            out[_FLAG_NAMES[w]] = words[i + 1].strip("'\"")
    return out


def _tool(text_lines: list[str]) -> Tool | None:
    """Which tool wrote the log, from lines only that tool prints."""
    joined = "\n".join(text_lines)
    if re.search(r"printing (?:fitted CLI arguments|estimated memory in MiB) to stdout|^-c \d+ -ngl |\bllama-fit-params ",
                 joined, re.IGNORECASE | re.MULTILINE):
        return "llama-fit-params"
    if re.search(r"^srv |\bsrv\s+load_model:|HTTP server is listening|server is listening on|n_slots = \d+|update_slots",
                 joined, re.MULTILINE):
        return "llama-server"
    if re.search(r"interactive mode|^generate: n_ctx|llama-cli|^> |== Running in", joined, re.MULTILINE):
        return "llama-cli"
    return None


def read_log_text(path: str | os.PathLike[str]) -> tuple[str, int, bool]:
    """The first MAX_LOG_BYTES of a file as text: (text, bytes read, truncated). Refuses what is not text."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_LOG_BYTES + 1)
    except FileNotFoundError:
        raise LogError(f"--log {path}: no such file") from None
    except IsADirectoryError:
        raise LogError(f"--log {path}: a directory, not a log file") from None
    except OSError as e:
        raise LogError(f"--log {path}: cannot read it ({e.strerror})") from None
    truncated = len(data) > MAX_LOG_BYTES
    data = data[:MAX_LOG_BYTES]
    head = data[:65536]
    if b"\x00" in head or head.startswith((b"GGUF", b"\x7fELF", b"PK\x03\x04")):  # no text log holds a NUL
        raise LogError(f"--log {path}: a binary file, not a llama.cpp log (give the text llama-server, llama-cli "
                       f"or llama-fit-params printed)")
    return data.decode("utf-8", errors="replace"), len(data), truncated


def read_user_log(path: str | os.PathLike[str]) -> UserLog:
    """Read a user's llama.cpp log (see the module's docstring)."""
    text, n, truncated = read_log_text(path)
    return parse_user_log(text, source=str(path), bytes_read=n, truncated=truncated)


def parse_user_log(text: str, *, source: str = "<log>", bytes_read: int | None = None,
                   truncated: bool = False) -> UserLog:
    # a '#' line is a comment someone put around a pasted log (the corpus's headers): not llama.cpp's
    raw = text.splitlines()
    lines = ["" if ln.lstrip().startswith("#") else clean_line(ln) for ln in raw]
    keep, notes = _run_lines(lines)
    report = parse_log("\n".join(ln if i in keep else "" for i, ln in enumerate(lines)))
    log = UserLog(source=source, bytes_read=len(text.encode()) if bytes_read is None else bytes_read,
                  truncated=truncated, report=report, build=_build_line(lines), tool=_tool(lines), notes=notes)
    _Extra(log, keep).run(lines)
    if not _recognised(log):
        raise LogError(f"{source}: no line llama.cpp prints about memory (no buffer size, KV cache, context or "
                       f"memory breakdown line); give the log of llama-server, llama-cli or llama-fit-params")
    return log


def _build_line(lines: list[str]) -> tuple[int | None, str | None] | None:
    """(number or None, commit) of the log's build line (a build without a number is named by its commit)."""
    return build_in_text("\n".join(lines))


_LOAD_LINE = ("llama_model_loader:", "print_info:", "load_tensors:", "llama_model_load_from_file")
_DRY = re.compile(r"^print_info: no_alloc\s*= 1\s*$")


def _run_lines(lines: list[str]) -> tuple[range, list[str]]:
    """The lines of the run to compare, and what else the log holds.

    One log may hold several model loads: with -v, llama-server's fit pass (common_params_fit: a dry load,
    print_info no_alloc = 1) before the real one; a draft model's load after the target's. And one load several
    contexts: the target's, then an MTP draft's. The run compared is the first load that is not a dry pass (else
    the last dry one, a llama-fit-params log), up to its second context."""
    starts, in_ctx = [0], False
    for i, line in enumerate(lines):
        if line.startswith("llama_context: constructing llama_context"):
            in_ctx = True
        elif in_ctx and line.startswith(_LOAD_LINE):
            starts.append(i)
            in_ctx = False
    loads = [range(a, b) for a, b in zip(starts, starts[1:] + [len(lines)])]
    dry = [any(_DRY.match(lines[i]) for i in r) for r in loads]
    k = next((j for j, d in enumerate(dry) if not d), len(loads) - 1)
    run, notes = loads[k], []
    if sum(dry[:k]):
        notes.append("the log's first load is llama.cpp's fit pass (a dry run, no_alloc): the run after it is compared")
    if len(loads) > k + 1:
        notes.append(f"the log loads {len(loads) - k - 1} more model(s) after the one compared (a draft model, or "
                     f"a restart): their buffers are not compared")
    ctx = [i for i in run if lines[i].startswith("llama_context: constructing llama_context")]
    if len(ctx) > 1:
        notes.append(f"the load holds {len(ctx)} contexts (the second: an MTP or draft context): the first is compared")
        run = range(run.start, ctx[1])
    return run, notes


def _recognised(log: UserLog) -> bool:
    r = log.report
    return bool(r.buffers or r.kv_caches or r.recurrent or r.context or r.print_info or log.breakdown
                or log.fit_projected_mib is not None or log.fit_devices or log.fit_args or log.alloc_failures
                or log.worst_case or log.build)


class _Extra:
    """What parse_log leaves out: the lines of whole tools (server, fit-params), the model, the backend."""

    def __init__(self, log: UserLog, run: range) -> None:
        self.log = log
        self.run_lines = run  # the run compared: offload and mmap lines count only there
        self.slots: tuple[int, bool] | None = None
        self.mmap: bool | None = None
        self.fit_print = False

    def run(self, lines: list[str]) -> None:
        log = self.log
        for i, line in enumerate(lines, start=1):
            if line:
                self._line(i, line)
        self._backends(lines)
        self._model()
        log.settings = self._settings()

    def _line(self, i: int, line: str) -> None:  # noqa: C901 - one dispatch over the line kinds
        log = self.log
        if "memory_breakdown_print:" in line:
            self._breakdown_line(i, line)
            return
        if m := _FIT_PROJECTED.search(line):
            log.fit_projected_mib, log.fit_free_mib = int(m.group(1)), int(m.group(2))
            return
        if m := _FIT_DEVICE.search(line):
            log.fit_devices.append(FitDevice(name=m.group("name"), used_mib=int(m.group("used")), line=i))
            return
        if "printing estimated memory in MiB" in line:
            self.fit_print = True
            return
        if self.fit_print and (m := _FIT_PRINT.match(line.strip())):
            log.fit_devices.append(FitDevice(name=m.group("name"), model_mib=int(m.group(2)),
                                             context_mib=int(m.group(3)), compute_mib=int(m.group(4)), line=i))
            return
        if _FIT_ARGS.match(line.strip()):
            log.fit_args = line.strip()
            return
        if m := _ALLOC_FAIL.search(line):
            log.alloc_failures.append(AllocFailure(buffer=m.group("buf"), bytes=int(m.group("n")), line=i))
            return
        if m := _ALLOC_MIB.search(line):
            log.alloc_failures.append(AllocFailure(buffer=None, bytes=mib_to_bytes(float(m.group("mib"))), line=i))
            return
        if m := _WORST.search(line):
            log.worst_case = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            return
        if m := _SLOTS.search(line):
            self.slots = (int(m.group(1)), m.group(2) == "true")
            return
        if (m := _OFFLOADED.search(line)) and i - 1 in self.run_lines:
            log.settings.offloaded_layers, log.settings.total_layers = int(m.group(1)), int(m.group(2))
            return
        if (m := _MMAP.search(line)) and i - 1 in self.run_lines:
            self.mmap = m.group(1) == "true"
            return
        if not log.command_flags and (m := _COMMAND.match(line.strip())):
            log.command_flags = _flags(m.group("args"))
        for rx in _MODEL_PATH:
            if (m := rx.search(line)) and log.model.path is None:
                log.model.path = m.group("p").strip()
                return
        if m := _KV_META.search(line):
            if m.group("k") == "name" and log.model.name is None:
                log.model.name = m.group("v")
            elif m.group("k") == "architecture" and log.model.arch is None:
                log.model.arch = m.group("v")

    def _breakdown_line(self, i: int, line: str) -> None:
        """A line of llama_memory_breakdown_print's table."""
        log = self.log
        if "memory breakdown [MiB]" in line:
            log.breakdown = []  # a later table (the fit pass prints one, the exit another): the last counts
        elif m := _BD_DEVICE.search(line):
            log.breakdown.append(BreakdownRow(
                name=m.group("name"), description=m.group("desc"), total_mib=int(m.group("total")),
                free_mib=int(m.group("free")), self_mib=int(m.group("self")), model_mib=int(m.group("model")),
                context_mib=int(m.group("ctx")), compute_mib=int(m.group("compute")),
                unaccounted_mib=int(m.group("un")), line=i))
        elif m := _BD_OTHER.search(line):
            log.breakdown.append(BreakdownRow(
                name=m.group("name"), self_mib=int(m.group("self")), model_mib=int(m.group("model")),
                context_mib=int(m.group("ctx")), compute_mib=int(m.group("compute")), line=i))

    def _backends(self, lines: list[str]) -> None:
        log, found = self.log, []
        names = [b.buffer for b in log.report.buffers] + [r.name for r in log.breakdown] + \
                [d.name for d in log.fit_devices] + [a.buffer for a in log.alloc_failures if a.buffer]
        for n in names:
            b = _backend_of(n)
            if b and b not in found:
                found.append(b)
        for line in lines:
            for token, b in _INIT:
                if token in line and b not in found:
                    found.append(b)
        log.backends = sorted(found, key=lambda b: b == "CPU")  # the accelerator first

    def _model(self) -> None:
        log, h = self.log, self.log.report.hparams
        m = log.model
        m.name = m.name or h.general_name
        m.arch = m.arch or h.arch
        m.file_type = h.file_type
        m.file_size_mib = h.file_size_mib
        m.n_params = h.model_params

    def _settings(self) -> Settings:
        log, r = self.log, self.log.report
        s = log.settings
        c = r.context
        if c is not None:
            s.n_ctx, s.n_ctx_seq, s.n_batch, s.n_ubatch = c.n_ctx, c.n_ctx_seq, c.n_batch, c.n_ubatch
            s.n_seq_max, s.n_outputs_max, s.flash_attn = c.n_seq_max, c.n_outputs_max, c.flash_attn
            s.flash_attn_resolved, s.kv_unified, s.swa_full = c.flash_attn_resolved, c.kv_unified, c.swa_full
            s.causal_attn, s.n_rs_seq = c.causal_attn, c.n_rs_seq
        full = [k for k in r.kv_caches if k.role in (None, "non-SWA")] or r.kv_caches
        if full:
            k = full[0]
            s.type_k, s.type_v = k.type_k, k.type_v
            if s.n_seq_max is None:
                s.n_seq_max = k.n_seq_max
            if s.kv_unified is None and k.n_seq_max > 1:
                s.kv_unified = k.n_stream == 1
        if s.n_seq_max is None and r.recurrent:
            s.n_seq_max = r.recurrent[0].n_seq_max
        if self.slots is not None:
            s.n_seq_max = s.n_seq_max or self.slots[0]
            s.kv_unified = self.slots[1] if s.kv_unified is None else s.kv_unified
        if s.n_rs_seq is None and r.recurrent and r.recurrent[0].n_rs_seq is not None:
            s.n_rs_seq = r.recurrent[0].n_rs_seq
        mapped = [b for b in r.buffers if b.kind == "model"]
        if self.mmap is not None:
            s.mmap = self.mmap
        elif r.load_mode is not None:
            s.mmap = r.load_mode == "mmap"
        elif mapped:
            s.mmap = any(b.buffer.endswith("_Mapped") for b in mapped)
        return s


def log_summary(log: UserLog) -> dict[str, Any]:
    """The log's findings as plain data (for --json)."""
    return {
        "source": log.source, "bytes_read": log.bytes_read, "truncated": log.truncated, "tool": log.tool,
        "build": {"number": log.build[0], "commit": log.build[1]} if log.build else None,
        "backends": log.backends, "model": log.model.model_dump(mode="json"),
        "settings": log.settings.model_dump(mode="json", exclude_none=True),
        "buffers": [{"kind": k, "buffer": b, "bytes": n} for k, b, n in log.buffers()],
        "kv_caches": [k.model_dump(mode="json") for k in log.report.kv_caches],
        "recurrent": [x.model_dump(mode="json") for x in log.report.recurrent],
        "breakdown": [b.model_dump(mode="json") for b in log.breakdown],
        "fit": {"projected_mib": log.fit_projected_mib, "free_mib": log.fit_free_mib,
                "devices": [d.model_dump(mode="json", exclude_none=True) for d in log.fit_devices],
                "args": log.fit_args} if (log.fit_projected_mib is not None or log.fit_devices or log.fit_args) else None,
        "alloc_failures": [a.model_dump(mode="json") for a in log.alloc_failures],
    }
