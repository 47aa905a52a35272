"""The llama.cpp build ggfit mirrors. Every formula cites this build's source; every measurement records it."""

from __future__ import annotations

from importlib import metadata

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # vendor/llama.cpp of llama-cpp-python 0.3.36
# the same build, as llama.cpp names itself (LLAMA_COMMIT, 12 hex digits) and as pip names its package
PINNED_COMMIT = LLAMA_CPP_COMMIT[:12]
PINNED_LLAMA_CPP_PYTHON = LLAMA_CPP_PYTHON_VERSION


def installed_llama_cpp_python() -> str | None:
    """The installed llama-cpp-python version, read from its metadata (without loading the library)."""
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def build_label() -> str:
    installed = installed_llama_cpp_python()
    label = f"llama.cpp {PINNED_COMMIT} (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION})"
    if installed and installed != LLAMA_CPP_PYTHON_VERSION:
        label += f"; installed llama-cpp-python {installed} differs: numbers may drift"
    return label
