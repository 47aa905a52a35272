"""The architectures ggfit models, one module per family as upstream's src/models/*.cpp, and the registry.

Each module has ARCHS (the architectures it builds and their ArchRules: hparam rules, tensor quirks,
memory kind), `default_details(...)` (its optional tensors without a header), `build_graph(c)` (the graph builder: a generator that yields the prologue's output,
receives (layer, input) pairs and returns after the epilogue) and, for architectures with NextN
layers, `build_graph_mtp(c)`. Adding an architecture: one module and one entry in FAMILIES.
"""

from __future__ import annotations

from types import ModuleType

from fitter.llama.graph_details import GraphDetails
from fitter.llama.hparams import ArchRules, ModelSpec
from fitter.llama.models import deepseek2, gemma, gemma4, glm4moe, gpt_oss, llama, phi3, qwen35

FAMILIES: tuple[ModuleType, ...] = (llama, phi3, gemma, gemma4, gpt_oss, qwen35, deepseek2, glm4moe)

# general.architecture -> its family's module (llm_arch_from_string + llama_model::build_graph's switch)
MODELS: dict[str, ModuleType] = {arch: family for family in FAMILIES for arch in family.ARCHS}


def model_of(arch: str) -> ModuleType | None:
    return MODELS.get(arch)


def rules_of(arch: str) -> ArchRules | None:
    """The architecture's ArchRules (None: not modelled)."""
    m = MODELS.get(arch)
    return m.ARCHS[arch] if m is not None else None


def has_mtp_graph(arch: str) -> bool:
    m = MODELS.get(arch)
    return m is not None and hasattr(m, "build_graph_mtp")


def default_details(spec: ModelSpec) -> GraphDetails:
    """What released models of spec.architecture look like (used without a header): the family's
    optional tensors and hparams, then the FFN tensors every family has."""
    n = len(spec.layers)
    every = frozenset(range(n))
    moe_layers = frozenset(range(spec.n_layer_dense_lead, n)) if spec.n_expert else frozenset()
    dense_layers = every - moe_layers
    family = MODELS.get(spec.architecture)
    lt: dict[str, frozenset[int]] = {}
    kw: dict = {}
    if family is not None and hasattr(family, "default_details"):
        lt, kw = family.default_details(spec, every, moe_layers)
    if spec.n_expert_shared or spec.n_ff_shexp:
        lt |= {"ffn_up_shexp": moe_layers}
    lt |= {"ffn_up": dense_layers} if spec.n_expert else {"ffn_up": every}
    if spec.n_expert:
        lt |= {"ffn_up_exps": moe_layers, "ffn_gate_exps": moe_layers}
    return GraphDetails(layer_tensors=lt, **kw)
