"""The rules of llama.cpp builds: the build ggfit predicts for, and which later or earlier build changed what.

ggfit's formulas mirror one build (the pin below: every formula cites its source, every measurement records
it). A user's llama.cpp may be another: `LlamaBuild` names it (by build number, commit, date or the
llama-cpp-python release that vendors it), and the code that depends on the build asks it one question,
`build.has("<change id>")`, about the changes listed in `fitter.llama_builds.changes`.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import sys
from dataclasses import replace

from fitter.errors import GGFitError
from fitter.llama_builds.changes import ANCHORS, CHANGES, RELEASES, Change, Release
from fitter.record import Record

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # vendor/llama.cpp of llama-cpp-python 0.3.36
# the same build, as llama.cpp names itself (LLAMA_COMMIT, 12 hex digits) and as pip names its package
PINNED_COMMIT = LLAMA_CPP_COMMIT[:12]
PINNED_LLAMA_CPP_PYTHON = LLAMA_CPP_PYTHON_VERSION
PINNED_BUILD_NUMBER = 11312

_CHANGES: dict[str, Change] = {c.id: c for c in CHANGES}


class BuildError(GGFitError):
    """A --llama-build value ggfit cannot place."""


class LlamaBuild(Record):
    """One llama.cpp build: its date (exact, or estimated from its build number between two known builds),
    and its number and commit where known. `how` says how it was identified, for the output."""

    date: _dt.date
    number: int | None = None
    commit: str | None = None
    how: str = ""
    date_estimated: bool = False
    flipped: frozenset[str] = frozenset()  # changes taken the other way (to measure what one change costs)

    def has(self, change_id: str) -> bool:
        """Whether this build has the change (fitter.llama_builds.changes)."""
        c = _CHANGES[change_id]  # KeyError: a typo in ggfit, not user input
        if c.first_build is not None and self.number is not None:
            on = self.number >= c.first_build
        else:
            on = self.date >= c.date
        on = on and (c.until is None or self.date < c.until)
        return on != (change_id in self.flipped)

    def flip(self, change_id: str) -> LlamaBuild:
        """This build with one change taken the other way: what-if predictions ("this rule costs +X MiB")."""
        return replace(self, flipped=self.flipped ^ {change_id})

    def uncertain(self, change_id: str) -> bool:
        """The change's merge date is unknown and this build lies inside the window that holds it."""
        c = _CHANGES[change_id]
        return c.window is not None and c.window[0] < self.date < c.window[1]

    @property
    def is_pinned(self) -> bool:
        return self.commit is not None and LLAMA_CPP_COMMIT.startswith(self.commit)

    def differences(self, other: LlamaBuild | None = None) -> list[Change]:
        """The changes one of the two builds has and the other lacks (against the pinned build by default)."""
        other = other or PINNED
        return [c for c in CHANGES if self.has(c.id) != other.has(c.id)]

    def label(self) -> str:
        parts = []
        if self.number is not None:
            parts.append(f"b{self.number}")
        if self.commit:
            parts.append(self.commit[:9])
        parts.append(("~" if self.date_estimated else "") + self.date.isoformat())
        return "llama.cpp " + " ".join(parts)


PINNED = LlamaBuild(date=_dt.date(2026, 10, 1), number=PINNED_BUILD_NUMBER, commit=LLAMA_CPP_COMMIT,
                    how=f"the pinned build (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION})")


# The oldest build ggfit models: every memory-relevant change since it is in fitter.llama_builds.changes (b6000, July 2025:
# Homebrew and distributions lag by months). Builds before it, or after the pin, are refused.
OLDEST_BUILD_NUMBER = 6000


def _dated() -> list[tuple[int, _dt.date]]:
    return sorted({(a.number, a.date) for a in ANCHORS if a.date is not None} |
                  {(r.number, r.date) for r in RELEASES if r.number})


def _interpolated(number: int) -> tuple[_dt.date, bool]:
    known = _dated()
    for n, d in known:
        if n == number:
            return d, False
    lo = max(((n, d) for n, d in known if n < number), default=known[0])
    hi = min(((n, d) for n, d in known if n > number), default=known[-1])
    frac = (number - lo[0]) / (hi[0] - lo[0])
    return lo[1] + _dt.timedelta(days=round(frac * (hi[1] - lo[1]).days)), True


def build_range() -> str:
    """The builds ggfit can date and model, for messages: 'b6000 (~2025-07-26) .. b11312 (2026-10-01)'."""
    return f"b{OLDEST.number} (~{OLDEST.date}) .. b{PINNED.number} ({PINNED.date})"


def check_date(d: _dt.date, shown: str) -> None:
    """A build's date must lie in the range a build number (date_of_build_number) or a commit (_by_commit) is
    dated and modelled in: one range for every form of --llama-build."""
    if not OLDEST.date <= d <= PINNED.date:
        raise BuildError(f"--llama-build {shown}: outside the builds ggfit can date and model ({build_range()})")


def date_of_build_number(number: int) -> tuple[_dt.date, bool]:
    """A build number's date: exact for a known build, else interpolated between the two dated builds around it
    (llama.cpp numbers its builds by commit count: 10 to 30 a day). Before OLDEST_BUILD_NUMBER or after the pin, an
    error: ggfit neither dates nor models it."""
    if not OLDEST_BUILD_NUMBER <= number <= PINNED_BUILD_NUMBER:
        raise BuildError(f"--llama-build b{number}: outside the builds ggfit can date and model ({build_range()})")
    return _interpolated(number)


_Known = tuple[str, int | None, _dt.date | None, str]  # (commit or prefix, build number, date, what it is)


def _known_commits() -> list[_Known]:
    """Every commit ggfit knows: the pin, the llama-cpp-python releases, the anchors."""
    out: list[_Known] = [(LLAMA_CPP_COMMIT, PINNED_BUILD_NUMBER, PINNED.date, "the pinned build")]
    out += [(r.commit, r.number, r.date, f"llama-cpp-python {r.version}'s llama.cpp") for r in RELEASES]
    out += [(a.commit, a.number, a.date, f"build b{a.number}") for a in ANCHORS if a.commit]
    return out


def _commit_of(number: int) -> str | None:
    """The commit of a build number where public material names it (a release or an anchor)."""
    return next((c for c, n, _, _ in _known_commits() if n == number), None)


def _by_commit(prefix: str) -> LlamaBuild | None:
    """The known build whose commit starts with `prefix` (or that `prefix`, a longer hash, starts with); a prefix two
    different builds share is an error."""
    prefix = prefix.lower()
    hits: dict[int | str, _Known] = {}
    for commit, number, date, what in _known_commits():
        if commit.startswith(prefix) or prefix.startswith(commit):
            hits.setdefault(number if number is not None else commit, (commit, number, date, what))
    if not hits:
        return None
    if len(hits) > 1:
        names = ", ".join(f"b{k}" if isinstance(k, int) else k[:9] for k in hits)
        raise BuildError(f"--llama-build {prefix}: this prefix names several known builds ({names}); give more digits")
    commit, number, date, what = next(iter(hits.values()))
    if number == PINNED_BUILD_NUMBER:
        return PINNED
    est = False
    if date is None:
        assert number is not None  # an anchor without a date has a number
        date, est = _interpolated(number)
    if number is not None and not OLDEST_BUILD_NUMBER <= number <= PINNED_BUILD_NUMBER:
        raise BuildError(f"--llama-build {prefix}: build b{number}, outside the builds ggfit can date and model "
                         f"({build_range()})")
    full = commit if len(commit) >= len(prefix) else prefix
    return LlamaBuild(date=date, number=number, commit=full, date_estimated=est,
                      how=f"commit {prefix}: {what}" + (" (date estimated from its number)" if est else ""))


OLDEST = LlamaBuild(date=_interpolated(OLDEST_BUILD_NUMBER)[0], number=OLDEST_BUILD_NUMBER,
                    commit=next(a.commit for a in ANCHORS if a.number == OLDEST_BUILD_NUMBER),
                    how=f"the oldest build ggfit models (b{OLDEST_BUILD_NUMBER})", date_estimated=True)

_USAGE = ("a build number (b8193), a commit prefix (7 or more hex digits), a date (2026-06-15), a llama-cpp-python "
          "version (0.3.25), 'pinned' or 'auto'")


def resolve_build(value: str | None, *, number: int | None = None, commit: str | None = None,
                  date: _dt.date | None = None) -> LlamaBuild:
    """--llama-build VALUE as a build. `auto` is resolved by the caller (it runs a binary or reads a log) and
    comes here as number/commit/date."""
    if value is None or value in ("", "pinned"):
        if number is None and commit is None and date is None:
            return PINNED
        return _from_parts(number, commit, date)
    v = value.strip()
    if m := re.fullmatch(r"[bB](\d{1,6})|(\d{3,6})", v):
        n = int(m.group(1) or m.group(2))
        if n == PINNED_BUILD_NUMBER:
            return PINNED
        d, est = date_of_build_number(n)
        return LlamaBuild(date=d, number=n, commit=_commit_of(n), date_estimated=est,
                          how=f"build b{n}" + (" (date estimated from its number)" if est else ""))
    if re.fullmatch(r"\d+\.\d+\.\d+", v):
        for r in RELEASES:
            if r.version == v:
                if r.version == LLAMA_CPP_PYTHON_VERSION:
                    return PINNED
                return LlamaBuild(date=r.date, number=r.number, commit=r.commit,
                                  how=f"llama-cpp-python {v}'s llama.cpp")
        raise BuildError(f"--llama-build {v}: ggfit knows the llama.cpp of llama-cpp-python "
                         f"{', '.join(r.version for r in RELEASES)}; give that build's number or date instead")
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", v):
        try:
            d = _dt.date.fromisoformat(v)
        except ValueError:
            raise BuildError(f"--llama-build {v}: not a date (YYYY-MM-DD)") from None
        check_date(d, v)
        return LlamaBuild(date=d, how=f"a build of {v}")
    if re.fullmatch(r"[0-9a-fA-F]{7,40}", v):
        b = _by_commit(v)
        if b is None:
            raise BuildError(f"--llama-build {v}: ggfit does not know this commit's date; give the build number "
                             f"(llama-server --version prints it) or the date instead")
        return b
    raise BuildError(f"--llama-build {v}: expected {_USAGE}")


def _from_parts(number: int | None, commit: str | None, date: _dt.date | None) -> LlamaBuild:
    if commit:
        b = _by_commit(commit)
        if b is not None:
            # a number below the commit's own is a shallow clone's count (cmake/build-info.cmake: git rev-list --count;
            # llama-cpp-python's sdist vendors a one-commit clone, whose builds say "build 1"): the commit decides
            if number is None or b.number is None or number <= b.number:
                return b
            return LlamaBuild(date=b.date, number=number, commit=commit, how=b.how)
    if number is not None:
        if number == PINNED_BUILD_NUMBER:
            return PINNED
        if date is not None:
            check_date(date, f"b{number} of {date}")
            return LlamaBuild(date=date, number=number, commit=commit, how=f"build b{number} of {date}")
        d, est = date_of_build_number(number)
        return LlamaBuild(date=d, number=number, commit=commit, date_estimated=est,
                          how=f"build b{number}" + (" (date estimated from its number)" if est else ""))
    if date is not None:
        check_date(date, f"a build of {date}")
        return LlamaBuild(date=date, commit=commit, how=f"a build of {date}")
    raise BuildError("the llama.cpp build could not be identified")


def installed_llama_cpp_python() -> str | None:
    """The installed llama-cpp-python version, read from its metadata (without loading the library)."""
    found = _dist_info_version("llama_cpp_python")
    if found is not None:
        return found
    from importlib import metadata  # 16 ms of imports (email, csv, zipfile): only when the plain search fails

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def _dist_info_version(name: str) -> str | None:
    """The Version of the first dist-info of `name` (a wheel's install) on sys.path, in its order, with names
    normalized as importlib.metadata's path finder has them; None where none is found, an egg's metadata comes first
    or the METADATA cannot be read (the caller then asks importlib.metadata)."""
    want = _normalized(name)
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for d in names:
            stem, _, ext = d.rpartition(".")
            if ext not in ("dist-info", "egg-info") or _normalized(stem.partition("-")[0]) != want:
                continue
            if ext == "egg-info":
                return None  # an egg's (develop install) metadata: importlib.metadata reads it
            try:
                with open(os.path.join(entry or ".", d, "METADATA"), encoding="utf-8") as f:
                    for line in f:
                        if line.startswith("Version:"):
                            return line[len("Version:"):].strip()
                        if line in ("\n", "\r\n"):
                            break  # the headers end at the first blank line
            except OSError:
                pass
            return None
    return None


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def build_label() -> str:
    installed = installed_llama_cpp_python()
    label = f"llama.cpp {PINNED_COMMIT} (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION})"
    if installed and installed != LLAMA_CPP_PYTHON_VERSION:
        label += f"; installed llama-cpp-python {installed} differs: numbers may drift"
    return label


__all__ = [
    "ANCHORS", "CHANGES", "LLAMA_CPP_COMMIT", "LLAMA_CPP_PYTHON_VERSION", "OLDEST", "OLDEST_BUILD_NUMBER", "PINNED",
    "PINNED_BUILD_NUMBER", "PINNED_COMMIT", "PINNED_LLAMA_CPP_PYTHON", "RELEASES", "BuildError", "Change", "LlamaBuild",
    "Release", "build_label", "build_range", "date_of_build_number", "installed_llama_cpp_python", "resolve_build",
]
