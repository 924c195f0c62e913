"""The persistent journal: WAL appends before replies (group commit), periodic snapshots, fencing, and
the Redis-outage policy.

Periodic snapshots are written by a standby process that replays the WAL (`kvservice.store.snapshotter`:
the serving process never stops for them); with `snapshot_mode="fork"` they are taken in a forked child
instead (a consistent point-in-time copy that costs the event loop one fork and the copy-on-write that
follows). A resync after a Redis outage always forks: the mutations acknowledged meanwhile exist only in
this process's memory.

States: `kvservice.store.base.PersistenceState`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import redis

from kvservice.allocator import Allocator
from kvservice.commands import Barrier, Command
from kvservice.errors import Unavailable
from kvservice.processes import parent_death_signal
from kvservice.store import wal
from kvservice.store.base import Journal, JournalStats
from kvservice.store.base import PersistenceState as PS
from kvservice.store.redis_store import FencedError, LeaderLostError, RedisStore, write_pending_snapshot_sync
from kvservice.store.snapshot import dump

logger = logging.getLogger(__name__)
# An unreachable Redis, or one refusing writes (e.g. MISCONF: its disk is full and the AOF cannot grow).
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError)


class PersistentJournal(Journal):
    def __init__(self, store: RedisStore, allocator: Allocator, require_persistence: bool = False,
                 snapshot_every: int = 50_000, snapshot_interval_s: float = 60.0,
                 on_fenced: Callable[[str], None] | None = None, snapshot_mode: str = "standby",
                 standby_options: list[str] | None = None) -> None:
        if snapshot_mode not in ("standby", "fork"):
            raise ValueError(f"snapshot_mode must be 'standby' or 'fork', got {snapshot_mode!r}")
        self.store = store
        self.allocator = allocator
        self.require_persistence = require_persistence
        self.snapshot_every = snapshot_every
        self.snapshot_interval_s = snapshot_interval_s
        self.on_fenced = on_fenced
        self.state = PS.OK
        self._queue: list[tuple[bytes, asyncio.Future | None]] = []
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._since_snapshot = 0
        self._last_snapshot = time.monotonic()
        self._snapshot_task: asyncio.Task | None = None
        self.snapshot_mode = snapshot_mode
        self.standby_options = standby_options or []
        self._standby: subprocess.Popen | None = None
        self._snapshots_at_start: int | None = None
        self.stats = JournalStats()

    @property
    def leader_epoch(self) -> int:
        return self.store.epoch

    def start(self) -> None:
        """Starts the WAL writer and the health watch (and the standby snapshotter). Call from the main
        thread: the standby gets the parent-death signal, which fires when the spawning thread exits."""
        self._tasks = [asyncio.create_task(self._writer()), asyncio.create_task(self._watch())]
        if self.snapshot_mode == "standby":
            self._start_standby()

    def _start_standby(self) -> None:
        cmd = [sys.executable, "-m", "kvservice.store.snapshotter", "--redis-url", self.store.url,
               "--namespace", self.store.namespace, "--epoch", str(self.store.epoch),
               "--every", str(self.snapshot_every), "--interval", str(self.snapshot_interval_s),
               "--log-level", logging.getLevelName(logging.getLogger("kvservice").getEffectiveLevel()),
               *self.standby_options]
        self._standby = subprocess.Popen(cmd, preexec_fn=parent_death_signal())

    async def stop(self) -> None:
        if self._standby is not None and self._standby.poll() is None:
            self._standby.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._standby.wait(5)
        for task in self._tasks:
            task.cancel()
        if self._snapshot_task is not None:
            with contextlib.suppress(BaseException):
                await self._snapshot_task
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.store.close()

    # ---- the servicer's interface --------------------------------------------------------------
    def check_writable(self) -> None:
        if self.state is PS.FENCED:
            raise Unavailable("this allocator was fenced by a newer one and is shutting down; reconnect")
        if self.state is not PS.OK and self.require_persistence:
            why = ("Redis is back and the resync snapshot is being written" if self.state is PS.RESYNCING
                   else "Redis is down")
            raise Unavailable(f"persistence is not durable yet ({why}) and --require-persistence is set; retry "
                              f"with the same sequence shortly")

    async def record(self, command: Command) -> None:
        """Logs one applied command; returns once it is in Redis (or, degraded, at once). Must be called
        right after the command was applied, before any await, so the WAL order is the apply order."""
        raw = wal.encode(command)
        if self.state is PS.DEGRADED:
            return  # acknowledged from memory; the resync snapshot will cover it
        if self.state not in (PS.OK, PS.RESYNCING):
            raise Unavailable("persistence is unavailable; the mutation was not acknowledged")
        future = asyncio.get_running_loop().create_future()
        self._queue.append((raw, future))
        self._wakeup.set()
        await future

    # ---- the WAL writer (group commit) ---------------------------------------------------------
    async def _writer(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch, self._queue = self._queue, []
                started = time.perf_counter()
                try:
                    ids = await self.store.append([raw for raw, _ in batch])
                except FencedError as exc:
                    self._fenced(str(exc), batch)
                    return
                except (LeaderLostError, *REDIS_ERRORS) as exc:
                    self._outage(exc, batch)  # the watch takes a lost leader key back, then resyncs
                    continue
                elapsed = time.perf_counter() - started
                self.stats.append_seconds += elapsed
                if self.write_observer is not None:
                    self.write_observer(elapsed)
                self.stats.entries += len(batch)
                self.stats.bytes += sum(len(raw) for raw, _ in batch)
                self.stats.batches += 1
                self._since_snapshot += len(batch)
                for (_, future), entry_id in zip(batch, ids):
                    if future is not None and not future.done():
                        future.set_result(entry_id)
            if (self.snapshot_mode == "fork" and self._since_snapshot >= self.snapshot_every
                    and self._snapshot_task is None):
                self.snapshot()

    def _outage(self, exc: BaseException, batch) -> None:
        if self.require_persistence:
            self.state = PS.DOWN
            logger.error("Redis unavailable (%r): refusing mutations until it is back (--require-persistence)", exc)
            for _, future in batch:
                if future is not None and not future.done():
                    future.set_exception(Unavailable(f"persistence failed ({exc!r}); the mutation was not "
                                                     "acknowledged: retry with the same sequence"))
        else:
            self.state = PS.DEGRADED
            logger.error("Redis unavailable (%r): serving from memory (degraded) until it is back", exc)
            for _, future in batch:
                if future is not None and not future.done():
                    future.set_result(None)
        for _, future in self._queue:  # entries queued behind the failed batch share its fate
            if future is not None and not future.done():
                if self.require_persistence:
                    future.set_exception(Unavailable("persistence failed; retry with the same sequence"))
                else:
                    future.set_result(None)
        self._queue = []

    def _fenced(self, message: str, batch) -> None:
        self.state = PS.FENCED
        logger.critical("fenced: %s", message)
        for _, future in batch + self._queue:
            if future is not None and not future.done():
                future.set_exception(Unavailable("this allocator was fenced by a newer one; reconnect"))
        self._queue = []
        if self.on_fenced is not None:
            self.on_fenced(message)

    # ---- health: leadership, outages, periodic snapshots ---------------------------------------
    async def _watch(self) -> None:
        while self.state is not PS.FENCED:
            await asyncio.sleep(0.5)
            try:
                leader = await self.store.leader()
                if leader is None:
                    leader = await self._leader_lost()
            except REDIS_ERRORS as exc:
                if self.state in (PS.OK, PS.RESYNCING):
                    self._outage(exc, [])
                continue
            if leader != self.store.epoch:
                self._fenced(f"the leader is epoch {leader}, this allocator holds {self.store.epoch}", [])
                return
            if self.state in (PS.DEGRADED, PS.DOWN) and self._snapshot_task is None:
                logger.warning("Redis is back: writing a fresh snapshot to resync")
                self.snapshot(resync=True)
            elif self.snapshot_mode == "fork":
                if (self.state is PS.OK and self._since_snapshot and self._snapshot_task is None
                        and time.monotonic() - self._last_snapshot >= self.snapshot_interval_s):
                    self.snapshot()
            else:
                await self._watch_standby()
            if not await self._renew():
                self._fenced(f"the lease belongs to a newer leader than epoch {self.store.epoch}", [])
                return

    async def _renew(self) -> bool:
        """The lease a hot standby watches (False: this allocator is not the leader any more)."""
        try:
            return await self.store.renew_lease()
        except REDIS_ERRORS:
            return True  # Redis away: nothing to renew against (a standby cannot take over meanwhile either)

    async def _leader_lost(self) -> int | None:
        """Redis answers without our leader key: it lost its data, and with it the WAL and the snapshot. Only
        this process's memory holds the state now: take the key back (if still absent), serve degraded
        (refuse under --require-persistence) and resync from memory. Returns the leader epoch after."""
        # Not durable from now on, and so before the loss is counted: /metrics reads both from its own thread, and
        # must never find the loss counted while the state is still "ok" from before it.
        if self.state in (PS.OK, PS.RESYNCING):
            self._outage(LeaderLostError("Redis lost its data"), [])
        self.stats.redis_data_losses += 1
        logger.critical("Redis lost this allocator's data (the leader key of epoch %d is gone): taking leadership "
                        "back and writing a fresh snapshot from memory; serving %s until it is committed",
                        self.store.epoch, "nothing" if self.require_persistence else "degraded")
        if not await self.store.retake_leadership():
            return await self.store.leader()  # another allocator wrote the key meanwhile: fenced
        return self.store.epoch

    async def _watch_standby(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            committed = await self.store.snapshots_committed()  # by the standby and by resyncs alike
            if self._snapshots_at_start is None or committed < self._snapshots_at_start:  # (Redis lost its count)
                self._snapshots_at_start = committed
            self.stats.snapshots = committed - self._snapshots_at_start
            self.stats.last_snapshot_at = await self.store.last_snapshot_at()
        if self._standby is not None and self._standby.poll() is not None and self.state is not PS.FENCED:
            logger.warning("the standby snapshotter exited with %s: restarting it", self._standby.returncode)
            self._start_standby()

    def snapshot(self, resync: bool = False) -> asyncio.Task:
        """Starts a snapshot: a barrier entry marks the WAL position, a forked child serializes the
        state as of that instant, then the snapshot is committed and the WAL trimmed behind it."""
        barrier = wal.encode(Barrier(resync))
        future = asyncio.get_running_loop().create_future()
        self._queue.append((barrier, future))
        self._wakeup.set()
        if resync:
            # From the barrier on, mutations are logged again (after it), but a crash before the snapshot
            # commits would lose what only it covers: not OK (durable) until then.
            self.state = PS.RESYNCING
        pid = self._fork_child()
        self._since_snapshot = 0
        self._last_snapshot = time.monotonic()
        self._snapshot_task = asyncio.create_task(self._finish_snapshot(pid, future, resync))
        return self._snapshot_task

    def _fork_child(self) -> int:
        # The child holds a copy of every descriptor, the gRPC port's too: it must not outlive this process.
        arm = parent_death_signal(signal.SIGKILL, main_thread_only=False)
        pid = os.fork()
        if pid == 0:  # the child: no event loop, no gRPC, no logging: serialize, write, exit
            code = 1
            gc.disable()  # never traverse objects other (now absent) threads were mutating
            try:
                if arm is not None:
                    arm()
                os.nice(10)  # serializing must not take CPU time from serving
                start = time.perf_counter()
                data = dump(self.allocator)
                write_pending_snapshot_sync(self.store.url, self.store.namespace, self.store.epoch, data)
                with contextlib.suppress(OSError):
                    os.write(2, f"snapshot: {len(data)} bytes in {time.perf_counter() - start:.3f} s\n".encode())
                code = 0
            finally:
                os._exit(code)
        return pid

    async def _finish_snapshot(self, pid: int, barrier: asyncio.Future, resync: bool) -> None:
        start = time.perf_counter()
        try:
            _, status = await asyncio.get_running_loop().run_in_executor(None, os.waitpid, pid, 0)
            wal_id = await barrier
            if os.waitstatus_to_exitcode(status) != 0 or wal_id is None:
                raise RuntimeError(f"snapshot child exited with {os.waitstatus_to_exitcode(status)}")
            self.stats.wal_lag = await self.store.commit_snapshot(wal_id, "fork")
            if resync and self.state is PS.RESYNCING:
                # Logged first: whoever sees "ok" (GetStats, /metrics from its own thread) finds the line written.
                logger.warning("resync snapshot committed: persistence is ok again")
                self.state = PS.OK
            if self.snapshot_mode == "fork":
                self.stats.snapshots += 1
            self.stats.last_snapshot_s = time.perf_counter() - start
            self.stats.last_snapshot_at = time.time()
            usage = await self.store.usage()
            self.stats.last_snapshot_bytes = usage["snapshot_bytes"]
            logger.info("snapshot committed at WAL id %s (%d bytes, %d WAL entries left)", wal_id,
                        usage["snapshot_bytes"], usage["wal_entries"])
        except FencedError as exc:
            self._fenced(str(exc), [])
        except BaseException as exc:  # noqa: BLE001 - any failure leaves the WAL untrimmed, which is safe
            self.stats.snapshot_failures += 1
            logger.error("snapshot failed: %r", exc)
            if resync and self.state is PS.RESYNCING:
                self.state = PS.DOWN if self.require_persistence else PS.DEGRADED
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._snapshot_task = None
