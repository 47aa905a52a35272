"""Synthetic random-weight GGUFs of real llama.cpp architectures (see tests/synth/common.py)."""

import importlib

from tests.synth.common import REGISTRY, build, write_gguf  # noqa: F401

# Builder modules: importing one registers its architectures. A module another helper has not
# written yet is skipped; any other import error is real and propagates.
for _mod in ("dense", "moe_hybrid"):
    try:
        importlib.import_module(f"tests.synth.{_mod}")
    except ModuleNotFoundError as e:
        if e.name != f"tests.synth.{_mod}":
            raise
