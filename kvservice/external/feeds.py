"""The allocator's subscriptions, one running Feed (subscriber.py) per external pool registration: started
for a new one, stopped for a removed or replaced one, restarted after a failure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import zmq.asyncio

from kvservice.commands import IngestEvents
from kvservice.external.pool import ExternalPool
from kvservice.external.subscriber import Feed

logger = logging.getLogger(__name__)


class Feeds:
    """Keeps one running Feed per external pool registration in the allocator's state."""

    def __init__(self, pools: Callable[[], dict[str, ExternalPool]], submit: Callable[[IngestEvents], Awaitable],
                 **feed_options) -> None:
        self.pools = pools  # the allocator's external pools now (a recovery replaces the dict)
        self.submit = submit
        self.feed_options = feed_options
        self.context = zmq.asyncio.Context()
        self.feeds: dict[str, tuple[Feed, asyncio.Task]] = {}

    def sync(self) -> None:
        """Starts a subscription for each new registration, stops those of removed or replaced pools."""
        pools = self.pools()
        for pool_id, (feed, task) in list(self.feeds.items()):
            pool = pools.get(pool_id)
            if pool is None or pool.registration != feed.registration:
                task.cancel()
                del self.feeds[pool_id]
        for pool_id, pool in pools.items():
            if pool_id not in self.feeds:
                feed = Feed(pool.spec, pool.registration, self._viewer(pool_id, pool.registration),
                            self.submit, self.context, **self.feed_options)
                self.feeds[pool_id] = (feed, asyncio.get_running_loop().create_task(self._run(feed)))

    def _viewer(self, pool_id: str, registration: int):
        def view() -> ExternalPool | None:
            pool = self.pools().get(pool_id)
            return pool if pool is not None and pool.registration == registration else None
        return view

    @staticmethod
    async def _run(feed: Feed) -> None:
        while True:
            try:
                await feed.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("external pool %s: subscription failed; restarting it", feed.spec.pool_id)
                await asyncio.sleep(1.0)

    def feed(self, pool_id: str) -> Feed | None:
        entry = self.feeds.get(pool_id)
        return entry[0] if entry is not None else None

    async def stop(self) -> None:
        for _, task in self.feeds.values():
            task.cancel()
        for _, task in self.feeds.values():
            with contextlib.suppress(BaseException):
                await task
        self.feeds.clear()
        self.context.term()
