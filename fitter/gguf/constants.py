"""The gguf package's constants that ggfit reads (ggml types and block sizes, key names, file types), fast.

`import gguf` runs the package's __init__, which imports numpy and gguf's reader, writer and quants (about
200 ms), and gguf/constants.py itself spends most of its ~7 ms on tables ggfit never reads (MODEL_TENSOR,
MODEL_ARCH, the per-architecture tensor lists). So the top-level statements that define the names below are
taken from gguf-py's own constants.py, as its lines, and run here: their compiled code is kept in ggfit's cache
(`${GGFIT_CACHE:-~/.cache/ggfit}/gguf-constants/`, keyed by the file's path, size and mtime and by the Python
version), with gguf-py's file name and line numbers. Where the cache cannot be read or written, or a name is
missing, gguf-py's whole constants.py is loaded as `gguf.constants` instead (a later `import gguf` reuses it).

In the first case the enums are ggfit's own classes, equal by value to gguf's (an IntEnum member is its int) but
not the same objects: compare types by value, never with `is` or `isinstance` across the two.
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import sys
import zlib
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from fitter.cache import cache_root

_NAMES = ("GGUF_MAGIC", "GGUF_DEFAULT_ALIGNMENT", "GGML_QUANT_VERSION", "Keys", "GGMLQuantizationType",
          "LlamaFileType", "GGUFValueType", "GGML_QUANT_SIZES")
_FORMAT = b"ggfit-gguf-constants 2\n"  # of a cached entry: change it when _NAMES or the selection changes


def _source() -> Path:
    spec = importlib.util.find_spec("gguf")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the gguf package is not installed (pip install gguf)")
    return Path(next(iter(spec.submodule_search_locations))) / "constants.py"


def _selected(text: str) -> str:
    """The imports and the top-level statements that define _NAMES or a name they read (QK_K ...), each on its own
    lines (the others blank)."""
    import ast

    lines = text.splitlines(keepends=True)
    defs: dict[str, list[ast.stmt]] = {}
    wanted: list[ast.stmt] = []
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            wanted.append(node)
        names: list[str] = []
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        for name in names:
            defs.setdefault(name, []).append(node)
    todo = list(_NAMES)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in defs.get(name, []):
            wanted.append(node)
            todo += [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    out = ["\n"] * len(lines)
    for node in wanted:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        assert node.end_lineno is not None
        out[first - 1:node.end_lineno] = lines[first - 1:node.end_lineno]
    return "".join(out)


def _code(src: Path) -> CodeType | None:
    """The selected statements' code, from the cache or compiled and stored; None where neither works."""
    try:
        st = src.stat()
        stamp = b"%d %d" % (st.st_size, st.st_mtime_ns)
        key = b"\0".join((_FORMAT, importlib.util.MAGIC_NUMBER, os.fsencode(src), stamp))
        where = os.fsencode(src) + importlib.util.MAGIC_NUMBER  # one entry per gguf-py and Python, rewritten on change
        path = os.path.join(cache_root(), "gguf-constants", f"{zlib.crc32(where):08x}.bin")
        try:
            with open(path, "rb") as f:
                data = f.read()
            if data[:len(key)] == key:
                code = marshal.loads(data[len(key):])
                if isinstance(code, CodeType):
                    return code
        except (OSError, ValueError, EOFError, TypeError):
            pass
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.access(os.path.dirname(path), os.W_OK):
            return None  # the whole file is cheaper than selecting anew in every run
        code = compile(_selected(src.read_text(encoding="utf-8")), str(src), "exec")
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(key + marshal.dumps(code))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return code
    except Exception:  # an unwritable cache, a file gguf-py changed in a way the selection does not cover
        return None


def _whole(src: Path) -> ModuleType:
    """gguf-py's constants.py loaded on its own, as `gguf.constants` (the package's __init__ not run)."""
    if "gguf.constants" in sys.modules:
        return sys.modules["gguf.constants"]
    cspec = importlib.util.spec_from_file_location("gguf.constants", src)
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


def _load(src: Path) -> dict[str, Any]:
    code = _code(src)
    if code is not None:
        ns: dict[str, Any] = {"__name__": __name__, "__builtins__": __builtins__}
        try:
            exec(code, ns)  # noqa: S102 - gguf-py's own statements, selected from its installed file
            if all(n in ns for n in _NAMES):
                return ns
        except Exception:
            pass
    mod = _whole(src)
    return {n: getattr(mod, n) for n in _NAMES}


SOURCE = _source()  # gguf-py's constants.py (fitter.gguf.header_cache digests it)
_c = _load(SOURCE)

GGML_QUANT_SIZES = _c["GGML_QUANT_SIZES"]
GGML_QUANT_VERSION = _c["GGML_QUANT_VERSION"]
GGMLQuantizationType = _c["GGMLQuantizationType"]
GGUF_DEFAULT_ALIGNMENT = _c["GGUF_DEFAULT_ALIGNMENT"]
GGUF_MAGIC = _c["GGUF_MAGIC"]
GGUFValueType = _c["GGUFValueType"]
Keys = _c["Keys"]
LlamaFileType = _c["LlamaFileType"]
