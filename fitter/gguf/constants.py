"""The gguf package's constants (ggml types and block sizes, key names, file types), fast.

`import gguf` runs the package's __init__, which imports numpy and gguf's reader, writer and quants
(about 200 ms): too slow for a command that answers in milliseconds. gguf/constants.py itself only
needs the standard library, so it is loaded on its own and registered as `gguf.constants`: a later
`import gguf` finds it in sys.modules and reuses the very same module, so the enums stay identical.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _load() -> ModuleType:
    if "gguf.constants" in sys.modules:
        return sys.modules["gguf.constants"]
    spec = importlib.util.find_spec("gguf")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the gguf package is not installed (pip install gguf)")
    path = Path(next(iter(spec.submodule_search_locations))) / "constants.py"
    cspec = importlib.util.spec_from_file_location("gguf.constants", path)
    assert cspec is not None and cspec.loader is not None
    mod = importlib.util.module_from_spec(cspec)
    mod.__package__ = "gguf"
    sys.modules["gguf.constants"] = mod
    try:
        cspec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["gguf.constants"]
        raise
    return mod


_c = _load()

GGML_QUANT_SIZES = _c.GGML_QUANT_SIZES
GGML_QUANT_VERSION = _c.GGML_QUANT_VERSION
GGMLQuantizationType = _c.GGMLQuantizationType
GGUF_DEFAULT_ALIGNMENT = _c.GGUF_DEFAULT_ALIGNMENT
GGUF_MAGIC = _c.GGUF_MAGIC
GGUFValueType = _c.GGUFValueType
Keys = _c.Keys
LlamaFileType = _c.LlamaFileType
MODEL_ARCH_NAMES = _c.MODEL_ARCH_NAMES
