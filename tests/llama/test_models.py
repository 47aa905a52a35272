"""fitter.llama.models: one module per architecture family behind one registry."""

from __future__ import annotations

import pytest

from fitter.cache import CACHES
from fitter.errors import UnsupportedModelError
from fitter.llama import context
from fitter.llama.cparams import Frontend, RunConfig, resolve_context
from fitter.llama.graph_details import graph_details
from fitter.llama.hparams import ArchRules
from fitter.llama.model import load_model_spec
from fitter.llama.models import MODELS, default_details, has_mtp_graph, model_of, rules_of
from tests.synth import REGISTRY, build


def test_registry_covers_every_modelled_architecture():
    assert sorted(MODELS) == sorted(REGISTRY)
    for arch in MODELS:
        family = model_of(arch)
        assert isinstance(rules_of(arch), ArchRules)
        assert callable(family.build_graph)
    assert model_of("mamba") is None and rules_of("mamba") is None


def test_mtp_graphs_are_those_of_the_nextn_families():
    # graph_mtp exists in src/models/{qwen35,qwen35moe,qwen3next,glm4-moe,deepseek2}.cpp
    assert sorted(a for a in MODELS if has_mtp_graph(a)) == ["deepseek2", "glm4moe", "qwen35", "qwen35moe", "qwen3next"]


def test_memory_kind_and_tied_output_come_from_the_family():
    # llm_arch_is_hybrid; gpt-oss never ties its output; gemma4 creates the tied output first
    assert sorted(a for a in MODELS if rules_of(a).hybrid_memory) == ["qwen35", "qwen35moe", "qwen3next"]
    assert [a for a in MODELS if not rules_of(a).tied_output] == ["gpt-oss"]
    assert [a for a in MODELS if rules_of(a).output_before_tok_embd] == ["gemma4"]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "deepseek2", "qwen35moe"])
def test_default_details_match_the_synthetic_files(arch):
    """Without a header, the family's usual optional tensors stand in: the same ones the synthetic
    models (built like the released ones) have."""
    header, spec = load_model_spec(str(build(arch)))
    d, h = default_details(spec), graph_details(header)
    for name, layers in d.layer_tensors.items():
        assert h.layer_tensors.get(name, frozenset()) >= layers, name


def test_builds_do_not_share_state():
    """Each graph is built in its own ggml context: alternating models and backends gives the sizes
    each gives alone."""
    specs = [load_model_spec(str(build(a))) for a in ("gemma3", "qwen35moe")]
    cfg = RunConfig(n_ctx=4096, n_ubatch=512)

    def sizes(header, spec, backend):
        CACHES.clear("compute")
        cp = resolve_context(spec, cfg, Frontend.LIBRARY)
        return [b.bytes for b in context.compute_buffers(spec, cp, backend, details=graph_details(header))]

    alone = {(i, be): sizes(*specs[i], be) for i in range(2) for be in ("cpu", "cuda", "metal")}
    for be in ("metal", "cuda", "cpu"):
        for i in (1, 0):
            assert sizes(*specs[i], be) == alone[(i, be)]


def test_unknown_architecture_has_no_graph():
    header, spec = load_model_spec(str(build("qwen3")))
    cp = resolve_context(spec, RunConfig(n_ctx=512), Frontend.LIBRARY)
    with pytest.raises(UnsupportedModelError, match="no graph model"):
        context.compute_buffers(spec.model_copy(update={"architecture": "mamba"}), cp)
