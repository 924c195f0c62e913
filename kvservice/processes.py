"""Child processes that must not outlive their parent (a redis-server, a snapshotter, a test server)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int = signal.SIGTERM, main_thread_only: bool = True) -> Callable[[], None] | None:
    """A `preexec_fn` that has the child receive `sig` when this process dies, even by SIGKILL (Linux).

    None (no such guard) off Linux or off the main thread: the signal fires when the *thread* that
    spawned the child exits, so a child spawned from a short-lived thread would be killed with it.
    `main_thread_only=False` for a forked child that arms it itself (its parent thread is the forking one).
    """
    if not sys.platform.startswith("linux"):
        return None
    if main_thread_only and threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def preexec() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return preexec
