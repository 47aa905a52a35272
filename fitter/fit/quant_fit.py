"""`ggfit quants`: which quant of a model fits a budget, from one header, before any download.

Every llama-quantize ftype is predicted from the header's tensor shapes (fitter.fit.quants); candidate
files that are not plain llama-quantize output (unsloth UD-*, imatrix mixes) are read as given, from
a path or a URL (only the header travels), or taken as a size from a listing. Each candidate is then
run through the memory model at the requested settings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from fitter.errors import GGFitError
from fitter.fit.budget import parse_size
from fitter.fit.largest import next_hint
from fitter.fit.memory import predict
from fitter.fit.quants import QuantPrediction, predict_all
from fitter.fit.solver import CTX_STEP, Available, excess, largest_context
from fitter.ggml import backends
from fitter.ggml.types import pad
from fitter.gguf.constants import GGMLQuantizationType
from fitter.gguf.reader import GGUFHeader, ShardInfo, TensorInfo, read_header
from fitter.llama.cparams import Backend, ConfigError, Frontend, RunConfig
from fitter.llama.hparams import ModelSpec
from fitter.llama.model import model_spec_from_header, requantized_spec
from fitter.llama_builds import PINNED, LlamaBuild
from fitter.record import Record


class Candidate(Record, frozen=False):
    name: str
    source: str  # "predicted from the header", a path or URL, or "size from a listing"
    file_bytes: int
    total_device_bytes: int
    headroom_bytes: int  # budget - margin - total
    n_ctx: int  # the context the total is for
    largest_ctx: int  # the largest context that fits with the same settings (0: none)
    fits: bool
    needs_imatrix: bool = False
    exact: bool = True  # False: a size-only candidate, its weights scaled from the header's tensors
    note: str | None = None


_GGML_TYPES = {int(t): t for t in GGMLQuantizationType}  # by id: calling the enum costs microseconds a tensor


def quantized_header(base: GGUFHeader, q: QuantPrediction) -> GGUFHeader:
    """The header llama-quantize would write: the same tensors with the predicted types, packed in its
    output order and padded to the alignment, as one file."""
    align = base.shards[0].alignment
    tensors, offset = [], 0
    for tq in q.tensors:  # each with its tensor's name and shape (fitter.fit.quants._tensor_rows)
        gtype = _GGML_TYPES.get(tq.ggml_type)
        if gtype is None:
            raise ValueError(f"{tq.ggml_type} is not a GGMLQuantizationType")  # as the enum's own call says
        n = tq.nbytes
        tensors.append(TensorInfo(tq.name, tq.shape, gtype, offset, n, 0))
        offset += (n + align - 1) // align * align  # pad(n, align)
    s0 = base.shards[0]
    shard = s0.model_copy(update={"location": f"{s0.location} as {q.ftype}", "file_size": q.file_bytes,
                                  "data_offset": q.header_bytes, "header_bytes": q.header_bytes, "bytes_fetched": 0})
    return GGUFHeader(dict(base.metadata), tensors, [shard])


THIS_FILE = "this file"  # a quant whose every tensor has the given file's type: the file, not a requantized copy


def is_this_file(header: GGUFHeader, q: QuantPrediction) -> bool:
    """Whether the quant has every tensor of the file, each with the file's own type. Its row is then the file as
    `fit` reads it (its layout: whether the CPU's token embedding lies inside the Metal mapped range depends on where
    the file puts it, fitter.llama.weights), not the copy llama-quantize would write."""
    if len(q.tensors) != len(header.tensors):
        return False
    own = {t.name: int(t.ggml_type) for t in header.tensors}
    return all(own.get(t.name) == t.ggml_type for t in q.tensors)


def _scaled_header(base: GGUFHeader, file_bytes: int) -> GGUFHeader:
    """A size-only candidate: the header's tensors scaled so that the file has the given size."""
    factor = max(0.0, (file_bytes - base.header_size) / max(1, base.tensor_bytes))
    align = base.shards[0].alignment
    tensors, offset = [], 0
    for t in base.tensors:
        n = int(t.nbytes * factor)
        tensors.append(TensorInfo(t.name, t.shape, t.ggml_type, offset, n, 0))
        offset += pad(n, align)
    s0: ShardInfo = base.shards[0]
    shard = s0.model_copy(update={"file_size": file_bytes, "bytes_fetched": 0})
    return GGUFHeader(dict(base.metadata), tensors, [shard])


_SIZE = re.compile(r"^\s*[0-9.]+\s*[KMGT]i?B\s*$", re.IGNORECASE)


def parse_candidate(text: str) -> tuple[str, str]:
    """NAME=PATH_OR_URL or NAME=21109MiB."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise ConfigError(f"--candidate {text!r}: use NAME=PATH, NAME=URL or NAME=SIZE (e.g. UD-Q4_K_XL=21109MiB)")
    return name.strip(), value.strip()


# (name, source, header, its spec where it is another quant of this header's, needs an imatrix, exact, note)
_Entry = tuple[str, str, GGUFHeader, ModelSpec | None, bool, bool, str | None]


def _ftype_entries(header: GGUFHeader, spec: ModelSpec, include_imatrix: bool) -> list[_Entry]:
    """Every ftype llama-quantize makes of this header's model, the file itself as it is."""
    entries: list[_Entry] = []
    for q in predict_all(header):
        if q.refused or (q.needs_imatrix and not include_imatrix):
            continue
        note = "needs an importance matrix (--imatrix)" if q.needs_imatrix else None
        if is_this_file(header, q):  # the file itself, as fit reads it: its own layout and header
            entries.append((q.ftype, THIS_FILE, header, spec, q.needs_imatrix, True, note))
            continue
        try:
            qh = quantized_header(header, q)
        except ValueError:
            continue  # a ggml type the gguf package does not know yet (Q2_0): not representable here
        qs = requantized_spec(spec, qh) if spec.known else None  # (an unknown one: model_spec_from_header refuses it)
        entries.append((q.ftype, "predicted from the header", qh, qs, q.needs_imatrix, True, note))
    return entries


def _candidate_entries(header: GGUFHeader, candidates: Sequence[str]) -> list[_Entry]:
    """--candidate NAME=PATH, URL or SIZE."""
    entries: list[_Entry] = []
    for text in candidates:
        name, value = parse_candidate(text)
        if _SIZE.match(value):
            size = parse_size(value, what=f"--candidate {name}")
            entries.append((name, "size from a listing", _scaled_header(header, size), None, False, False,
                            "weights scaled from the header's tensors; compute buffers as for this model"))
        else:
            try:
                ch = read_header(value)
            except GGFitError as e:  # the file or URL's problem, named with the flag that gave it
                raise ConfigError(f"--candidate {name}={value}: {str(e).removeprefix(f'{value}: ')}") from None
            entries.append((name, value, ch, None, False, True, None))
    return entries


def evaluate(
    header: GGUFHeader,
    spec: ModelSpec,
    cfg: RunConfig,
    backend: Backend,
    frontend: Frontend,
    budget_bytes: int,
    margin_bytes: int,
    *,
    candidates: Sequence[str] = (),
    draft: tuple[GGUFHeader, ModelSpec] | None = None,
    include_imatrix: bool = True,
    build: LlamaBuild = PINNED,
    rate: Callable[[str, GGUFHeader, ModelSpec, RunConfig], object] | None = None,
    per_device: dict[str, int] | None = None,
    margins: dict[str, int] | None = None,
) -> list[Candidate]:
    """Every predicted ftype and every given candidate at the requested settings, sorted by file size. `rate` is
    called with each fitting one's name, header, spec and the config it was predicted at (cli_speed: its rates).
    `per_device`: a budget per device (--rpc's devices, in llama.cpp's order), each less the margin; a candidate
    fits when every device does, its headroom the fullest device's; `margins`: a device's own margin where it has one."""
    available: Available = budget_bytes - margin_bytes
    if per_device:
        available = {name: b - (margins or {}).get(name, margin_bytes) for name, b in per_device.items()}
    entries = _ftype_entries(header, spec, include_imatrix) + _candidate_entries(header, candidates)
    out = []
    hint = None  # each candidate's search starts where the last one's ended (solver.largest_fitting)
    for name, source, h, known, needs_im, exact, note in entries:
        s = known or model_spec_from_header(h)
        if s.architecture != spec.architecture or s.n_layer != spec.n_layer:
            raise ConfigError(f"--candidate {name}: a {s.architecture} with {s.n_layer} layers, not the same model")
        pred = predict(h, s, cfg, backend, frontend, draft, build=build, terms=False)
        total = pred.total_device_bytes
        asked: dict[int, int] = {}
        big = largest_context(h, s, cfg, backend, frontend, available, n_ubatch=pred.context.n_ubatch,
                              type_k=pred.context.type_k, type_v=pred.context.type_v, with_draft=draft is not None,
                              draft=draft, ctx_max=max(s.n_ctx_train, pred.context.n_ctx), build=build, hint=hint,
                              asked=asked)
        hint = next_hint(asked, big.n_ctx // CTX_STEP, hint)
        headroom = -excess(pred, available)
        if rate is not None and headroom >= 0:
            cp = pred.context
            rate(name, h, s, cfg.model_copy(update={"n_ctx": cp.n_ctx, "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch,
                                                    "type_k": cp.type_k, "type_v": cp.type_v}))
        out.append(Candidate(
            name=name, source=source, file_bytes=h.file_size, total_device_bytes=total,
            headroom_bytes=headroom, n_ctx=pred.context.n_ctx, largest_ctx=big.n_ctx,
            fits=headroom >= 0, needs_imatrix=needs_im, exact=exact, note=note,
        ))
    out.sort(key=lambda c: c.file_bytes)
    return out


# Types nobody runs: llama-quantize's ALL_F32 output is twice F16's bytes for no gain in quality.
NOT_RUN = frozenset({"F32"})
BEST_RULE = "largest that fits, of the types people run: up to BF16/F16"


def best_fit(cands: list[Candidate]) -> Candidate | None:
    """The largest file that leaves the margin, of the types people run (not F32), and that needs no
    importance matrix if one such fits."""
    ok = [c for c in cands if c.fits]
    run = [c for c in ok if c.name.upper() not in NOT_RUN] or ok
    plain = [c for c in run if not c.needs_imatrix]
    pool = plain or run
    return max(pool, key=lambda c: c.file_bytes) if pool else None


def why_none_fits(cands: list[Candidate], cfg_ctx: int, backend: str = "cuda", moe: bool = False) -> str:
    smallest = min(cands, key=lambda c: c.total_device_bytes)
    if smallest.largest_ctx > 0:
        return (f"nothing fits at -c {cfg_ctx}: the smallest, {smallest.name}, fits up to -c {smallest.largest_ctx}; "
                "lower the context, quantize the KV cache (-ctk/-ctv q8_0), lower -ub or drop the draft")
    # a placement frees device memory on a GPU only: the CPU has none, and Metal's memory is unified
    impl = backends.get(backend)
    move = ("" if not impl.is_gpu else f" ({impl.label}'s memory is unified: weights moved to the CPU free nothing)"
            if impl.unified_memory else " or experts on the CPU (--n-cpu-moe)" if moe else " or fewer offloaded layers (-ngl)")
    return (f"nothing fits even at -c 256: {smallest.name} alone needs "
            f"{smallest.total_device_bytes / 2**20:,.0f} MiB; a bigger budget{move}")
