"""What ggfit keeps of what it can compute again: on disk, and in this process (the standard library only).

On disk, under `${GGFIT_CACHE:-~/.cache/ggfit}` (cache_root): `headers/` (fitter.gguf.header_cache),
`gguf-constants/` (fitter.gguf.constants), the llama-server builds (search.build_server).

In this process: the memos of fitter's modules (a header's graph details, compute buffers by config, traced graphs,
weight placements, ...). Each module registers its memos with CACHES when it is imported (`keep`, under a group
that says what they hold); `CACHES.clear()` empties them all, `CACHES.clear("compute")` one group.
tests/conftest.py clears them all before every test, so that no test sees what another computed.
"""

from __future__ import annotations

import os
from typing import Callable, Protocol, TypeVar


def cache_root() -> str:
    """$GGFIT_CACHE, else ~/.cache/ggfit."""
    return os.environ.get("GGFIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ggfit")


class _Clearable(Protocol):
    def clear(self) -> None: ...


M = TypeVar("M", bound=_Clearable)


class Caches:
    """The process's memos, by group: a dict, set or list, or any object with `clear()`. (A functools.lru_cache over
    a pure function of its arguments, names and the like, is not one: nothing computed before changes its answers.)"""

    __slots__ = ("_groups",)

    def __init__(self) -> None:
        self._groups: dict[str, list[Callable[[], None]]] = {}

    def keep(self, memo: M, group: str) -> M:
        """Register `memo` (returned as it is): `clear` empties it with its group."""
        self._groups.setdefault(group, []).append(memo.clear)
        return memo

    @property
    def groups(self) -> list[str]:
        return sorted(self._groups)

    def clear(self, *groups: str) -> None:
        """Empty the memos of these groups (an unknown group is an error), or of all groups when none is named."""
        for group in groups or tuple(self._groups):
            for clear in self._groups[group]:
                clear()


CACHES = Caches()
