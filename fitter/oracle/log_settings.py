"""A user's llama.cpp log read as flags (`calibrate --log`): each setting the log printed, else its echoed command
line's, else llama.cpp's default, and which of them were assumed."""

from __future__ import annotations

from typing import Any, Literal, cast

from fitter.ggml import backends
from fitter.ggml.backends.base import is_host_buffer
from fitter.llama.cparams import Backend, FlashAttn, Frontend, RunConfig
from fitter.oracle.user_log import UserLog

GRID: list[tuple[int, int, Literal["on", "off"]]] = [  # (n_ctx, n_ubatch, flash_attn)
    (4096, 512, "on"), (16384, 512, "on"), (16384, 2048, "on"), (65536, 1024, "on"),
    (4096, 512, "off"), (16384, 1024, "off"),
]


# The devices of the local llama.cpp, asked in a child (a GPU build without its driver may abort on load).
# llama_backend_init loads the backends (ggml_backend_load_all) when none is registered; then each device's
# registry: "CPU", "CUDA", "MTL" (ggml-metal.cpp GGML_METAL_NAME), "Vulkan", ...
def log_run_config(log: UserLog, spec: Any, backend: Backend) -> tuple[RunConfig, Frontend, dict[str, str]]:
    """The log's settings as flags; each one the log does not print is filled with llama.cpp's default and
    named in the returned dict."""
    r = _LogSettings(log)
    n_seq = r.n_seq()
    kv_unified = r.kv_unified(n_seq)
    n_ctx = r.n_ctx(spec, n_seq, kv_unified)
    n_batch, n_ubatch = r.batches()
    fa = r.flash_attn()
    type_k, type_v = r.cache_types()
    swa_full = r.swa_full(spec)
    ngl = r.n_gpu_layers(backend)
    frontend = r.frontend(n_batch, n_ctx, n_seq)
    s, cmd = log.settings, log.command_flags
    # llama.cpp's extra CPU buffer types (use_extra_bufts) show as a CPU_REPACK model buffer
    repack = any(b.kind == "model" and "REPACK" in b.buffer for b in log.report.buffers)
    cfg = RunConfig(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v,
                    flash_attn=cast(FlashAttn, fa),  # RunConfig's own check refuses another value
                    n_parallel=n_seq, kv_unified=kv_unified, swa_full=swa_full, n_gpu_layers=ngl,
                    no_mmap=s.mmap is False or (s.mmap is None and "--no-mmap" in cmd), no_repack=not repack)
    return cfg, frontend, r.assumed


class _LogSettings:
    """log_run_config's settings, one by one: the log's value, else its command line's, else llama.cpp's default
    (`assumed` says which were not the log's own, in the order they were read)."""

    def __init__(self, log: UserLog) -> None:
        self.log, self.s, self.cmd = log, log.settings, log.command_flags
        self.assumed: dict[str, str] = {}

    def from_command(self, flag: str, name: str) -> int | None:
        """An integer flag of the command line the log echoes, used where llama.cpp printed no value."""
        try:
            v = int(self.cmd[flag]) if flag in self.cmd else None
        except ValueError:
            return None
        if v is not None:
            self.assumed[name] = f"{v} ({flag} {v} on the log's command line)"
        return v

    def n_seq(self) -> int:
        n_seq = self.s.n_seq_max
        if n_seq is None:
            n_seq = self.from_command("--parallel", "n_seq_max")
            if n_seq is None or n_seq < 1:
                n_seq = 1
                self.assumed["n_seq_max"] = "1 (not in the log)"
        return n_seq

    def kv_unified(self, n_seq: int) -> bool:
        kv_unified = self.s.kv_unified
        if kv_unified is None:
            kv_unified = "--kv-unified" in self.cmd
            if n_seq > 1:
                self.assumed["kv_unified"] = f"{str(kv_unified).lower()} (not in the log)"
        return kv_unified

    def n_ctx(self, spec: Any, n_seq: int, kv_unified: bool) -> int:
        s, log = self.s, self.log
        n_ctx = s.n_ctx
        if n_ctx is None and s.n_ctx_seq is None:
            n_ctx = self.from_command("--ctx-size", "n_ctx")
        if n_ctx is None and s.n_ctx_seq is not None and (kv_unified or n_seq == 1):
            n_ctx = s.n_ctx_seq
        if n_ctx is None:
            cells = [c for r, c in log.report.kv_cache_cells if r == "non-SWA"] or \
                    [k.cells for k in log.report.kv_caches if k.role in (None, "non-SWA")]
            if cells:
                n_ctx = cells[0] * (1 if kv_unified else n_seq)
                self.assumed["n_ctx"] = f"{n_ctx} (the KV cache's cells; llama_context's n_ctx line is not in the log)"
        if n_ctx is None:
            n_ctx = 0
            self.assumed["n_ctx"] = f"the training context, {spec.n_ctx_train} (not in the log)"
        return n_ctx

    def batches(self) -> tuple[int, int]:
        s = self.s
        n_batch = s.n_batch or self.from_command("--batch-size", "n_batch")
        if n_batch is None:
            n_batch = 2048
            self.assumed["n_batch"] = "2048 (llama.cpp's default; not in the log)"
        n_ubatch = s.n_ubatch
        if n_ubatch is None and self.log.worst_case is not None:
            n_ubatch = self.log.worst_case[0]
        if n_ubatch is None:
            n_ubatch = self.from_command("--ubatch-size", "n_ubatch")
        if n_ubatch is None:
            n_ubatch = 512
            self.assumed["n_ubatch"] = "512 (llama.cpp's default; not in the log)"
        return n_batch, n_ubatch

    def flash_attn(self) -> str:
        s, cmd = self.s, self.cmd
        fa = "on" if s.flash_attn_resolved else "off" if s.flash_attn_resolved is False else \
            {"enabled": "on", "disabled": "off"}.get(s.flash_attn or "", "auto")
        if fa == "auto" and cmd.get("--flash-attn") in ("on", "off", "1", "0"):
            fa = {"1": "on", "0": "off"}.get(cmd["--flash-attn"], cmd["--flash-attn"])
            self.assumed["flash_attn"] = f"{fa} (-fa on the log's command line)"
        elif fa == "auto":
            self.assumed["flash_attn"] = "auto (not in the log)"
        return fa

    def cache_types(self) -> tuple[str, str]:
        s, cmd = self.s, self.cmd
        type_k, type_v = s.type_k or cmd.get("--cache-type-k", "f16"), s.type_v or cmd.get("--cache-type-v", "f16")
        if s.type_k is None:
            self.assumed["type_k/type_v"] = f"{type_k}/{type_v} (" + (
                "the log's command line" if "--cache-type-k" in cmd else "no KV cache size line in the log") + ")"
        return type_k, type_v

    def swa_full(self, spec: Any) -> bool:
        swa_full = self.s.swa_full
        if swa_full is None and "--swa-full" in self.cmd:
            swa_full = True
        if swa_full is None:
            swa_full = False
            if any(layer.kind.value == "swa" for layer in spec.layers):
                self.assumed["swa_full"] = "false (llama.cpp's common default; not in the log)"
        return swa_full

    def n_gpu_layers(self, backend: Backend) -> int:
        s, log = self.s, self.log
        ngl = -1
        if backends.get(backend).is_gpu:
            if s.offloaded_layers is not None and s.total_layers is not None and s.offloaded_layers < s.total_layers:
                ngl = s.offloaded_layers
            elif s.offloaded_layers is None and "--n-gpu-layers" in log.command_flags:
                v = log.command_flags["--n-gpu-layers"]
                ngl = int(v) if v.lstrip("-").isdigit() else -1  # "all", "auto": every layer
                self.assumed["n_gpu_layers"] = f"{v} (-ngl on the log's command line)"
            elif s.offloaded_layers is None:
                ngl, why = _ngl_from_kv_split(log, backend)
                self.assumed["n_gpu_layers"] = why
        return ngl

    def frontend(self, n_batch: int, n_ctx: int, n_seq: int) -> Frontend:
        s, tool = self.s, self.log.tool
        if tool in ("llama-cli", "llama-fit-params"):
            return Frontend.LIBRARY  # common_context_params_to_llama: n_outputs_max = n_batch, as the library's
        if tool is None:
            if s.n_outputs_max is not None and s.n_outputs_max == min(n_batch, n_ctx or n_batch) and s.n_outputs_max > n_seq:
                return Frontend.LIBRARY
            self.assumed["frontend"] = "llama-server (the log does not say which tool wrote it)"
        return Frontend.SERVER


def _ngl_from_kv_split(log: UserLog, backend: Backend) -> tuple[int, str]:
    """-ngl from a KV cache split between host and device: llama_kv_cache puts each layer's K/V with the layer,
    and llama_model::load_tensors offloads the layers from i_gpu_start = n_layer + 1 - n_gpu_layers on (the +1 is
    the output layer's): -ngl is the device's KV layers + 1. All layers when the log does not show a split."""
    caches = log.report.kv_caches
    kv = [(b.buffer, b.bytes) for b in log.report.buffers if b.kind == "kv" and not b.dummy and b.bytes > 0]
    dev = sum(n for buf, n in kv if _side(buf, backend) == "device")
    host = sum(n for buf, n in kv if _side(buf, backend) == "host")
    if len(caches) == 1 and dev and host:
        ngl = round(caches[0].layers * dev / (dev + host)) + 1
        return ngl, (f"{ngl} (the KV cache's split: {dev / 2**20:,.2f} of {(dev + host) / 2**20:,.2f} MiB on the "
                     f"device; the offload line is not in the log)")
    return -1, "all (the offload line is not in the log)"


def _side(buffer: str, backend: Backend | None) -> Literal["device", "host"]:
    """llama.cpp's buffer name: the device's own memory (CUDA0, MTL0, MTL0_Mapped, Vulkan1) or host memory
    (CPU, CPU_Mapped, CUDA_Host). On the CPU backend every buffer is the device's."""
    if backend is not None and not backends.get(backend).is_gpu:
        return "device"
    return "host" if is_host_buffer(buffer) else "device"
