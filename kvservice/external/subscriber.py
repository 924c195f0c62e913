"""The subscriptions: per external pool, a ZMQ SUB socket on the engine's PUB socket (and a DEALER on its
replay ROUTER), turning what arrives into IngestEvents commands, in sequence order. With feeds.py, which
runs one per pool, the only part of kvservice.external with sockets and clocks; every decision it takes is a
command, so replay repeats it.

    frame seq == last + 1           -> applied (a pool that has applied nothing expects batch 0: any other
                                       first batch asks the replay from 0 first; a buffer that no longer
                                       reaches back to 0 is a resync, counted and logged)
    frame seq >  last + 1 (a gap)   -> replay from `last`; the batch `last` must come back with the digest
                                       applied, else the publisher restarted (below); a buffer that starts
                                       past `last + 1` cannot fill it: a resync (the index is dropped)
    frame seq <= last               -> the publisher restarted (vLLM counts from 0 again): a new epoch,
                                       then a replay from 0 brings its batches
    (re)connected, or idle a while  -> the same replay check, so what was published meanwhile arrives
                                       (only while the PUB socket is connected: an engine still starting,
                                       or gone, has no replay to ask, and its connection triggers the check)
A replay that does not answer (a busy engine services its ROUTER between sends) settles nothing: the index
stays as of `last`, live frames are held behind the gap in order, and the replay is asked again every
`retry_s`; only after `resync_after_s` without an answer (or MAX_HELD held frames) does the gap resync, as
for a replay that skips a number (a batch the engine never buffered), which applies only up to the hole.
Without a replay endpoint a gap resyncs and a restart starts a new epoch from the frame at hand. Repairs log
at INFO; holds, holes and resyncs warn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvservice.commands import IngestEvents
from kvservice.errors import KVServiceError
from kvservice.external.frames import FrameError, decode_pub_frame
from kvservice.external.pool import ExternalPool, ResetKind, payload_digest
from kvservice.external.replay import Frames, consecutive, fetch_replay
from kvservice.external.spec import ExternalSpec

logger = logging.getLogger(__name__)
MAX_FRAMES_PER_COMMAND = 256
MAX_HELD = 100_000  # live frames held behind an unsettled gap before it resyncs anyway
_CONNECT_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED
_MONITORED = _CONNECT_EVENTS | zmq.EVENT_DISCONNECTED


class Feed:
    """One external pool's subscription. `view()` is the pool as the allocator holds it now (None: gone);
    `submit` applies and journals a command (the servicer's one mutation path)."""

    def __init__(self, spec: ExternalSpec, registration: int, view: Callable[[], ExternalPool | None],
                 submit: Callable[[IngestEvents], Awaitable], context: zmq.asyncio.Context,
                 replay_timeout_s: float = 3.0, idle_sync_s: float = 1.0, retry_s: float = 0.5,
                 resync_after_s: float = 10.0) -> None:
        self.spec = spec
        self.registration = registration
        self.view = view
        self.submit = submit
        self.context = context
        self.replay_timeout_s = replay_timeout_s
        self.idle_sync_s = idle_sync_s
        self.retry_s = retry_s
        self.resync_after_s = resync_after_s
        self.connected = False
        self.gaps = 0
        self.replays = 0
        self.replay_failures = 0
        self._pending: list[tuple[int, bytes]] = []
        self._pending_reset = ResetKind.NONE
        self._counting_gap = False
        self._live_last: int | None = None  # the last sequence of the current connection's live stream
        self._last_activity = time.monotonic()
        self._held: list[tuple[int, bytes, bool]] = []  # (seq, payload, went back) behind an unsettled gap
        self._stalled_since: float | None = None  # when the first held frame's gap found no replay
        self._next_retry = 0.0
        self._hole: tuple[int, int] | None = None  # the last break seen in a replay's numbering (logged once)

    # ---- the loop --------------------------------------------------------------------------------
    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1_000_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
        monitor = sub.get_monitor_socket(_MONITORED)
        self.connected = False
        try:
            if self.spec.bind:
                sub.bind(self.spec.endpoint)
            else:
                sub.connect(self.spec.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            need_sync = True
            while True:
                try:
                    if self._held and (need_sync or time.monotonic() >= self._next_retry):
                        need_sync = False
                        await self._retry()
                    if need_sync and self.connected:
                        need_sync = False
                        await self._flush()
                        await self._sync()
                    wait_s = self.retry_s if self._held else self.idle_sync_s
                    ready = dict(await poller.poll(timeout=int(wait_s * 1000)))
                    if monitor in ready and await self._monitor(monitor):
                        if self._held:
                            await self._retry()
                        else:
                            await self._flush()
                            await self._sync()  # before this connection's frames: a restart shows here first
                    frames = await self._drain(sub) if sub in ready else []
                    if frames:
                        self._last_activity = time.monotonic()
                        for seq, payload in frames:
                            await self._one(seq, payload)
                        await self._flush()
                    elif time.monotonic() - self._last_activity >= self.idle_sync_s:
                        self._last_activity = time.monotonic()
                        need_sync = bool(self.spec.replay_endpoint) and self.connected
                except KVServiceError as exc:  # e.g. persistence down under --require-persistence
                    logger.warning("external pool %s: ingest refused (%s); catching up by replay later",
                                   self.spec.pool_id, exc)
                    self._pending, self._pending_reset = [], ResetKind.NONE
                    self._held, self._stalled_since = [], None
                    await asyncio.sleep(1.0)
                    need_sync = True
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _monitor(self, monitor) -> bool:
        """Reads connection events; True when a (re)connection asks for a catch-up."""
        reconnected = False
        while await monitor.poll(0):
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event & _CONNECT_EVENTS:
                self.connected = reconnected = True
                self._live_last = None  # a new connection: its stream starts wherever the publisher is
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
        return reconnected

    @staticmethod
    async def _drain(sub) -> list[tuple[int, bytes]]:
        out = []
        while len(out) < 4 * MAX_FRAMES_PER_COMMAND:
            try:
                parts = await sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                _, seq, payload = decode_pub_frame(parts)
            except FrameError as exc:
                logger.error("dropped a frame that is not a vLLM KV-event frame: %s", exc)
                continue
            out.append((seq, payload))
        return out

    # ---- ordering --------------------------------------------------------------------------------
    def _position(self) -> int:
        """The last sequence, counting what is pending (-1: none, or a reset is pending)."""
        if self._pending:
            return self._pending[-1][0]
        if self._pending_reset is not ResetKind.NONE:
            return -1
        pool = self.view()
        return pool.last_sequence if pool is not None else -1

    async def _one(self, seq: int, payload: bytes) -> None:
        # The live stream of one connection is in order: it going back means a restarted publisher. A live
        # batch at or before the applied position otherwise is a late copy of one a replay brought.
        went_back = self._live_last is not None and seq <= self._live_last
        self._live_last = seq
        await self._order(seq, payload, went_back)

    async def _order(self, seq: int, payload: bytes, went_back: bool, replay: bool = True) -> None:
        if self._held:  # behind a gap that waits for the replay: keep the live order
            self._held.append((seq, payload, went_back))
            if len(self._held) > MAX_HELD:
                await self._give_up()
            return
        last = self._position()
        if seq == last + 1:  # (a pool that has applied nothing starts at batch 0, as every publisher does)
            self._accept(seq, payload)
            if len(self._pending) >= MAX_FRAMES_PER_COMMAND:
                await self._flush()
            return
        if seq <= last and not went_back:
            return
        restarted = seq <= last
        if not restarted and replay and self._stalled_since is None:  # (a held gap asked again is not a new one)
            self.gaps += 1
        await self._flush()
        self._counting_gap = True
        try:
            synced = replay and bool(self.spec.replay_endpoint) and await self._sync()
        finally:
            self._counting_gap = False
        if synced:
            last = self._position()
            if seq <= last:
                return  # the replay brought it
            if seq == last + 1:
                self._accept(seq, payload)
                return
            if last < 0:  # an empty buffer: the batches before this one are gone
                self._lost_start(seq)
                self._pending_reset = ResetKind.RESYNC
                self._accept(seq, payload)
                return
        if replay and self.spec.replay_endpoint:
            # The replay did not settle it (no answer in time, or it stopped short): dropping the index now
            # would lose every block the engine still holds while its buffer may well have the batches.
            self._hold(seq, payload, went_back)
            return
        if replay:  # no replay socket to wait for (`_give_up` says why it stopped waiting)
            logger.warning("external pool %s: %s at batch %d (%s) and no replay socket", self.spec.pool_id,
                           "the publisher restarted" if restarted else "a sequence gap", seq,
                           f"last applied {last}" if last >= 0 else "the first batch received")
        self._pending_reset = ResetKind.RESTART if restarted else ResetKind.RESYNC
        self._accept(seq, payload)

    def _lost_start(self, first: int) -> None:
        """Nothing was applied and the publisher's replay buffer holds nothing before batch `first`: what it
        published before is unknown, so indexing from there is a resync (counted by the reset, logged here)."""
        logger.warning("external pool %s: batches 0..%d are not in the publisher's replay buffer any more: "
                       "indexing from batch %d on (a resync: what the engine cached before is unknown)",
                       self.spec.pool_id, first - 1, first)

    def _accept(self, seq: int, payload: bytes) -> None:
        self._pending.append((seq, payload))

    # ---- gaps waiting for the replay -------------------------------------------------------------
    def _hold(self, seq: int, payload: bytes, went_back: bool) -> None:
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
            logger.warning("external pool %s: batch %d is past a gap (last applied %d) the replay has not filled "
                           "yet; holding the stream and asking again", self.spec.pool_id, seq, self._position())
        self._held.append((seq, payload, went_back))
        self._next_retry = now + self.retry_s

    async def _retry(self) -> None:
        """Asks the replay again for the gap before the held frames; gives up after `resync_after_s`."""
        held, self._held = self._held, []
        before = self._position()
        self._counting_gap = True  # counted when it was found
        try:
            synced = await self._sync()
        finally:
            self._counting_gap = False
        if synced:
            for seq, payload, went_back in held:
                await self._order(seq, payload, went_back)
            await self._flush()
            if not self._held:
                logger.info("external pool %s: the gap is filled; %d held batches applied, up to batch %d",
                            self.spec.pool_id, len(held), self._position())
                self._stalled_since = None
                return
            if self._position() > before:
                self._stalled_since = time.monotonic()  # progress: what is still held starts a new wait
                return
        else:
            self._held = held
            self._next_retry = time.monotonic() + self.retry_s
        # No progress (the replay did not answer, or answered without the gap): the wait has a bound.
        if time.monotonic() - (self._stalled_since or 0.0) >= self.resync_after_s:
            await self._give_up()

    async def _give_up(self) -> None:
        """The replay never filled the gap: what follows it applies as a gap without replay would (a resync)."""
        held, self._held, self._stalled_since = self._held, [], None
        logger.warning("external pool %s: no replay filled the gap after batch %d within the bound (%d batches held):"
                       " dropping the index and rebuilding it from the held batches", self.spec.pool_id,
                       self._position(), len(held))
        for seq, payload, went_back in held:
            await self._order(seq, payload, went_back, replay=False)
        await self._flush()

    async def _flush(self) -> None:
        if not self._pending and self._pending_reset is ResetKind.NONE:
            return
        frames, reset = self._pending, self._pending_reset
        self._pending, self._pending_reset = [], ResetKind.NONE
        await self._submit(frames, reset)

    async def _submit(self, frames: list[tuple[int, bytes]], reset: ResetKind = ResetKind.NONE) -> None:
        if not frames and reset is ResetKind.NONE:
            return
        for i in range(0, max(len(frames), 1), MAX_FRAMES_PER_COMMAND):
            await self.submit(IngestEvents(self.spec.pool_id, self.registration,
                                           frames[i:i + MAX_FRAMES_PER_COMMAND], reset if i == 0 else 0))

    # ---- replay ----------------------------------------------------------------------------------
    async def _sync(self) -> bool:
        """Catches up through the replay socket (nothing pending); True when it settled the position."""
        pool = self.view()
        if not self.spec.replay_endpoint or pool is None:
            return False
        last, digest = pool.last_sequence, pool.last_digest
        replayed = await self._replay(max(last, 0))
        if replayed is None:
            return False
        if last < 0:  # nothing applied yet: the stream from its start, as far as the buffer still reaches
            if replayed and replayed[0][0] > 0:
                self._lost_start(replayed[0][0])
                await self._submit(replayed, ResetKind.RESYNC)
            else:
                self._count_missed(replayed)
                await self._submit(replayed)
            return True
        first = replayed[0][0] if replayed else None
        if first == last and payload_digest(replayed[0][1]) == digest:
            self._count_missed(replayed[1:])
            await self._submit(replayed[1:])  # the same publisher: what came after us
        elif first == last + 1:
            self._count_missed(replayed)
            await self._submit(replayed)  # our last batch left its buffer, but nothing is missing
        elif first is None or first == last:
            # Nothing at or after our position, or another batch under our last number: it restarted.
            logger.warning("external pool %s: the publisher restarted (its replay disagrees with batch %d)",
                           self.spec.pool_id, last)
            again = await self._replay(0)
            await self._submit(again or [], ResetKind.RESTART)
        else:
            logger.warning("external pool %s: batches %d..%d are gone from the publisher's replay buffer: "
                           "resyncing from what it still holds", self.spec.pool_id, last + 1, first - 1)
            await self._submit(replayed, ResetKind.RESYNC)
        return True

    def _count_missed(self, frames: Frames) -> None:
        """A catch-up that found batches the live stream had not delivered: a gap (unless `_one` counted it)."""
        if not frames:
            return
        if not self._counting_gap:
            self.gaps += 1
        logger.info("external pool %s: batches %d..%d applied from the replay socket (the live stream skipped "
                    "some)", self.spec.pool_id, frames[0][0], frames[-1][0])

    async def _replay(self, start: int) -> Frames | None:
        """The publisher's buffered batches from `start` on, up to the first number its buffer lacks; None when
        it did not answer in time."""
        try:
            frames = await fetch_replay(self.context, self.spec.replay_endpoint, start, self.replay_timeout_s)
        except FrameError as exc:
            self.replay_failures += 1
            logger.error("external pool %s: bad replay frame: %s", self.spec.pool_id, exc)
            return None
        if frames is None:
            self.replay_failures += 1
            logger.warning("external pool %s: no replay from %s within %.1f s", self.spec.pool_id,
                           self.spec.replay_endpoint, self.replay_timeout_s)
            return None
        self.replays += 1
        frames, hole = consecutive(frames)
        if hole is not None and hole != self._hole:
            logger.warning("external pool %s: the replay from batch %d has batch %d after %d (vLLM buffers no batch "
                           "whose send failed): it applies up to there, the rest waits for the gap to fill or the "
                           "resync bound", self.spec.pool_id, start, hole[1], hole[0] - 1)
        self._hole = hole
        return frames
