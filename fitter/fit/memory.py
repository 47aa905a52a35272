"""Every buffer llama.cpp creates for a config: weights, KV, recurrent state, output, compute.

One `Buffer` row per llama.cpp log line ("model buffer size", "KV buffer size", "RS buffer size",
"output buffer size", "compute buffer size"), for the target model, an external draft model and a
native MTP head. Which rows count against the budget depends on the backend: on the CPU everything
is RAM; on CUDA and Metal only the device's own buffers count (Metal's mapped weights do).
"""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from fitter.cache import CACHES
from fitter.fit.calibration import Applied, BufferChange, Calibration, build_key, store_path
from fitter.fit.calibration import load as load_calibration
from fitter.ggml import backends
from fitter.ggml.backends import tensor_info_alloc_size
from fitter.ggml.backends.base import FlashAttnShape
from fitter.gguf.reader import GGUFHeader
from fitter.llama.context import compute_buffers
from fitter.llama.cparams import Backend, ConfigError, ContextParams, Frontend, RunConfig, resolve_context
from fitter.llama.graph_details import graph_details
from fitter.llama.hparams import LayerKind, ModelSpec
from fitter.llama.kv_cache import memory_caches
from fitter.llama.lora import lora_buffers, lora_details, read_lora
from fitter.llama.weights import CPU_DEV, WeightPlacement, device_buffer_name, weight_buffers, weight_placement
from fitter.llama_builds import PINNED, LlamaBuild
from fitter.record import Record

Owner = Literal["target", "draft", "mtp", "mmproj"]
Kind = Literal["model", "lora", "kv", "rs", "output", "compute"]


class Buffer(Record):
    owner: Owner
    device: str  # llama.cpp's buffer name: CPU, CPU_Mapped, MTL0, MTL0_Mapped, CUDA0, CUDA_Host...
    kind: Kind
    bytes: int
    counts: bool  # counts against the budget of the chosen backend's device
    detail: str = ""
    tensor_bytes: int | None = None  # model rows: the tensors' own bytes, without a mapped range's padding


def counts_against_budget(backend: Backend, on_device: bool) -> bool:
    """The one rule for which buffers count against the budget (`fit`, `quants`, the solver: every Buffer row).
    On the CPU backend every buffer is the one RAM. On a GPU only the device's own buffers count: CUDA0, MTL0 and
    MTL0_Mapped, not CPU, CPU_Mapped or CUDA_Host. On Metal the input layer (token embedding) stays on the CPU
    (llama_model::load_tensors: dev_input is the CPU with the CPU buffer types; ggml-metal has no host buffer type),
    so with mmap it is CPU_Mapped, plain mapped file pages that are no Metal buffer and outside
    recommendedMaxWorkingSetSize; MTL0_Mapped wraps its tensors' whole file range (get_mapping_range,
    ggml_backend_metal_device_buffer_mapped), so it holds the token embedding's bytes too where the file puts them
    between its tensors (llama-quantize's order), and counts them then (fitter.llama.weights.weight_buffers)."""
    return on_device or not backends.get(backend).is_gpu


class Prediction(Record, frozen=False):
    backend: Backend
    frontend: Frontend
    context: ContextParams
    draft_context: ContextParams | None = None
    buffers: list[Buffer]
    calibration: list[Applied] = field(default_factory=list)  # stored calibrations used (`ggfit calibrate`)

    @property
    def total_device_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers if b.counts)

    @property
    def total_host_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers if not b.counts)

    def device_totals(self) -> dict[str, int]:
        """Bytes per device buffer type that counts against a device budget (CUDA0, CUDA1, MTL0, or CPU alone)."""
        out: dict[str, int] = {}
        for b in self.buffers:
            if b.counts:
                out[b.device.removesuffix("_Mapped")] = out.get(b.device.removesuffix("_Mapped"), 0) + b.bytes
        return out

    @property
    def host_bytes(self) -> int:
        """What lands in system RAM next to a GPU: host buffers (CUDA_Host, CPU), and of mmapped weights
        (CPU_Mapped) the tensors' own bytes, the pages a decode touches; 0 on the CPU backend, where everything
        counts against the one budget."""
        return sum((b.tensor_bytes or b.bytes) if b.device.endswith("_Mapped") else b.bytes
                   for b in self.buffers if not b.counts)

    def by_kind(self, kind: Kind, owner: Owner | None = None) -> int:
        return sum(b.bytes for b in self.buffers if b.kind == kind and (owner is None or b.owner == owner))


def placement_of(spec: ModelSpec, config: RunConfig, backend: Backend, n_gpus: int = 1) -> WeightPlacement:
    """Where llama.cpp puts each layer and tensor for these flags (-ngl, -ot, --cpu-moe, --n-cpu-moe, -sm, -mg, -ts).
    There are at least as many GPUs as -ts has proportions and -mg needs."""
    n_rpc = len(config.rpc.split(",")) if config.rpc else 0  # one device per rpc-server unless told more (n_gpus)
    n_rpc += backends.get(backend).local_gpus if n_rpc else 0  # a local GPU after the RPC devices
    n_gpus = max(n_gpus, len(config.tensor_split or ()), config.main_gpu + 1, n_rpc)
    return weight_placement(len(spec.layers), backend, config.n_gpu_layers, overrides=config.tensor_overrides(),
                            n_gpus=n_gpus, tensor_split=config.tensor_split, split_mode=config.split_mode,
                            main_gpu=config.main_gpu, remote=config.rpc_backends)


def repack_applies(spec: ModelSpec, config: RunConfig, backend: Backend, n_gpus: int = 1) -> bool:
    """Whether --repack / --no-repack (llama.cpp's extra CPU buffer types) can change where a weight goes, and so
    whether llama-server needs --no-repack for this prediction. llama-model.cpp make_cpu_buft_list: a CPU weight
    takes the first of ACCEL, the first GPU's host buffer type, the CPU's extra types (repack, AMX: MUL_MAT and
    MUL_MAT_ID alone, ggml-cpu/repack.cpp supports_op), CPU. CUDA has a host type (CUDA_Host) that takes every
    weight CUDA multiplies, before the extra ones; Metal has none (ggml-metal.cpp get_host_buffer_type NULL): the
    extra types take its CPU-side matrices (-ngl below all, --n-cpu-moe, --cpu-moe, -ot =CPU; the input layer's
    token embedding is a GET_ROWS, which they refuse); the CPU backend: every matrix."""
    impl = backends.get(backend)
    if not impl.is_gpu:
        return True
    if impl.has_host_buffer_type:
        return False
    wp = placement_of(spec, config, backend, n_gpus)
    return CPU_DEV in wp.layer_dev or any(d == CPU_DEV for _, d in wp.overrides)


def _context_buffers(
    owner: Owner,
    spec: ModelSpec,
    cp: ContextParams,
    backend: Backend,
    n_gpu_layers: int,
    *,
    placement: WeightPlacement | None = None,
    kv_host: bool = False,
    op_offload: bool = True,
    mtp: bool = False,
    calibration: Calibration | None = None,
    details=None,
    changed: list[BufferChange] | None = None,
    terms: bool = True,
) -> list[Buffer]:
    impl = backends.get(backend)
    cpu = not impl.is_gpu
    wp = placement or weight_placement(len(spec.layers), backend, n_gpu_layers)
    out: list[Buffer] = []
    # llama_context::output_reserve(n_seq_max): logits for n_seq_max outputs (+ embeddings), in the host buffer
    # type of the output layer's device (the CPU's own when the output layer stays on the CPU)
    n_out = cp.n_seq_max
    output = spec.n_vocab * n_out * 4 + (spec.n_embd * n_out * 4 if cp.embeddings else 0)
    out_host = impl.on(wp.layer_dev[-1]).host_buffer_name if wp.layer_dev[-1] != CPU_DEV else "CPU"
    out.append(Buffer(owner=owner, device=out_host, kind="output", bytes=output,
                      counts=counts_against_budget(backend, False),  # host memory: the host buffer type
                      detail=f"logits {spec.n_vocab} x {n_out} outputs x f32"))
    for cache in memory_caches(spec, cp, mtp=mtp):
        # llama_kv_cache / llama_memory_recurrent: the layer's device when offloaded (offload_kqv), else the CPU
        by_dev: dict[int, list[int]] = {}
        for il in cache.layers:
            d = CPU_DEV if cpu or kv_host else wp.layer_dev[il]
            by_dev.setdefault(d, []).append(il)
        what = f"{cache.name}: {cache.cells} cells x {cache.n_stream} stream(s), {len(cache.layers)} layers"
        if cache.kind == "kv":
            what += f", K {cache.type_k}" + (f" V {cache.type_v}" if cache.type_v else " (MLA: no V)")
        for d in sorted(by_dev, key=lambda d: (d == CPU_DEV, d)):
            layers = by_dev[d]
            device = "CPU" if d == CPU_DEV else device_buffer_name(impl, d)
            share = cache.bytes * len(layers) // max(1, len(cache.layers))
            out.append(Buffer(owner=owner, device=device, kind=cache.kind, bytes=share, counts=counts_against_budget(backend, d != CPU_DEV),
                              detail=what))
    for cb in compute_buffers(spec, cp, backend.value, n_gpu_layers=n_gpu_layers, details=details, mtp=mtp,
                              placement=wp, kv_host=kv_host, op_offload=op_offload, terms=terms):
        on_device = counts_against_budget(backend, impl.is_device_buffer(cb.device)
                                          or cb.device in {device_buffer_name(impl, g) for g in wp.gpus})
        size = cb.bytes
        detail = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in cb.terms.items())
        corr = calibration and (calibration.device if on_device else calibration.host)
        if corr:
            size = corr.apply(size)
            if size != cb.bytes:
                detail = f"calibrated from {cb.bytes / 2**20:.1f} MiB; " + detail
                if changed is not None:
                    changed.append(BufferChange(owner=owner, device=cb.device, predicted_bytes=cb.bytes,
                                                calibrated_bytes=size))
        out.append(Buffer(owner=owner, device=cb.device, kind="compute", bytes=size, counts=on_device, detail=detail))
    return out


_WEIGHT_CACHE: dict[tuple, tuple[GGUFHeader, list[Buffer]]] = CACHES.keep({}, "weights")


def _weight_rows(owner: Owner, header: GGUFHeader, spec: ModelSpec, backend: Backend, config: RunConfig, load_mtp: bool,
                 placement: WeightPlacement) -> list[Buffer]:
    # weights do not depend on the context: the solver asks for the same rows many times
    key = (id(header), owner, backend, placement, config.no_mmap, load_mtp)
    hit = _WEIGHT_CACHE.get(key)
    if hit is not None and hit[0] is header:  # the same header object, not a new one at a reused id
        return list(hit[1])
    rows = _weight_rows_uncached(owner, header, spec, backend, config, load_mtp, placement)
    if len(_WEIGHT_CACHE) > 32:
        _WEIGHT_CACHE.clear()
    _WEIGHT_CACHE[key] = (header, rows)
    return list(rows)


MAPPED_GAP_NOTE = 1024**2  # a mapped range this much over its tensors' bytes says so (padding is a few KiB)


def _weight_rows_uncached(owner: Owner, header: GGUFHeader, spec: ModelSpec, backend: Backend, config: RunConfig,
                          load_mtp: bool, placement: WeightPlacement) -> list[Buffer]:
    rows = []
    for wb in weight_buffers(
        header, spec, backend, n_gpu_layers=config.n_gpu_layers, use_mmap=not config.no_mmap, load_mtp=load_mtp,
        alloc_size=tensor_info_alloc_size,  # CUDA pads quantized rows (ggml_backend_cuda_buffer_type_get_alloc_size)
        placement=placement,
    ):
        detail = f"{wb.n_tensors} tensors"
        if wb.bytes - wb.tensor_bytes >= MAPPED_GAP_NOTE:  # a mapped range over tensors placed elsewhere
            detail += (f" ({wb.tensor_bytes / 2**20:,.2f} MiB) and {(wb.bytes - wb.tensor_bytes) / 2**20:,.2f} MiB of "
                       "other buffers' tensors between them in the file, mapped with them")
        rows.append(Buffer(owner=owner, device=wb.buffer, kind="model", bytes=wb.bytes,
                           counts=counts_against_budget(backend, wb.on_device), detail=detail,
                           tensor_bytes=wb.tensor_bytes))
    return rows


def predict(
    header: GGUFHeader,
    spec: ModelSpec,
    config: RunConfig,
    backend: Backend = Backend.CPU,
    frontend: Frontend = Frontend.SERVER,
    draft: tuple[GGUFHeader, ModelSpec] | None = None,
    *,
    calibrated: bool = True,
    build: LlamaBuild = PINNED,
    n_gpus: int = 1,
    terms: bool = True,
) -> Prediction:
    """Predict every buffer of a llama.cpp run (target, then draft or MTP context).

    With `calibrated`, compute buffers use the corrections `ggfit calibrate` stored for this
    architecture, backend and llama.cpp build, if any. `n_gpus`: how many GPUs llama.cpp sees (-sm, -ts, -mg
    spread the layers over them). Without `terms` the compute buffers' details (what was alive at the high-water
    mark) stay empty: the same bytes, for a caller that reads totals only (the solver's searches), without the
    allocator's bookkeeping of the live tensors (an eighth of a prediction)."""
    cal = _calibration(spec.architecture, backend, build) if calibrated else None
    config, cp = _context_of(spec, config, backend, frontend, build, n_gpus)
    use_mtp = config.spec_type == "draft-mtp"
    wp = placement_of(spec, config, backend, n_gpus)
    ctx_kw: dict = dict(placement=wp, kv_host=config.no_kv_offload, op_offload=not config.no_op_offload, terms=terms)
    buffers = _weight_rows("target", header, spec, backend, config, use_mtp, wp)
    details = graph_details(header)
    adapters = [read_lora(path, scale) for path, scale in config.lora]
    buffers += _lora_rows(adapters, header, spec, backend, wp, config)
    changed: list[BufferChange] = []
    # the context's graph with the adapters (llama-server applies them before its first decode re-reserves); an MTP
    # or draft context gets none
    buffers += _context_buffers("target", spec, cp, backend, config.n_gpu_layers, calibration=cal,
                                details=lora_details(details, adapters), changed=changed, **ctx_kw)
    d_cal, d_changed = None, changed

    draft_cp = None
    if use_mtp:
        if not spec.has_mtp:
            raise ConfigError(f"--spec-type draft-mtp: {spec.architecture} model has no NextN/MTP layers")
        # common_base_params_to_speculative: same context, draft cache types, n_outputs_max = n_parallel
        draft_cp = _draft_context(spec, config, frontend, build, mtp=True)
        buffers += _context_buffers("mtp", spec, draft_cp, backend, config.n_gpu_layers, mtp=True, calibration=cal,
                                    details=details, changed=changed, **ctx_kw)
    elif draft is not None:
        d_cal = _calibration(draft[1].architecture, backend, build) if calibrated else None
        if d_cal is not cal:
            d_changed = []
        draft_cp = _draft_rows(buffers, draft, config, backend, frontend, build, n_gpus, d_cal, d_changed, terms)
    if config.mmproj:
        buffers += _mmproj_rows(config, backend, header, spec)
    applied = [_applied(cal, changed)] if cal else []
    if d_cal is not None and d_cal is not cal:
        applied.append(_applied(d_cal, d_changed))
    return Prediction(backend=backend, frontend=frontend, context=cp, draft_context=draft_cp, buffers=buffers,
                      calibration=applied)


def _lora_rows(adapters: list, header: GGUFHeader, spec: ModelSpec, backend: Backend, wp: WeightPlacement,
               config: RunConfig) -> list[Buffer]:
    """The adapters' buffers: llama_adapter_lora_init after the model, before the context (common_init_result)."""
    return [Buffer(owner="target", device=lb.buffer, kind="lora", bytes=lb.bytes,
                   counts=counts_against_budget(backend, lb.on_device), detail=f"{lb.n_tensors} tensors of {a.path}")
            for a in adapters for lb in lora_buffers(a, header, spec, backend, wp, use_mmap=not config.no_mmap)]


def _draft_rows(buffers: list[Buffer], draft: tuple[GGUFHeader, ModelSpec], config: RunConfig, backend: Backend,
                frontend: Frontend, build: LlamaBuild, n_gpus: int, d_cal: Calibration | None,
                d_changed: list[BufferChange], terms: bool) -> ContextParams:
    """Appends the draft model's weights and context buffers to `buffers`; returns the draft's context."""
    d_header, d_spec = draft
    draft_cp = _draft_context(d_spec, config, frontend, build)
    # the draft model takes the target's -ngl but none of its tensor overrides (-otd, -cmoed are not modelled)
    d_cfg = config.model_copy(update={"override_tensor": (), "cpu_moe": False, "n_cpu_moe": 0})
    d_wp = placement_of(d_spec, d_cfg, backend, n_gpus)
    buffers += _weight_rows("draft", d_header, d_spec, backend, config, False, d_wp)
    buffers += _context_buffers("draft", d_spec, draft_cp, backend, config.n_gpu_layers, calibration=d_cal,
                                details=graph_details(d_header), changed=d_changed, placement=d_wp,
                                kv_host=config.no_kv_offload, op_offload=not config.no_op_offload, terms=terms)
    return draft_cp


def _mmproj_rows(config: RunConfig, backend: Backend, header: GGUFHeader, spec: ModelSpec) -> list[Buffer]:
    """--mmproj: the projector's weights and warmup compute buffer (fitter.mtmd), on the first GPU unless
    --no-mmproj-offload; mtmd_context_params.flash_attn_type is the server's -fa. A projector whose width is not the
    text model's is refused, as mtmd does."""
    from fitter.llama.model import n_embd_inp
    from fitter.mtmd.memory import mmproj_buffers_of_file

    assert config.mmproj is not None
    rows = mmproj_buffers_of_file(config.mmproj, backend, offload=not config.no_mmproj_offload,
                                  flash_attn=config.flash_attn, n_embd_text=n_embd_inp(header, spec.n_embd))
    return [Buffer(owner="mmproj", device=r.device, kind=r.kind, bytes=r.bytes,
                   counts=counts_against_budget(backend, r.on_device), detail=r.detail) for r in rows]


class BuildDifference(Record, frozen=False):
    """One rule of the user's llama.cpp build that is not the pinned build's, and what it does to this prediction."""

    change: str  # the id in fitter.llama_builds.changes
    prs: list[int]
    rule: str  # what this build does, in one line
    device_bytes: int  # the total against the budget with this build's rule minus with the pinned build's
    uncertain: bool  # the change's merge date is unknown and the build lies in the window that holds it

    @property
    def line(self) -> str:
        prs = f" (#{', #'.join(map(str, self.prs))})" if self.prs else ""
        cost = f": {self.device_bytes / 2**20:+,.2f} MiB" if self.device_bytes else ""
        return f"{self.rule}{prs}{cost}" + (" [uncertain for this build: merge date unknown]" if self.uncertain else "")


def build_differences(header: GGUFHeader, spec: ModelSpec, config: RunConfig, backend: Backend, frontend: Frontend,
                      draft: tuple[GGUFHeader, ModelSpec] | None, pred: Prediction, *,
                      n_gpus: int = 1) -> list[BuildDifference]:
    """The rules in which the prediction's build differs from the pinned one that can apply on this backend, each
    with what it costs here: the same prediction with that one rule taken the pinned build's way."""
    build = pred.context.build
    out = []
    for c in build.differences():
        if c.backend not in ("all", backends.get(backend).label):
            continue
        alt = predict(header, spec, config, backend, frontend, draft, build=build.flip(c.id), n_gpus=n_gpus,
                      terms=False)
        rule = c.before if not build.has(c.id) else (c.after or c.id)
        out.append(BuildDifference(change=c.id, prs=list(c.until_prs if build.has(c.id) and c.after else c.prs),
                                   rule=rule, device_bytes=pred.total_device_bytes - alt.total_device_bytes,
                                   uncertain=build.uncertain(c.id)))
    return out


def _resolve_fa_auto(spec: ModelSpec, config: RunConfig, backend: Backend,
                     n_gpus: int = 1) -> tuple[RunConfig, str | None]:
    """-fa auto: llama_context::resolve_fused_ops turns flash attention off when a layer's FLASH_ATTN_EXT cannot run
    on the device (the backend's fa_auto_unsupported_reason: Metal's ggml_metal_device_supports_op; the CPU runs every
    FA node; CUDA's rules are not mirrored), unless a quantized V cache made llama_init_from_model force it on."""
    if config.flash_attn != "auto":
        return config, None
    impl = backends.get(backend)
    if config.type_v not in ("f32", "f16", "bf16"):
        return config, None  # forced on for the quantized V cache
    heads = ((layer.n_embd_head_k, layer.n_embd_head_v) for layer in spec.layers[: spec.n_layer]
             if layer.kind != LayerKind.RECURRENT and layer.has_kv)  # in layer order (read only where the rules are)
    if impl.local_gpus:  # RPC devices beside a local GPU: the layers on each device, by that device's rules
        why = impl.fa_auto_unsupported_reason_on(_fa_shapes_on_local(spec, config, backend, n_gpus))
    else:
        why = impl.fa_auto_unsupported_reason(heads, config.type_k, config.type_v)
    if why:
        return config.model_copy(update={"flash_attn": "off"}), f"off (-fa auto on {impl.label}: {why})"
    return config, None


def _context_of(spec: ModelSpec, config: RunConfig, backend: Backend, frontend: Frontend, build: LlamaBuild,
                n_gpus: int) -> tuple[RunConfig, ContextParams]:
    """The config with -fa auto resolved, and its context (the note says why -fa auto went off)."""
    config, fa_note = _resolve_fa_auto(spec, config, backend, n_gpus)
    cp = resolve_context(spec, config, frontend, build=build)
    if fa_note:
        cp = cp.model_copy(update={"defaults_applied": {**cp.defaults_applied, "flash_attn": fa_note}})
        if backends.get(backend).local_gpus:  # the caches were made with FA on (llama_context: memory, then
            cp = cp.model_copy(update={"v_trans": False})  # sched_reserve's resolve_fused_ops)
    return config, cp


def _fa_shapes_on_local(spec: ModelSpec, config: RunConfig, backend: Backend, n_gpus: int) -> list[FlashAttnShape]:
    """The FLASH_ATTN_EXT shapes (heads, cache types) of the attention layers on a GPU of the main host, beside RPC
    devices, which take every op."""
    impl = backends.get(backend)
    wp = placement_of(spec, config, backend, n_gpus)
    return [FlashAttnShape(d_k=layer.n_embd_head_k, d_v=layer.n_embd_head_v, n_q=1, n_head=layer.n_head,
                           n_head_kv=layer.n_head_kv, n_kv=256, type_k=config.type_k, type_v=config.type_v)
            for il, layer in enumerate(spec.layers[: spec.n_layer])
            if layer.kind != LayerKind.RECURRENT and layer.has_kv and wp.layer_dev[il] != CPU_DEV
            and not impl.on(wp.layer_dev[il]).remote]


def _draft_context(spec: ModelSpec, config: RunConfig, frontend: Frontend, build: LlamaBuild, *,
                   mtp: bool = False) -> ContextParams:
    # common_base_params_to_speculative (common/speculative.cpp): the target's params with the draft's
    # cache types, n_outputs_max = n_parallel and no recurrent snapshots
    dcfg = config.model_copy(update={"type_k": config.draft_type_k, "type_v": config.draft_type_v})
    cp = resolve_context(spec, dcfg, frontend, mtp=True, build=build)
    return cp.model_copy(update={"n_outputs_max": cp.n_seq_max, "n_rs_seq": 0})


_CAL_CACHE: dict[tuple[str, str, str], Calibration | None] = CACHES.keep({}, "calibration")


def _applied(cal: Calibration, changed: list[BufferChange]) -> Applied:
    return Applied(architecture=cal.architecture, backend=cal.backend, llama_cpp=cal.llama_cpp,
                   stored=str(store_path()), identity=cal.identity, changed=changed)


def _calibration(arch: str, backend: Backend, build: LlamaBuild) -> Calibration | None:
    """The stored calibration of this architecture and backend for `build` (`ggfit calibrate`, `calibrate --log`)."""
    key = (arch, backend.value, build_key(build))
    if key not in _CAL_CACHE:
        _CAL_CACHE[key] = load_calibration(*key)
    return _CAL_CACHE[key]
