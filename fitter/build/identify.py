"""Which llama.cpp build a binary or a log is: the line llama.cpp prints about itself.

`llama-server --version` prints `version: 9102 (7d442abf5)`; every tool's log starts with
`build: 9102 (7d442abf5) with <compiler> for <target>` (common/common.cpp, common_params print_build_info);
release archives and containers name themselves `b9102-7d442abf5`.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from fitter.build import BuildError, LlamaBuild, resolve_build

_PATTERNS = (
    re.compile(r"\b(?:version|build)\s*[:=]\s*b?(\d{3,6})\s*\(([0-9a-f]{7,40})\)"),
    re.compile(r"\b(?:version|build)\s*[:=]\s*b(\d{3,6})-([0-9a-f]{7,40})\b"),
    re.compile(r"\bllama\.cpp\s+(?:build\s+)?b(\d{3,6})\s*\(([0-9a-f]{7,40})\)"),
    re.compile(r"(?<![\w.])b(\d{4,6})-([0-9a-f]{7,40})\b"),
)
_NUMBER_ONLY = re.compile(r"\b(?:version|build)\s*[:=]\s*b?(\d{3,6})\b(?!\s*\()")


def build_in_text(text: str) -> tuple[int, str | None] | None:
    """The first build line in a log or `--version` output: (number, commit prefix or None)."""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):  # a comment someone added around a pasted log
            continue
        for p in _PATTERNS:
            if m := p.search(line):
                return int(m.group(1)), m.group(2)
        if m := _NUMBER_ONLY.search(line):
            return int(m.group(1)), None
    return None


def build_from_text(text: str, what: str) -> LlamaBuild:
    """The build a log (or --version output) names; `what` names the source in messages."""
    found = build_in_text(text)
    if found is None:
        raise BuildError(f"{what}: no llama.cpp build line (like 'build: 9102 (7d442abf5)') in it; "
                         f"give the build with --llama-build bNNNN (llama-server --version prints it) or a date")
    number, commit = found
    b = resolve_build(None, number=number, commit=commit)
    return LlamaBuild(date=b.date, number=number, commit=commit or b.commit, date_estimated=b.date_estimated,
                      how=f"{what}: build b{number}" + (f" ({commit})" if commit else "")
                      + (", date estimated from its number" if b.date_estimated else ""))


def build_of_binary(path: str | os.PathLike[str]) -> LlamaBuild:
    """Run `<binary> --version` (llama-server, llama-cli, llama-fit-params) and read its build."""
    p = Path(path)
    if not p.is_file() or not os.access(p, os.X_OK):
        raise BuildError(f"{p}: not an executable llama.cpp binary")
    try:
        r = subprocess.run([str(p), "--version"], capture_output=True, text=True, timeout=20,
                           stdin=subprocess.DEVNULL, errors="replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{p} --version: {e}") from None
    return build_from_text(r.stdout + "\n" + r.stderr, f"{p.name} --version")
