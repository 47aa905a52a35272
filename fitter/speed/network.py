"""What llama.cpp's RPC backend sends over the network per ubatch, and what it costs (issue 47's network term in the
speed model of issue 46): the term "net" of fitter.speed.model's decode and prefill seconds.

Mirrored from ggml-rpc.cpp and ggml_backend_sched_compute_splits (pinned build 0c1e57098bba), and counted in
benchmarks/results/rpc-network-here.json (every command each rpc-server served, GGML_RPC_DEBUG=1):
- The layers run in order; each RPC device's consecutive layers are one split. The token embedding (a GET_ROWS) is
  on the main host's CPU, so the first RPC split's input comes from the main host.
- Into a split (set_tensor, one-way: the dispatcher sends it and waits for no answer): the activation entering its
  first layer (n_embd x n_tokens F32), and each graph input its layers use: inp_pos (n_tokens int32, 4 a token
  with M-RoPE), per KV cache
  (full, sliding-window) the k_idxs and v_idxs of set_rows (n_tokens int64 each; v_idxs without flash attention,
  V transposed, n_tokens x n_embd_v_gqa_max) and the KQ mask (n_kv x n_tokens, F16 with flash attention, else F32:
  build_attn_inp_kq_mask), a recurrent layer's s_copy, and on the split with the
  last layer inp_out_ids (n_outputs int32).
- The graph (ggml_backend_rpc_graph_compute): a graph the device ran last (llama_context's graph reuse keeps the
  scheduler's split uid) is RPC_CMD_GRAPH_RECOMPUTE (4 bytes); a new one is RPC_CMD_GRAPH_COMPUTE with
  serialize_graph (12 bytes, 8 per node, sizeof(rpc_tensor) = 296 per tensor). Decoded tokens reuse their graph; each
  prompt ubatch is a new one (its KQ mask grows).
- Out of a split (get_tensor: the only command here that waits for the server's answer, after its graph ran, so one
  round trip): the activation the next split needs, or at the end what the main host reads: the logits (n_vocab x
  n_outputs F32) where the output layer is on the device, and nothing in a prompt ubatch with no outputs. An
  activation from one server to the next goes through the main host: get from one, set to the other (no
  RPC_CMD_COPY_TENSOR across servers: ggml_backend_rpc_buffer_cpy_tensor needs one dispatcher).
- Every command: 1 + 8 bytes of header; every answer 8; a set carries rpc_tensor, a flag and an offset (305 bytes),
  a get's request rpc_tensor, offset and size (312 bytes).

Synchronising an RPC backend waits only for its queue to be sent, never for the server, so the round trips are the
gets. A ubatch's network time is its bytes over the link's rate plus each round trip's latency (the ping) and the
hosts' handling of a hop (RPC_HOP_MS, measured here).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from fitter.llama.cparams import ConfigError, RunConfig
from fitter.llama.hparams import LayerKind, ModelSpec
from fitter.llama.weights import CPU_DEV

RPC_TENSOR = 296  # sizeof(rpc_tensor), packed
CMD_HEAD = 9  # send_rpc_cmd: the command byte and the payload's u64 size
ANSWER_HEAD = 8  # the answer's u64 size
SET_HEAD = RPC_TENSOR + 1 + 8  # serialize_set_tensor: rpc_tensor | cache_flag | offset
GET_REQUEST = RPC_TENSOR + 8 + 8  # rpc_msg_get_tensor_req
GRAPH_HEAD = 12  # serialize_graph: device, n_nodes, n_tensors
RECOMPUTE = 4  # rpc_msg_graph_recompute_req
# a new graph's nodes and tensors (serialize_graph) per layer and for the output layer: ggfit's estimate, from the
# recordings (benchmarks/results/rpc-network-here*.json): an attention layer with a dense FFN 35 (Qwen3) to 40
# (Gemma 3) nodes and 49 to 56 tensors, a MoE FFN 16 and 16 more, a recurrent layer (gated delta net) 66.5 and 84
ATTN_LAYER = (38, 53)
MOE_FFN = (16, 16)
RECURRENT_LAYER = (67, 84)
OUTPUT_GRAPH = (5, 10)
# llama_model_rope_type's M-RoPE and IM-RoPE architectures: inp_pos has n_pos_per_embd = 4 positions a token
MROPE_ARCHS = frozenset({"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen4exp",
                         "qwen3tts"})
KV_PAD = 256  # llama_kv_cache::get_n_kv: n_kv rounded up to max(n_pad, 256)
# the hosts' handling of one round trip beyond the wire (the dispatcher's and the server's threads, the command's
# reads): llama-server's decode here gained 0.35-0.55 ms per round trip with loopback servers whose ping is 0.03 ms;
# 0.40 with the localhost rate puts the six runs of benchmarks/results/rpc-network-here*.json within 24% of the
# time the servers added (a shared 2-core VM: an upper figure)
RPC_HOP_MS = 0.40

GBIT = 1e9 / 8 / 1e9  # GB/s in 1 Gbit/s
TCP_GOODPUT = 0.94  # TCP over Ethernet at MTU 1500: 1448 payload bytes in 1538 on the wire


class Link(NamedTuple):
    """The network between the main host and its rpc-servers: payload rate and one round trip's latency (ping)."""

    bandwidth_gbs: float  # GB/s of payload
    latency_ms: float
    source: str  # what set it


# preset -> (GB/s of payload, ping ms). localhost: llama.cpp's rate through loopback servers and the loopback ping,
# measured here (benchmarks/results/rpc-network-here.json); Ethernet: TCP's payload share of the line rate, and a
# switched LAN's usual ping (a direct 25 GbE link's lower)
PRESETS: dict[str, tuple[float, float]] = {
    "localhost": (1.1, 0.03),
    "1gbe": (1 * GBIT * TCP_GOODPUT, 0.2),
    "2.5gbe": (2.5 * GBIT * TCP_GOODPUT, 0.15),
    "10gbe": (10 * GBIT * TCP_GOODPUT, 0.1),
    "25gbe": (25 * GBIT * TCP_GOODPUT, 0.05),
}
_NAMES = {"localhost": "localhost", "1gbe": "1GbE", "2.5gbe": "2.5GbE", "10gbe": "10GbE", "25gbe": "25GbE"}
_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([kKmMgGtT])?(bit/s|bps|b/s|B/s)\s*")
_SCALE = {None: 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_MS = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ms|us|µs|s)?\s*")
_LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|localhost|\[?::1\]?)$", re.IGNORECASE)


def parse_bandwidth(text: str) -> tuple[float, str]:
    """--rpc-bandwidth: a preset (1GbE, 2.5GbE, 10GbE, 25GbE, localhost), a bit rate (1Gbit/s, 1Gbps, 1Gb/s,
    100Mbit/s: TCP's payload share of it) or a payload byte rate (110MB/s, 1.1GB/s) -> GB/s of payload."""
    key = text.strip().lower()
    if key in PRESETS:
        return PRESETS[key][0], _NAMES[key]
    m = _RATE.fullmatch(text)
    if not m:
        raise ConfigError(f"--rpc-bandwidth {text}: use 1GbE, 2.5GbE, 10GbE, 25GbE, localhost, a bit rate (1Gbit/s, "
                          "10Gbps) or a byte rate (110MB/s)")
    value = float(m.group(1)) * _SCALE[m.group(2).lower() if m.group(2) else None]
    is_bytes = m.group(3) == "B/s"
    gbs = value / 1e9 if is_bytes else value / 8 / 1e9 * TCP_GOODPUT
    if not gbs > 0:
        raise ConfigError(f"--rpc-bandwidth {text}: the rate must be above 0")
    return gbs, f"--rpc-bandwidth {text}"


def parse_latency(text: str) -> float:
    """--rpc-latency: one round trip between the hosts (what ping shows): 0.3, 0.3ms, 300us -> ms."""
    m = _MS.fullmatch(text)
    if not m:
        raise ConfigError(f"--rpc-latency {text}: use a round trip in ms (0.3, 0.3ms, 300us)")
    return float(m.group(1)) * {None: 1.0, "ms": 1.0, "us": 1e-3, "µs": 1e-3, "s": 1e3}[m.group(2)]


def link_of(endpoints: list[str], bandwidth: str | None = None, latency: str | None = None) -> Link:
    """The link to the servers: --rpc-bandwidth and --rpc-latency where given; else localhost where every server is
    on this host (loopback: no network card on the way), else 1 GbE (the common home network, and the slower)."""
    local = all(_LOOPBACK.match(ep.rpartition(":")[0]) for ep in endpoints)
    preset = "localhost" if local else "1gbe"
    gbs, src = parse_bandwidth(bandwidth) if bandwidth is not None else (PRESETS[preset][0], f"{_NAMES[preset]} (default)")
    ms = parse_latency(latency) if latency is not None else PRESETS[preset][1]
    return Link(gbs, ms, src + (f", --rpc-latency {latency}" if latency is not None else ""))


class Run(NamedTuple):
    """One RPC device's consecutive layers: one split of the scheduler's."""

    device: int
    n_layers: int
    caches: int  # KV caches its layers use (full, sliding-window): each has its own idxs and mask
    recurrent: bool
    graph: tuple[int, int]  # a new graph's nodes and tensors (estimated)
    last_layer: bool  # holds the model's last layer (inp_out_ids; its output has n_outputs rows)
    output: bool  # holds the output layer (its out: the logits)
    next_on_device: bool  # the layers after it run on another device (else the main host reads its out, if any)


class Layout(NamedTuple):
    runs: tuple[Run, ...]
    n_embd: int
    n_vocab: int
    mask_bytes: int  # per element of the KQ mask
    n_swa: int
    n_ctx: int
    n_ubatch: int
    v_idx_width: int  # v_idxs per token: 1, or without flash attention (V transposed) n_embd_v_gqa_max
    n_pos_per_embd: int  # inp_pos per token (llama_hparams::n_pos_per_embd)


def layout_of(spec: ModelSpec, config: RunConfig, n_devices: int) -> Layout:
    """The RPC splits of this placement (-ngl, -ts over the --rpc servers), in the order the layers run."""
    from fitter.fit.memory import placement_of
    from fitter.ggml.backends.base import Backend

    wp = placement_of(spec, config, Backend.RPC, n_devices)
    devs = [wp.default_dev(il) for il in range(spec.n_layer)]
    out_dev = wp.default_dev("output")
    runs: list[Run] = []
    il = 0
    while il < len(devs):
        j = il
        while j < len(devs) and devs[j] == devs[il]:
            j += 1
        d = devs[il]
        if d != CPU_DEV:
            kinds = {spec.layers[k].kind for k in range(il, j)}
            last = j == len(devs)
            output = last and out_dev == d
            runs.append(Run(d, j - il, len(kinds & {LayerKind.FULL, LayerKind.SWA}), LayerKind.RECURRENT in kinds,
                            _graph_size(spec, range(il, j), output), last, output,
                            not last or (out_dev != d and out_dev != CPU_DEV)))
        il = j
    if out_dev != CPU_DEV and (not devs or devs[-1] != out_dev):  # the output layer alone on a device
        runs.append(Run(out_dev, 0, 0, False, OUTPUT_GRAPH, False, True, False))
    fa = config.flash_attn != "off"
    return Layout(tuple(runs), spec.n_embd, spec.n_vocab, 2 if fa else 4, spec.n_swa,
                  config.n_ctx or spec.n_ctx_train, min(config.n_ubatch or 512, config.n_batch or 2048),
                  1 if fa else max((la.n_embd_v_gqa for la in spec.layers), default=1),
                  4 if spec.architecture in MROPE_ARCHS else 1)


def _graph_size(spec: ModelSpec, layers: range, output: bool) -> tuple[int, int]:
    """A split's nodes and tensors, estimated by layer kind (ATTN_LAYER, MOE_FFN, RECURRENT_LAYER)."""
    nodes, tensors = OUTPUT_GRAPH if output else (0, 0)
    for il in layers:
        lay = spec.layers[il]
        n, t = RECURRENT_LAYER if lay.kind == LayerKind.RECURRENT else ATTN_LAYER
        if lay.n_expert_used:
            n, t = n + MOE_FFN[0], t + MOE_FFN[1]
        nodes, tensors = nodes + n, tensors + t
    return nodes, tensors


class Traffic(NamedTuple):
    """One ubatch's RPC traffic, over all servers."""

    sent: int  # main host -> servers, bytes with headers
    received: int  # servers -> main host
    round_trips: int
    sets: int
    set_bytes: int  # the set_tensors' data alone
    get_bytes: int  # the get_tensors' data alone
    graph_bytes: int  # the graph commands' payloads


def n_kv_at(n_pos: int, n_ctx: int) -> int:
    """llama_kv_cache::get_n_kv after n_pos positions are filled: rounded up to 256, at most the cache."""
    return max(KV_PAD, min(n_ctx, -(-n_pos // KV_PAD) * KV_PAD))


def run_sets(lay: Layout, r: Run, n: int, n_out: int, n_kv: list[int]) -> list[int]:
    """The bytes of each set_tensor into one split (ggml_backend_sched_compute_splits' input copies)."""
    sets = [lay.n_embd * n * 4] if r.n_layers else [lay.n_embd * n_out * 4]  # the activation (F32)
    if r.n_layers:
        sets.append(n * 4 * lay.n_pos_per_embd)  # inp_pos
        for kv in n_kv[:r.caches]:
            # k_idxs, v_idxs (int64: llama_kv_cache::build_input_v_idxs), the KQ mask
            sets += [n * 8, n * 8 * lay.v_idx_width, kv * n * lay.mask_bytes]
        if r.recurrent:
            sets.append(4)  # s_copy of the one sequence
    if r.last_layer and n_out:
        sets.append(n_out * 4)  # inp_out_ids
    return sets


def run_out(lay: Layout, r: Run, n: int, n_out: int) -> int:
    """The bytes the main host reads out of one split (its get_tensor; 0: none, no round trip)."""
    if r.next_on_device:
        return lay.n_embd * (n_out if r.last_layer else n) * 4
    return (lay.n_vocab if r.output else lay.n_embd) * n_out * 4


def run_graph(r: Run, new_graph: bool) -> int:
    """The graph command's payload: serialize_graph's (its nodes and tensors estimated), or a reused graph's."""
    if not new_graph:
        return RECOMPUTE
    nodes, tensors = r.graph
    return GRAPH_HEAD + 8 * nodes + RPC_TENSOR * tensors


def kv_widths(lay: Layout, n_pos: int) -> list[int]:
    """n_kv of the full and the sliding-window cache (the masks' widths) once n_pos positions are filled; the
    sliding-window cache holds n_swa + n_ubatch cells (llama_kv_cache_iswa, one sequence)."""
    full = n_kv_at(n_pos, lay.n_ctx)
    return [full, min(full, n_kv_at(lay.n_swa + lay.n_ubatch, lay.n_ctx))] if lay.n_swa else [full, full]


def ubatch_traffic(lay: Layout, n_tokens: int, n_outputs: int, n_pos: int, new_graph: bool) -> Traffic:
    """What a ubatch of n_tokens (n_outputs of them read back) sends and receives, its last token at n_pos."""
    n_kv = kv_widths(lay, n_pos)
    sent = received = trips = n_sets = set_bytes = get_bytes = graph_bytes = 0
    for r in lay.runs:
        sets = run_sets(lay, r, n_tokens, n_outputs, n_kv)
        n_sets += len(sets)
        set_bytes += sum(sets)
        sent += sum(sets) + len(sets) * (CMD_HEAD + SET_HEAD)
        g = run_graph(r, new_graph)
        graph_bytes += g
        sent += CMD_HEAD + g
        out = run_out(lay, r, n_tokens, n_outputs)
        if out:
            trips += 1
            get_bytes += out
            sent += CMD_HEAD + GET_REQUEST
            received += ANSWER_HEAD + out
    return Traffic(sent, received, trips, n_sets, set_bytes, get_bytes, graph_bytes)


def seconds(t: Traffic, link: Link) -> float:
    """A ubatch's network time: its bytes over the link, and each round trip's ping and the hosts' handling."""
    return (t.sent + t.received) / (link.bandwidth_gbs * 1e9) + t.round_trips * (link.latency_ms + RPC_HOP_MS) / 1e3


class Network(NamedTuple):
    """The RPC splits and the link: the speed model's network terms (fitter.speed.predict.predict_speed)."""

    layout: Layout
    link: Link

    def decode_terms(self, depth: int) -> dict[str, float]:
        """A decoded token at `depth`: its graph reused (RPC_CMD_GRAPH_RECOMPUTE), one output read back."""
        return {"net": seconds(ubatch_traffic(self.layout, 1, 1, depth + 1, new_graph=False), self.link)}

    def prefill_terms(self, n_prompt: int, n_ubatch: int, depth: int) -> dict[str, float]:
        """A prompt of n_prompt after `depth` (llama-bench pp<n>): ubatches of n_ubatch, each a new graph, the last
        token's logits read back after the last one."""
        total = 0.0
        done = 0
        while done < n_prompt:
            n = min(n_ubatch, n_prompt - done)
            last = done + n >= n_prompt
            total += seconds(ubatch_traffic(self.layout, n, 1 if last else 0, depth + done + n, True), self.link)
            done += n
        return {"net": total}

    @property
    def hops(self) -> int:
        """Round trips of a decoded token: one per RPC split whose out the main host reads."""
        return ubatch_traffic(self.layout, 1, 1, 1, new_graph=False).round_trips
