"""Build llama-server from the pinned llama.cpp source, once, into ggfit's cache.

    python -m search.build_server            # prints the binary's path (builds if needed)
    python -m search.build_server --force    # rebuild

The source is the llama.cpp tree vendored by llama-cpp-python 0.3.36 (commit 0c1e57098bba), the very
build the `python` probe runner loads, so both runners measure the same code. It is found, in order:
`$GGFIT_LLAMA_SRC` (a llama.cpp checkout), an unpacked sdist at /tmp/lcp/llama_cpp_python-0.3.36, an
sdist already extracted into the cache, else `pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36` (served from pip's cache when offline) extracted into the cache.

Only the `llama-server`, `llama-fit-params` and `ggml-rpc-server` targets are built (the second is what
`ggfit fit --check --llama-bin` runs; the third is llama.cpp's rpc-server, with GGML_RPC=ON): CMake, Release, `-DGGML_NATIVE=ON`, static libraries (the
binary is self-contained and cannot pick up another libllama), no curl/OpenSSL, no web UI (nothing is
downloaded at build time), build info stamped with the pinned commit. The result is
`${GGFIT_CACHE:-~/.cache/ggfit}/llama-server-<commit>/bin/llama-server` (and llama-fit-params beside it),
reused when both are present and llama-server runs. A file lock makes concurrent callers (parallel test sessions) wait for one build.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from fitter.cache import cache_root as fitter_cache_root
from fitter.errors import GGFitError
from fitter.llama_builds import PINNED_COMMIT, PINNED_LLAMA_CPP_PYTHON

SDIST = f"llama_cpp_python-{PINNED_LLAMA_CPP_PYTHON}"
KNOWN_UNPACKED = (Path("/tmp/lcp") / SDIST,)

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",  # deprecated in the pinned build (warns), kept for older trees
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else CMake fetches the web UI from a Hugging Face bucket
    "-DGGML_RPC=ON",  # llama-server --rpc and ggml-rpc-server (issue 47); no RPC device exists until --rpc names one
)


class BuildError(GGFitError):
    """llama-server could not be built (no source, no compiler, CMake failed); the message says which step."""


def cache_root() -> Path:
    return Path(fitter_cache_root())


def server_dir(commit: str = PINNED_COMMIT) -> Path:
    return cache_root() / f"llama-server-{commit}"


def server_binary(commit: str = PINNED_COMMIT) -> Path:
    return server_dir(commit) / "bin" / "llama-server"


# llama-fit-params: `ggfit fit --check --llama-bin` (tests); ggml-rpc-server: tools/rpc, the remote side of --rpc
TOOLS = ("llama-server", "llama-fit-params", "ggml-rpc-server")


def _usable(binary: Path) -> bool:
    """llama-server answers --version, and llama-fit-params is there beside it."""
    if not all((binary.parent / t).is_file() and os.access(binary.parent / t, os.X_OK) for t in TOOLS):
        return False
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _is_llama_tree(p: Path) -> bool:
    return (p / "CMakeLists.txt").is_file() and (p / "tools" / "server" / "server.cpp").is_file()


def find_source(log=print) -> Path:
    """The pinned llama.cpp source tree (see the module docstring for the order)."""
    env = os.environ.get("GGFIT_LLAMA_SRC")
    if env:
        p = Path(env)
        if not _is_llama_tree(p):
            raise BuildError(f"GGFIT_LLAMA_SRC={env} is not a llama.cpp tree (no tools/server/server.cpp)")
        return p
    for root in KNOWN_UNPACKED:
        p = root / "vendor" / "llama.cpp"
        if _is_llama_tree(p):
            return p
    extracted = cache_root() / "src" / SDIST / "vendor" / "llama.cpp"
    if _is_llama_tree(extracted):
        return extracted
    dl = cache_root() / "src" / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    log(f"fetching the {SDIST} sdist with pip (from pip's cache when offline)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={PINNED_LLAMA_CPP_PYTHON}", "-d", str(dl), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    tars = sorted(dl.glob(f"{SDIST}.tar.gz"))
    if r.returncode != 0 or not tars:
        raise BuildError(f"cannot get the llama.cpp source: pip download failed: {(r.stderr or r.stdout).strip()[-500:]}")
    prefix = f"{SDIST}/vendor/llama.cpp/"
    with tarfile.open(tars[0]) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
        tf.extractall(cache_root() / "src", members=members, filter="data")
    if not _is_llama_tree(extracted):
        raise BuildError(f"{tars[0]} holds no vendor/llama.cpp with tools/server")
    tars[0].unlink()  # pip keeps its own cached copy
    return extracted


def build_llama_server(*, force: bool = False, jobs: int | None = None, log=print) -> Path:
    """Path of a runnable llama-server of the pinned commit, building it first if needed."""
    binary = server_binary()
    if not force and _usable(binary):
        return binary
    out = server_dir()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building: wait for it
        if not force and _usable(binary):
            return binary
        src = find_source(log)
        for tool in ("cmake", "c++"):
            if shutil.which(tool) is None:
                raise BuildError(f"building llama-server needs {tool} on PATH")
        build = out / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        jobs = jobs or os.cpu_count() or 2
        t0 = time.perf_counter()
        log(f"building llama-server {PINNED_COMMIT} from {src} into {out} ({jobs} jobs)")
        steps = [
            ["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS, f"-DLLAMA_BUILD_COMMIT={PINNED_COMMIT}"],
            ["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(jobs)],
        ]
        logf = out / "build.log"
        with open(logf, "w") as lf:
            for cmd in steps:
                lf.write("$ " + " ".join(cmd) + "\n")
                lf.flush()
                r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT)
                if r.returncode != 0:
                    tail = logf.read_text(errors="replace").strip().splitlines()[-15:]
                    raise BuildError(f"`{' '.join(cmd[:3])} ...` failed (exit {r.returncode}); log {logf}:\n" + "\n".join(tail))
        binary.parent.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            built = build / "bin" / tool
            if not built.is_file():
                raise BuildError(f"the build finished but {built} does not exist; log {logf}")
            tmp = (binary.parent / tool).with_suffix(".tmp")
            shutil.copy2(built, tmp)
            os.replace(tmp, binary.parent / tool)
        secs = time.perf_counter() - t0
        (out / "build_seconds").write_text(f"{secs:.1f}\n")
        log(f"built {binary} in {secs:.0f} s")
        if not _usable(binary):
            raise BuildError(f"{binary} was built but `--version` fails")
        return binary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        path = build_llama_server(force="--force" in argv, log=lambda m: print(m, file=sys.stderr))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
