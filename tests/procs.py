"""Process checks for the tests, from /proc (no psutil)."""

from __future__ import annotations

import os
from pathlib import Path


def group_alive(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group `pgid`."""
    alive = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(d))
    return alive
