"""The architectures ggfit models, one module per family as upstream's src/models/*.cpp, and the registry.

Each module has `build_graph(c)` (the graph builder: a generator that yields the prologue's output,
receives (layer, input) pairs and returns after the epilogue) and, for architectures with NextN
layers, `build_graph_mtp(c)`. Adding an architecture: one module and one line in MODELS.
"""

from __future__ import annotations

from types import ModuleType

from fitter.llama.models import deepseek2, gemma, gemma4, glm4moe, gpt_oss, llama, phi3, qwen35

# general.architecture -> its family's module (llm_arch_from_string + llama_model::build_graph's switch)
MODELS: dict[str, ModuleType] = {
    "llama": llama,
    "mistral3": llama,
    "qwen2": llama,
    "qwen3": llama,
    "qwen3moe": llama,
    "phi3": phi3,
    "gemma2": gemma,
    "gemma3": gemma,
    "gemma4": gemma4,
    "gpt-oss": gpt_oss,
    "qwen35": qwen35,
    "qwen35moe": qwen35,
    "qwen3next": qwen35,
    "deepseek2": deepseek2,
    "glm4moe": glm4moe,
}


def model_of(arch: str) -> ModuleType | None:
    return MODELS.get(arch)


def has_mtp_graph(arch: str) -> bool:
    m = MODELS.get(arch)
    return m is not None and hasattr(m, "build_graph_mtp")
