"""Child processes that must not outlive their parent (a redis-server, a snapshotter, a test server), and the
priority of the control plane's own processes."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
logger = logging.getLogger(__name__)


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


def normal_priority(what: str) -> None:
    """Runs this process (and the children it starts from now on) at niceness 0. Ray starts its workers at
    niceness 15 (RAY_worker_niceness): an allocator, a standby or a store hosted by a Ray actor would then get
    a few percent of a core whenever anything else on the node is busy, and a failover would wait on it. Needs
    the right to raise priority (root, or CAP_SYS_NICE); without it, says how to get it."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        logger.warning("%s runs at niceness %d (Ray's worker niceness) and may not lower it: any busy process on "
                       "this node starves it. Start Ray with RAY_worker_niceness=0, or grant CAP_SYS_NICE", what,
                       niceness)
