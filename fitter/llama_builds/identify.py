"""Which llama.cpp build a binary or a log is: the line llama.cpp prints about itself.

`--version` printed `version: 9102 (7d442abf5)` until 2026; the pinned build prints
`version: <version> (build 11312, commit 0c1e57098bba)` (common/build-info.cpp.in, llama_print_build_info).
Logs start with `build: 9102 (7d442abf5) with <compiler> for <target>`, now `common_params_print_info: build 11312
(0c1e57098) with ...` (common/common.cpp). Release archives and containers name themselves `b9102-7d442abf5`.
A build made outside a git checkout (llama-cpp-python's sdist, its vendored tree alone) has build number 0, one made
from the whole sdist build number 1 (its vendored submodule is a one-commit shallow clone): then only its commit says
which it is.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from fitter.llama_builds import BuildError, LlamaBuild, resolve_build

_PATTERNS = (
    re.compile(r"\(build\s+(\d{1,6}),\s*commit\s+([0-9a-f]{7,40})\)"),
    re.compile(r"\bbuild\s+b?(\d{1,6})\s*\(([0-9a-f]{7,40})\)"),
    re.compile(r"\b(?:version|build)\s*[:=]\s*b?(\d{1,6})\s*\(([0-9a-f]{7,40})\)"),
    re.compile(r"\b(?:version|build)\s*[:=]\s*b(\d{3,6})-([0-9a-f]{7,40})\b"),
    re.compile(r"\bllama\.cpp\s+(?:build\s+)?b(\d{3,6})\s*\(([0-9a-f]{7,40})\)"),
    re.compile(r"(?<![\w.])b(\d{4,6})-([0-9a-f]{7,40})\b"),
)
_NUMBER_ONLY = re.compile(r"\b(?:version|build)\s*[:=]\s*b?(\d{3,6})\b(?!\s*\()")


def build_in_text(text: str) -> tuple[int | None, str | None] | None:
    """The first build line in a log or `--version` output: (number or None for build 0, commit prefix or None)."""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):  # a comment someone added around a pasted log
            continue
        for p in _PATTERNS:
            if m := p.search(line):
                return int(m.group(1)) or None, m.group(2)
        if m := _NUMBER_ONLY.search(line):
            return int(m.group(1)), None
    return None


def build_from_text(text: str, what: str) -> LlamaBuild:
    """The build a log (or --version output) names; `what` names the source in messages."""
    return build_from_line(build_in_text(text), what)


def build_from_line(found: tuple[int | None, str | None] | None, what: str) -> LlamaBuild:
    """The build of a build line's (number, commit) (see `build_in_text`); `what` names the source in messages."""
    if found is None:
        raise BuildError(f"{what}: no llama.cpp build line in it (like 'build: 9102 (7d442abf5)'), and what llama.cpp "
                         f"reserves depends on the build; give it with --llama-build bNNNN, a commit or a date "
                         f"(llama-server --version prints it)")
    number, commit = found
    try:
        b = resolve_build(None, number=number, commit=commit)
    except BuildError as e:
        raise BuildError(f"{what}: its build line says b{number}: {str(e).split(': ', 1)[-1]}") from None
    if b.is_pinned:
        return b
    named = " ".join(x for x in (f"b{number}" if number else "", f"({commit})" if commit else "") if x)
    return LlamaBuild(date=b.date, number=number or b.number, commit=commit or b.commit,
                      date_estimated=b.date_estimated,
                      how=f"{what}: build {named}" + (", date estimated from its number" if b.date_estimated else ""))


def build_of_binary(path: str | os.PathLike[str]) -> LlamaBuild:
    """Run `<binary> --version` (llama-server, llama-cli, llama-fit-params) and read its build."""
    p = Path(path)
    if not p.is_file() or not os.access(p, os.X_OK):
        raise BuildError(f"{p}: not an executable llama.cpp binary")
    try:
        # the file named, relative to the working directory as probe's find_llama_server takes it: str(Path(
        # "./llama-server")) is "llama-server", which exec would look for on PATH instead
        r = subprocess.run([os.path.abspath(p), "--version"], capture_output=True, text=True, timeout=20,
                           stdin=subprocess.DEVNULL, errors="replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{p} --version: {e}") from None
    return build_from_text(r.stdout + "\n" + r.stderr, f"{p.name} --version")
