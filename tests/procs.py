"""Process checks for the tests, from /proc (no psutil)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def live_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name: state, ppid, pgrp, ...) of every live
    (non-zombie) process."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z":
            yield int(d), fields


def group_alive(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group `pgid`."""
    return [pid for pid, fields in live_processes() if int(fields[2]) == pgid]
