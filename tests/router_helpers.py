"""The router's tests' set-up: an event loop in a thread hosting stub engines (tests/router_stub.py) and the
router itself (kvservice.router.Router, the documented entry point), beside a real `kvservice serve`."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import aiohttp

from kvservice.ops import AddRequestOp, AllocateOp, FreeOp
from kvservice.router import Router, RouterSettings, parse_backend
from tests.router_stub import StubServer, StubState
from tests.service_helpers import small_config

BLOCK = 16  # the allocator's default hash block size


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn, *args):
        """`fn(*args)` on the loop's thread (state the loop's tasks read)."""
        async def go():
            return fn(*args)
        return self.run(go())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)


async def http(method: str, url: str, body=None, headers: dict | None = None, raw: bytes | None = None) -> Reply:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, data=data, headers=hdrs) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read())


def cache_prompt(client, pool_id: str, tokens: list[int], tag: str = "warm", salt: str | None = None) -> None:
    """Makes `pool_id` (a kvservice pool, registered if new) hold `tokens`' whole blocks cached (`salt`: under
    that cache salt, as the connector saves pages under its namespace)."""
    if pool_id not in client.get_stats().pools:
        client.register_pool(pool_id, small_config(256, BLOCK), max_model_len=4096)
    rid = f"{tag}-{pool_id}-{time.monotonic_ns()}"
    client.step(pool_id, [AddRequestOp(rid, token_ids=tokens, cache_salt=salt),
                          AllocateOp(rid, num_new_tokens=len(tokens)), FreeOp(rid)])


class Rig:
    """Stubs named e0.. and a router over them (`extra` backend options per stub, e.g. ",role=decode")."""

    def __init__(self, loop: LoopThread, allocator: str, names: list[str], extra: dict[str, str] | None = None,
                 **settings) -> None:
        self.loop = loop
        self.stubs = {n: StubServer(StubState(n)) for n in names}
        for stub in self.stubs.values():
            loop.run(stub.start())
        extra = extra or {}
        backends = [parse_backend(f"{n}={s.url},pool={n}{extra.get(n, '')}") for n, s in self.stubs.items()]
        settings.setdefault("health_interval_s", 0.2)
        settings.setdefault("block_size", BLOCK)
        self.settings = RouterSettings(port=0, allocator=allocator, backends=backends, **settings)
        self.router = Router(self.settings)
        self.url = loop.run(self.router.start())

    def post(self, path: str, body=None, headers: dict | None = None, raw: bytes | None = None) -> Reply:
        return self.loop.run(http("POST", self.url + path, body, headers, raw))

    def get(self, path: str) -> Reply:
        return self.loop.run(http("GET", self.url + path))

    def state(self, name: str) -> StubState:
        return self.stubs[name].state

    def wait(self, predicate, timeout_s: float = 10.0, what: str = "") -> None:
        """Until `predicate()` (called in this thread: it may read the router's state, or call it over HTTP)."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not within {timeout_s} s: {what}")
            time.sleep(0.05)

    def close(self) -> None:
        self.loop.run(self.router.stop())
        for stub in self.stubs.values():
            self.loop.run(stub.stop())


def metric(text: str, name: str, **labels) -> float:
    """A sample's value on a /metrics page (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0
