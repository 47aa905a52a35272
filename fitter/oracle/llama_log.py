"""Pure parsing of llama.cpp's log text into a `LlamaReport`.

Works on any log of the reference build (0c1e57098bba): the one `fitter.oracle.llama_run` captures from its
child, or a llama-server / llama-cli log pasted by a user. Lines are matched by their stable suffix
(`... KV buffer size = X MiB`), never by the exact function prefix, and a line may carry the
leftovers of llama.cpp's progress dots in front of it.

Precision. llama.cpp prints every buffer size in MiB with two decimals (`%8.2f`), so a printed figure
is only known to 0.01 MiB: `bytes = round(MiB * 2**20)` is off by up to 0.005 MiB = 5243 bytes
(`PRINT_TOLERANCE_BYTES`). Finer figures:
  - after a real load, freeing the context logs at DEBUG `~llama_context: CPU compute buffer size is
    514.5020 MiB, matches expectation of ...` (`%8.4f`, to ~52 bytes): `LlamaReport.compute_checks`;
  - exact bytes are not in the log at all; `fitter.oracle.llama_run` gets them from the C API
    (`llama_model_size`, `llama_get_memory_breakdown`).

Dry runs (`no_alloc`). With `no_alloc = 1` llama.cpp gives model weights and the KV cache a dummy
buffer of size 0, so `load_tensors: CPU model buffer size = 0.00 MiB` and `llama_kv_cache: CPU KV
buffer size = 0.00 MiB` are NOT sizes (`BufferLine.dummy` is set). The `llama_kv_cache: size = ...`
line is computed from the tensors and is authoritative in both modes; the output buffer, the
recurrent-state (RS) buffers and the compute buffers are real in both modes (the RS and output
buffers are even allocated in a dry run; the compute size is the reserve's measured size).
"""

from __future__ import annotations

import re

from fitter.oracle.llama_report import (  # noqa: F401  (re-exported: the parser's callers take them with it)
    FINE_PRECISION_MIB,
    MIB,
    PRINT_PRECISION_MIB,
    PRINT_TOLERANCE_BYTES,
    BufferKind,
    BufferLine,
    ComputeCheck,
    ContextInfo,
    GraphInfo,
    HParams,
    KVCacheSize,
    LayerInfo,
    LlamaReport,
    RecurrentStateSize,
    mib_to_bytes,
)


def _num(s: str) -> int | float:
    try:
        return int(s)
    except ValueError:
        return float(s)


def _int_or_list(s: str) -> int | list[int] | None:
    """print_info prints a per-layer value as a scalar when constant, else as `[a, b, ...]` (`print_f`)."""
    s = s.strip()
    if s.startswith("[") and s.endswith("]"):
        try:
            return [int(x) for x in s[1:-1].split(",") if x.strip()]
        except ValueError:
            return None
    try:
        return int(s)
    except ValueError:
        return None


# --- patterns -----------------------------------------------------------------------------------

_FUNC = r"(?P<func>[~A-Za-z_][\w:~]*)"
_F = r"(-?[0-9]+(?:\.[0-9]+)?)"

_BUFFER = re.compile(_FUNC + r":\s+(?P<buf>\S+)\s+(?P<label>\S(?:.*?\S)?)\s+buffer size =\s+(?P<mib>" + _F[1:-1] + r") MiB\s*$")
_PRINT_INFO = re.compile(r"print_info: (?P<key>\S(?:.*?\S)?)\s*= ?(?P<val>.*?)\s*$")
_KV_SIZE = re.compile(
    r"size =\s*" + _F + r" MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\), "
    r"K \((\w+)\):\s*" + _F + r" MiB, V \((\w+)\):\s*" + _F + r" MiB"
)
_RS_SIZE = re.compile(
    r"size =\s*" + _F + r" MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+) seqs(?:\s+(\d+) rs_seq)?\), "
    r"R \((\w+)\):\s*" + _F + r" MiB, S \((\w+)\):\s*" + _F + r" MiB(?:, P \((\w+)\):\s*" + _F + r" MiB)?"
)
_KV_CREATE = re.compile(r"creating\s+(?P<role>\S(?:.*?\S)?)\s+KV cache, size = (?P<cells>\d+) cells")
_COMPUTE_CHECK = re.compile(
    r"(?P<buf>\S+) compute buffer size (?:is|of)\s+" + _F + r" MiB, (?P<m>matches|does not match) expectation of\s+" + _F + r" MiB"
)
_GRAPH = re.compile(
    r"graph(?: \(pp bs=(?P<pp>\d+), tg bs=(?P<tg>\d+)\))?: nodes = (?P<nodes>[\d /-]+?), splits = (?P<splits>[\d /-]+?)"
    r"(?:, input objects = (?P<io>[\d /-]+?), input tensors = (?P<it>[\d /-]+?))?\s*$"
)
_RESERVE = re.compile(r"sched_reserve: reserve took\s+" + _F + r" ms")
_CTX_KV = re.compile(r"llama_context: (?P<key>\w+)\s+= (?P<val>\S+)\s*$")
_LAYER = re.compile(r"load_tensors: layer\s+(\d+) assigned to device (\S+), is_swa = (\d+)")
_LOAD_MODE = re.compile(r"loading model tensors, .*\(load_mode = (?P<m>[^)]+)\)")
_FA_RESOLVED = re.compile(r"(?:resolve_fused_ops: Flash Attention (?P<v>enabled|not supported, set to disabled)"
                          r"|Flash Attention was auto, set to (?P<w>enabled|disabled))")
_ABORT = re.compile(r"^(?P<msg>\S+\.(?:c|cc|cpp|cxx|h|hpp|cu|m|mm):\d+: .+)$")
_TERMINATE = re.compile(r"^terminate called after throwing an instance of (?P<what>.+)$")
_WHAT = re.compile(r"^\s*what\(\):\s*(?P<msg>.*)$")


def _kind(label: str) -> BufferKind:
    low = label.lower()
    if low == "model":
        return "model"
    if low == "kv":
        return "kv"
    if low == "rs":
        return "rs"
    if low == "output":
        return "output"
    if low == "compute":
        return "compute"
    if low.endswith("state"):
        return "state"
    if low == "lora":
        return "lora"
    return "other"


def _pair(s: str | None) -> tuple[int | None, int | None]:
    if s is None:
        return None, None
    parts = [p.strip() for p in s.split("/")]
    try:
        a = int(parts[0])
        b = int(parts[1]) if len(parts) > 1 else a
    except ValueError:
        return None, None
    return a, b


def _bool(s: str) -> bool | None:
    s = s.strip().lower()
    if s in ("1", "true", "yes"):
        return True
    if s in ("0", "false", "no"):
        return False
    return None


def _size_to_mib(s: str) -> tuple[float | None, float | None]:
    m = re.match(r"\s*" + _F + r" (MiB|GiB) \(" + _F + r" BPW\)", s)
    if not m:
        return None, None
    v = float(m.group(1)) * (1024.0 if m.group(2) == "GiB" else 1.0)
    return v, float(m.group(3))


_SCALE = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def _hparams(pi: dict[str, str], layers: list[LayerInfo]) -> HParams:
    h: dict[str, object] = {}

    def get_int(key: str) -> int | None:
        v = pi.get(key)
        if v is None:
            return None
        try:
            return int(v)
        except ValueError:
            return None

    for key in (
        "n_layer", "n_layer_all", "n_embd", "n_embd_inp", "n_embd_out", "n_embd_head_k", "n_embd_head_v",
        "n_embd_head_k_swa", "n_embd_head_v_swa", "n_rot", "n_swa", "n_ctx_train", "n_expert", "n_expert_used",
        "n_vocab", "ssm_d_conv", "ssm_d_inner", "ssm_d_state", "ssm_dt_rank", "ssm_n_group",
    ):
        h[key] = get_int(key)
    for key in ("n_head", "n_head_kv", "n_embd_k_gqa", "n_embd_v_gqa", "n_ff"):
        h[key] = _int_or_list(pi[key]) if key in pi else None
    h["arch"] = pi.get("arch")
    h["is_swa_any"] = _bool(pi["is_swa_any"]) if "is_swa_any" in pi else None
    h["causal_attn"] = _bool(pi["causal attn"]) if "causal attn" in pi else None
    h["pooling_type"] = get_int("pooling type")
    h["file_type"] = pi.get("file type")
    if "file size" in pi:
        h["file_size_mib"], h["file_bpw"] = _size_to_mib(pi["file size"])
    h["model_type"] = pi.get("model type")
    mp = re.match(r"\s*" + _F + r" ([KMBT])\s*$", pi.get("model params", ""))
    h["model_params"] = round(float(mp.group(1)) * _SCALE[mp.group(2)]) if mp else None
    h["vocab_type"] = pi.get("vocab type")
    h["general_name"] = pi.get("general.name")
    n_all = h["n_layer_all"] if h["n_layer_all"] is not None else h["n_layer"]
    if layers and isinstance(n_all, int):  # get_int: an int or None
        by_il = {li.il: li.is_swa for li in layers if not li.is_output}
        if set(by_il) == set(range(n_all)):
            h["is_swa"] = [by_il[i] for i in range(n_all)]
    return HParams(**h)


# What a user's copy of a log adds in front of llama.cpp's own text: colours (common_log's -co), common_log's
# timestamp and level ("0.08.770.185 I ", --log-timestamps --log-prefix), a container or journal time stamp
# ("2026-05-14 22:14:13.291 | "), a process id ("[34353] ").
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_LINE_PREFIX = re.compile(
    r"^(?:\s*\d+\.\d{2}\.\d{3}\.\d{3} [IWEDT] "
    r"|\s*\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?Z?\s*(?:\|\s*)?"
    r"|\s*\[\d+\]\s+)+"
)
# functions whose lines parse_log anchors at the start; a module tag ("cmn  ", "srv  ") may precede them
_ANCHORED = ("print_info:", "llama_context:")
MAX_LINE_CHARS = 4096  # llama.cpp's memory lines are short; a longer line is cut (bounded regex work)


def clean_line(line: str) -> str:
    """A log line as llama.cpp printed it: without colours, time stamps and prefixes, cut at MAX_LINE_CHARS."""
    line = line[:MAX_LINE_CHARS]
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    line = _LINE_PREFIX.sub("", line, count=1)
    for token in _ANCHORED:
        k = line.find(token)
        if k > 0 and line[k - 1] in " |]\t" and not line.startswith(token):
            return line[k:]
    return line


def parse_log(text: str) -> LlamaReport:
    """Parse a llama.cpp log (any mix of levels; DEBUG lines add per-layer SWA flags and the fine compute check).
    Lines may carry a user's terminal or container prefixes (`clean_line`)."""
    parser = _LogParser()
    for i, raw in enumerate(text.splitlines(), start=1):
        parser.feed(i, clean_line(raw.rstrip("\r\n")))
    return parser.report()


class _LogParser:
    """parse_log's state over the lines; each `_...` step takes a line it knows and says so (True)."""

    def __init__(self) -> None:
        self.r = LlamaReport()
        self.ctx: dict[str, str] = {}
        self.pending_role: str | None = None
        self.seen_iswa = False
        self.swa_full_warned = False
        self.fa_resolved: bool | None = None
        self.layers: dict[int, LayerInfo] = {}
        self.terminate_what: str | None = None
        self.terminate_seen = False

    def feed(self, i: int, line: str) -> None:
        # progress dots (LLAMA_LOG_CONT) may run into the next line's start
        stripped = line.lstrip(".")
        steps = (self._print_info, self._buffer, self._memory_size, self._kv_create, self._compute_check,
                 self._graph, self._context_line, self._abort)
        for step in steps:
            if step(i, line, stripped):
                return

    def _print_info(self, i: int, line: str, stripped: str) -> bool:
        m = _PRINT_INFO.search(stripped)
        if not (m and stripped.startswith("print_info:")):
            return False
        key, val = m.group("key"), m.group("val")
        if key in self.r.print_info:
            self.r.print_info_repeats.setdefault(key, [self.r.print_info[key]]).append(val)
        else:
            self.r.print_info[key] = val
        return True

    def _buffer(self, i: int, line: str, stripped: str) -> bool:
        m = _BUFFER.search(stripped)
        if not m:
            return False
        mib = float(m.group("mib"))
        self.r.buffers.append(BufferLine(kind=_kind(m.group("label")), label=m.group("label"), buffer=m.group("buf"),
                                         func=m.group("func"), mib=mib, bytes=mib_to_bytes(mib), line=i))
        return True

    def _memory_size(self, i: int, line: str, stripped: str) -> bool:
        """llama_kv_cache's and llama_memory_recurrent's size lines."""
        if not ("llama_kv_cache" in stripped or "llama_memory_recurrent" in stripped or " size = " in stripped):
            return False
        m = _KV_SIZE.search(stripped)
        if m:
            g = m.groups()
            self.r.kv_caches.append(KVCacheSize(
                role=self.pending_role,
                mib=float(g[0]), bytes=mib_to_bytes(float(g[0])),
                cells=int(g[1]), layers=int(g[2]), n_seq_max=int(g[3]), n_stream=int(g[4]),
                type_k=g[5], k_mib=float(g[6]), k_bytes=mib_to_bytes(float(g[6])),
                type_v=g[7], v_mib=float(g[8]), v_bytes=mib_to_bytes(float(g[8])),
                line=i,
            ))
            self.pending_role = None
            return True
        m = _RS_SIZE.search(stripped)
        if not m:
            return False
        g = m.groups()
        self.r.recurrent.append(RecurrentStateSize(
            mib=float(g[0]), bytes=mib_to_bytes(float(g[0])),
            cells=int(g[1]), layers=int(g[2]), n_seq_max=int(g[3]),
            n_rs_seq=int(g[4]) if g[4] is not None else None,
            type_r=g[5], r_mib=float(g[6]), r_bytes=mib_to_bytes(float(g[6])),
            type_s=g[7], s_mib=float(g[8]), s_bytes=mib_to_bytes(float(g[8])),
            type_p=g[9], p_mib=float(g[10]) if g[10] is not None else None,
            p_bytes=mib_to_bytes(float(g[10])) if g[10] is not None else None,
            line=i,
        ))
        return True

    def _kv_create(self, i: int, line: str, stripped: str) -> bool:
        m = _KV_CREATE.search(stripped)
        if m:
            self.pending_role = m.group("role")
            self.r.kv_cache_cells.append((self.pending_role, int(m.group("cells"))))
            if "iswa" in stripped:
                self.seen_iswa = True
            return True
        if "using full-size SWA cache" in stripped:
            self.swa_full_warned = True
            return True
        return False

    def _compute_check(self, i: int, line: str, stripped: str) -> bool:
        m = _COMPUTE_CHECK.search(stripped)
        if m:
            a, e = float(m.group(2)), float(m.group(4))
            matches = m.group("m") == "matches"
            self.r.compute_checks.append(ComputeCheck(
                buffer=m.group("buf"), actual_mib=a, actual_bytes=mib_to_bytes(a),
                expected_mib=e, expected_bytes=mib_to_bytes(e), matches=matches, line=i,
            ))
            if not matches:
                self.r.mismatch_warnings.append(line.strip())
            return True
        if "does not match expectation" in stripped:
            self.r.mismatch_warnings.append(line.strip())
            return True
        return False

    def _graph(self, i: int, line: str, stripped: str) -> bool:
        if "sched_reserve: graph" in stripped:
            m = _GRAPH.search(stripped)
            if m:
                npp, ntg = _pair(m.group("nodes"))
                spp, stg = _pair(m.group("splits"))
                iop, iot = _pair(m.group("io"))
                itp, itt = _pair(m.group("it"))
                if npp is not None and spp is not None:
                    self.r.graph = GraphInfo(
                        nodes_pp=npp, nodes_tg=ntg, splits_pp=spp, splits_tg=stg,
                        input_objects_pp=iop, input_objects_tg=iot, input_tensors_pp=itp, input_tensors_tg=itt,
                        pp_bs=int(m.group("pp")) if m.group("pp") else None,
                        tg_bs=int(m.group("tg")) if m.group("tg") else None,
                    )
                return True
        m = _RESERVE.search(stripped)
        if m:
            self.r.reserve_ms = float(m.group(1))
            return True
        return False

    def _context_line(self, i: int, line: str, stripped: str) -> bool:
        """llama_context's key = value lines, the per-layer devices, the load mode and the resolved -fa."""
        m = _CTX_KV.search(stripped)
        if m and stripped.startswith("llama_context:"):
            self.ctx.setdefault(m.group("key"), m.group("val"))
            return True
        m = _LAYER.search(stripped)
        if m:
            il = int(m.group(1))
            self.layers[il] = LayerInfo(il=il, device=m.group(2), is_swa=m.group(3) != "0")
            return True
        m = _LOAD_MODE.search(stripped)
        if m:
            self.r.load_mode = m.group("m").strip()
            return True
        m = _FA_RESOLVED.search(stripped)
        if m:
            self.fa_resolved = (m.group("v") or m.group("w")) == "enabled"
            return True
        return False

    def _abort(self, i: int, line: str, stripped: str) -> bool:
        """ggml_abort's message, or an uncaught C++ exception (std::terminate and its what())."""
        m = _ABORT.match(line.strip())
        if m and self.r.abort is None:
            self.r.abort = m.group("msg")
            return True
        m = _TERMINATE.match(line.strip())
        if m:
            self.terminate_seen = True
            self.terminate_what = f"uncaught C++ exception {m.group('what')}"
            return True
        if self.terminate_seen:
            m = _WHAT.match(line)
            if m:
                self.terminate_what = f"{self.terminate_what}: {m.group('msg')}"
                self.terminate_seen = False
        return False

    def report(self) -> LlamaReport:
        r = self.r
        if self.terminate_what and r.abort is None:
            r.abort = self.terminate_what
        r.no_alloc = _bool(r.print_info["no_alloc"]) if "no_alloc" in r.print_info else None
        if r.no_alloc:
            # llama_model::load_tensors and llama_kv_cache::llama_kv_cache hand no_alloc runs a zero-size dummy buffer
            for b in r.buffers:
                if b.kind in ("model", "kv"):
                    b.dummy = True
        r.layers = [self.layers[k] for k in sorted(self.layers)]
        n_all = r.print_info.get("n_layer_all", r.print_info.get("n_layer"))
        if n_all is not None and n_all.isdigit():
            for li in r.layers:
                li.is_output = li.il == int(n_all)
        r.hparams = _hparams(r.print_info, r.layers)
        if self.ctx or r.kv_caches or self.seen_iswa:
            r.context = self._context_info()
        return r

    def _context_info(self) -> ContextInfo:
        ctx = self.ctx

        def gi(k: str) -> int | None:
            try:
                return int(ctx[k]) if k in ctx else None
            except ValueError:
                return None

        def gf(k: str) -> float | None:
            try:
                return float(ctx[k]) if k in ctx else None
            except ValueError:
                return None

        fa = ctx.get("flash_attn")
        resolved = True if fa == "enabled" else False if fa == "disabled" else self.fa_resolved
        return ContextInfo(
            n_seq_max=gi("n_seq_max"), n_ctx=gi("n_ctx"), n_ctx_seq=gi("n_ctx_seq"), n_batch=gi("n_batch"),
            n_ubatch=gi("n_ubatch"),
            causal_attn=_bool(ctx["causal_attn"]) if "causal_attn" in ctx else None,
            flash_attn=fa,
            flash_attn_resolved=resolved,
            kv_unified=_bool(ctx["kv_unified"]) if "kv_unified" in ctx else None,
            swa_full=self.swa_full_warned if (self.seen_iswa or self.swa_full_warned) else None,
            n_rs_seq=gi("n_rs_seq"), n_outputs_max=gi("n_outputs_max"),
            n_outputs_max_per_seq=gi("n_outputs_max_per_seq"), freq_base=gf("freq_base"), freq_scale=gf("freq_scale"),
        )
