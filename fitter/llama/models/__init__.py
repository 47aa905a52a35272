"""The architectures ggfit models, one module per family as upstream's src/models/*.cpp, and the registry.

Each module has ARCHS (the architectures it builds and their ArchRules: hparam rules, tensor quirks,
memory kind), `build_graph(c)` (the graph builder: a generator that yields the prologue's output,
receives (layer, input) pairs and returns after the epilogue) and, for architectures with NextN
layers, `build_graph_mtp(c)`. Adding an architecture: one module and one entry in FAMILIES.
"""

from __future__ import annotations

from types import ModuleType

from fitter.llama.hparams import ArchRules

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
