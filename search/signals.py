"""SIGTERM for the commands that run probes (`optimise`, `probe`, `compare-engines`): raised where Ctrl-C raises
KeyboardInterrupt, so that the same cleanup runs (the probe's child group killed, the running trial failed and queued
again, one line said), and then the process dies of SIGTERM as it would have (exit status 143 in a shell).

    with sigterm_as_interrupt():
        try:
            ...
        except KeyboardInterrupt as e:
            print("ggfit: ...")
            if isinstance(e, Terminated):
                die_of_sigterm()

Installed, it also keeps `fitter.oracle.child_process.sigterm_cleanup` (inside each probe) from ending the process
before the command has marked its trial: that one only acts where SIGTERM is left to the system."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C raises KeyboardInterrupt (see `sigterm_as_interrupt`)."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs (main thread only), SIGTERM raises `Terminated`; a second SIGTERM during the cleanup ends
    the process at once (its children die with it: `fitter.oracle.child_process.child_preexec`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)


def die_of_sigterm() -> NoReturn:
    """End the process by SIGTERM, as if nobody had caught it (exit status 143 in a shell)."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the signal is delivered at once; this is not reached
    os._exit(128 + signal.SIGTERM)
