"""The pinned llama.cpp's own figures for an mmproj: tests/mtmd/mtmd_mem.c, linked against llama-cpp-python's libmtmd.

The program interposes ggml_backend_buft_alloc_buffer, so it reports the exact bytes of every buffer clip.cpp
allocates (clip prints no weight-buffer line, and its "compute buffer size" line is rounded to 0.01 MiB).
Built once per source under ${GGFIT_CACHE:-~/.cache/ggfit}/mtmd/; needs a C++ compiler and the pinned llama.cpp's
headers ($GGFIT_LLAMA_CPP_SRC, else the reference checkout, else the ones llama-cpp-python's wheel installs); the
tests that need it are skipped without them.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

_SRC = Path(__file__).with_name("mtmd_mem.cpp")
_VENDOR = Path("/work/ref/llama_cpp_python-0.3.36/vendor/llama.cpp")


@dataclass
class MtmdRun:
    allocs: list[tuple[str, int]]  # (buffer type, bytes) in allocation order: the weights first
    compute_lines: list[tuple[str, float]]  # reserve_compute_meta's "compute buffer size" lines (MiB)
    warmup_size: int
    flash_attn: bool
    grown: list[tuple[str, int]]  # buffers (re)allocated while encoding the image, if one was asked for


def _include_dirs() -> list[Path] | None:
    """The pinned llama.cpp's headers ($GGFIT_LLAMA_CPP_SRC, the reference checkout, or the ones the llama-cpp-python
    wheel installs next to its package, from the same build as its libmtmd), None where there are none."""
    roots = [Path(os.environ["GGFIT_LLAMA_CPP_SRC"])] if os.environ.get("GGFIT_LLAMA_CPP_SRC") else []
    for root in (*roots, _VENDOR):
        if (root / "tools/mtmd/mtmd.h").exists():
            return [root / "ggml/include", root / "include", root / "tools/mtmd"]
    installed = Path(llama_cpp.__file__).parent.parent / "include"
    if (installed / "mtmd.h").exists() and (installed / "ggml-backend.h").exists():
        return [installed]
    return None


def binary() -> Path | None:
    """The built oracle, or None without a C++ compiler, llama-cpp-python's libmtmd or the pinned headers."""
    cc = shutil.which("g++") or shutil.which("c++")
    lib = Path(llama_cpp.__file__).parent / "lib"
    if cc is None or not (lib / "libmtmd.so").exists():
        return None
    key = hashlib.sha256(_SRC.read_bytes() + str(lib).encode()).hexdigest()[:12]
    out = Path(os.environ.get("GGFIT_CACHE") or Path.home() / ".cache" / "ggfit") / "mtmd" / f"mtmd_mem-{key}"
    if out.exists():
        return out
    dirs = _include_dirs()
    if dirs is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}")
    inc = [f"-I{d}" for d in dirs]
    subprocess.run([cc, "-O1", "-rdynamic", "-o", str(tmp), str(_SRC), *inc, f"-L{lib}", "-lmtmd", "-lggml-base",
                    "-lggml", "-lllama", "-ldl", f"-Wl,-rpath,{lib}"], check=True)
    os.replace(tmp, out)
    return out


def run(path: str | Path, flash_attn: str = "auto", use_gpu: bool = False, encode: int = 0) -> MtmdRun:
    """Load `path` (and with `encode`, encode one encode x encode image after the warmup)."""
    exe = binary()
    assert exe is not None
    fa = {"auto": -1, "off": 0, "on": 1}[flash_attn]
    p = subprocess.run([str(exe), str(path), str(fa), "1" if use_gpu else "0", str(encode)], capture_output=True,
                       text=True, timeout=300)
    log = p.stderr
    assert p.returncode == 0 and "ggfit-done" in log, log[-2000:]
    allocs = [(m[1], int(m[2])) for m in re.finditer(r"ggfit-alloc: (\S+) (\d+)", log.split("ggfit-encode:")[0])]
    grown = [(m[1], int(m[2])) for m in re.finditer(r"ggfit-alloc: (\S+) (\d+)", log.partition("ggfit-encode:")[2])]
    lines = [(m[1], float(m[2])) for m in re.finditer(r"(\S+) compute buffer size = +([\d.]+) MiB", log)]
    warm = re.search(r"warmup with image size = (\d+) x", log)
    return MtmdRun(allocs, lines, int(warm[1]) if warm else 0, "flash attention is enabled" in log, grown)
