"""The few GGUF facts beyond ModelSpec that change a graph's shape: hparams and tensor presence.

What llama_model::load_hparams reads besides ModelSpec (f_attn_temp_scale, expert gating, MLA ranks,
rope sections, softcapping ...) and which optional tensors load_tensors finds (biases, Q/K norms,
shared experts ...), from a GGUF header, or the usual values of an architecture without one.
"""

from __future__ import annotations

import functools
from dataclasses import field
from typing import Any

from fitter.cache import CACHES
from fitter.gguf.constants import GGMLQuantizationType
from fitter.record import Record


class GraphDetails(Record):
    """Hparams and tensor presence that change llama.cpp's graph but are not in ModelSpec.

    `graph_details(header)` reads them from a GGUF header; without one, `compute_buffers` uses
    `fitter.llama.models.default_details(spec)`: the values of the released models of each architecture. The tensors
    they add are small ([n_expert, n_tokens] router scratch, biases applied in place), so a wrong
    default moves the prediction by well under a MiB in practice.
    """

    # "attn_q.bias" -> layers that have blk.N.attn_q.bias.*
    layer_tensors: dict[str, frozenset[int]] = field(default_factory=dict)
    global_tensors: frozenset[str] = frozenset()  # "output.bias", "rope_freqs.weight", ...
    final_logit_softcapping: float = 0.0
    attn_temperature_scale: float = 0.0  # f_attn_temp_scale (mistral3, deepseek2): adds inp_attn_scale
    expert_gating_func: int = 0  # LLAMA_EXPERT_GATING_FUNC_TYPE_*: 0 none (arch default), 1 softmax, 2 sigmoid, 3 softmax_weight
    expert_weights_norm: bool = False
    expert_weights_scale: float = 0.0
    n_expert_groups: int = 0
    n_group_used: int = 0
    n_lora_q: int = 0
    n_rot: int = 0
    mrope: bool = False  # rope.dimension_sections present (glm4moe: ggml_rope_multi, 4 positions per token)
    n_embd_per_layer: int = 0  # gemma4 per-layer embeddings (embedding_length_per_layer_input)
    # "ffn_down" -> {layer: ggml type} (GPU op offload copies)
    layer_types: dict[str, dict[int, int]] = field(default_factory=dict)
    global_types: dict[str, int] = field(default_factory=dict)  # "output" -> ggml type
    # LoRA adapters the context applies (fitter.llama.lora.lora_details): base tensor name -> one (rank, lora_a
    # type, lora_b type) per adapter, in build_lora_mm's order
    lora_graph: dict[str, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)

    def has(self, suffix: str, il: int | None = None) -> bool:
        layers = self.layer_tensors.get(suffix)
        if layers is None:
            return False
        return il is None or il in layers


_DETAILS: dict[int, tuple[Any, GraphDetails]] = CACHES.keep({}, "details")  # id(header) -> (header, details): read once per header
_LAST: dict[str, GraphDetails] = CACHES.keep({}, "details")  # "last": the details graph_details read last
TYPE_FIELDS = frozenset({"layer_types", "global_types"})  # the weights' types; the other fields shape the graph alone
# the other fields (each one's values made by _read_details alike, so == is sameness)
_SHARED = [f for f in GraphDetails.model_fields if f not in TYPE_FIELDS]


def graph_details(header) -> GraphDetails:
    """GraphDetails from a fitter.gguf.reader.GGUFHeader; the same object for the same header, so that the
    compute buffers' cache (keyed by the details' identity) serves every prediction of one header."""
    hit = _DETAILS.get(id(header))
    if hit is not None and hit[0] is header:  # the same header object, not a new one at a reused id
        return hit[1]
    details = _read_details(header)
    last = _LAST.get("last")
    if last is not None and all(getattr(last, f) == getattr(details, f) for f in _SHARED):
        # the same model in another quant (fitter.fit.quant_fit): the last details' objects but for the types, so
        # that the compute buffers' content key (fitter.llama.context._content_key) knows them at once
        details = last.model_copy(update={"layer_types": details.layer_types, "global_types": details.global_types})
    _LAST["last"] = details
    if len(_DETAILS) > 32:
        _DETAILS.clear()
    _DETAILS[id(header)] = (header, details)
    return details


@functools.lru_cache(maxsize=1 << 16)  # the quants of one model: the same names again, other types
def _parse_name(name: str) -> tuple[int | None, str, str, bool]:
    """blk.N.<suffix>.<kind> -> (N, the layer_tensors key, suffix, kind is weight); a global -> (None, "", base, False)."""
    if name.startswith("blk."):
        _, il, rest = name.split(".", 2)
        suffix = rest.rsplit(".", 1)[0] if rest.endswith((".weight", ".bias", ".scale")) else rest
        kind = rest[len(suffix) + 1:] if rest != suffix else ""
        full = f"{suffix}.{kind}" if kind == "bias" else suffix
        return int(il), full, suffix, kind == "weight"
    return None, "", name.rsplit(".", 1)[0], False


@functools.lru_cache(maxsize=4)  # the quants of one model: the same names in the same order
def _by_names(names: tuple[str, ...]) -> tuple[dict[str, frozenset[int]], frozenset[str],
                                               list[tuple[str, list[tuple[int, int]]]], list[tuple[str, int]]]:
    """What the tensors' names alone say: layer_tensors, global_tensors, and where each weight's type goes: per layer
    suffix (layer_types' key, in the order the names first give it) its (layer, index in the header) pairs, and the
    globals' (base name, index)."""
    layer_tensors: dict[str, set[int]] = {}
    glob: set[str] = set()
    layer_slots: dict[str, list[tuple[int, int]]] = {}
    global_slots: list[tuple[str, int]] = []
    for i, name in enumerate(names):
        il, full, suffix, weight = _parse_name(name)
        if il is not None:
            layer_tensors.setdefault(full, set()).add(il)
            if weight:
                layer_slots.setdefault(suffix, []).append((il, i))
        else:
            glob.add(name)
            global_slots.append((suffix, i))
    return ({k: frozenset(v) for k, v in layer_tensors.items()}, frozenset(glob), list(layer_slots.items()),
            global_slots)


_TYPE_IDS = {t: int(t) for t in GGMLQuantizationType}  # (a plain int finds its member's entry)


def _read_details(header) -> GraphDetails:
    md = header.metadata
    arch = md.get("general.architecture", "")

    def key(k: str, default=0):
        v = md.get(f"{arch}.{k}", default)
        return default if v is None or isinstance(v, (list, dict)) else v

    tensors = header.tensors
    layer_tensors, glob, layer_slots, global_slots = _by_names(tuple([t.name for t in tensors]))
    # (a name given twice: its last type, at its first place, as assigning in turn would leave it)
    ids = _TYPE_IDS  # int(type) by a lookup: calling int() on an enum member costs more (quants: 34 headers)
    layer_types = {suffix: {il: ids.get(tensors[i].ggml_type, tensors[i].ggml_type) for il, i in slots}
                   for suffix, slots in layer_slots}
    global_types = {suffix: ids.get(tensors[i].ggml_type, tensors[i].ggml_type) for suffix, i in global_slots}
    return GraphDetails(
        layer_tensors=layer_tensors,
        global_tensors=glob,
        final_logit_softcapping=float(key("final_logit_softcapping", 0.0) or 0.0),
        attn_temperature_scale=float(key("attention.temperature_scale", 0.0) or 0.0),
        expert_gating_func=int(key("expert_gating_func", 0) or 0),
        expert_weights_norm=bool(key("expert_weights_norm", False)),
        expert_weights_scale=float(key("expert_weights_scale", 0.0) or 0.0),
        n_expert_groups=int(key("expert_group_count", 0) or 0),
        n_group_used=int(key("expert_group_used_count", 0) or 0),
        n_lora_q=int(key("attention.q_lora_rank", 0) or 0),
        n_rot=int(key("rope.dimension_count", 0) or 0),
        mrope=f"{arch}.rope.dimension_sections" in md,
        n_embd_per_layer=int(key("embedding_length_per_layer_input", 0) or 0) if "per_layer_token_embd.weight" in glob else 0,
        layer_types=layer_types,
        global_types=global_types,
    )
