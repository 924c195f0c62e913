"""Forwarding one request to the engines in the decision's order: an engine that refuses the connection (or
drops it) before any byte of its reply is ejected and the next one is tried; once its reply starts, the
status, headers and body pass through as they come (SSE chunks unbuffered), and the usage's cached tokens
are read on the way."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvservice.router import errors
from kvservice.router.fleet import Engine, Fleet
from kvservice.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}
MAX_TAPPED_BYTES = 16 << 20  # a non-streamed reply's body is parsed for its usage up to this size
# Failures before any byte of the engine's reply: the request may go to another engine. (A read timeout is not
# one: the engine may be computing it still.)
RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
             getattr(aiohttp, "ConnectionTimeoutError", aiohttp.ClientConnectorError))


def usage_cached_tokens(obj) -> int | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


class UsageTap:
    """`usage.prompt_tokens_details.cached_tokens` of a reply as it passes: a JSON body's, or the SSE stream's
    usage chunk (`stream_options.include_usage`)."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.cached_tokens: int | None = None
        self._data = bytearray()

    def feed(self, chunk: bytes) -> None:
        if not self.sse:
            if len(self._data) < MAX_TAPPED_BYTES:
                self._data += chunk
            return
        data = bytes(self._data) + chunk if self._data else chunk
        end = data.rfind(b"\n")
        if end >= 0 and b"cached_tokens" in data[:end]:
            for line in data[:end].split(b"\n"):
                if line.startswith(b"data:") and b"cached_tokens" in line:
                    try:
                        found = usage_cached_tokens(json.loads(line[5:]))
                    except ValueError:
                        continue
                    if found is not None:
                        self.cached_tokens = found
        rest = data[end + 1:] if end >= 0 else data
        self._data = bytearray(rest[-MAX_TAPPED_BYTES:])

    def finish(self) -> int | None:
        if not self.sse and self._data and b"cached_tokens" in self._data:
            try:
                self.cached_tokens = usage_cached_tokens(json.loads(bytes(self._data)))
            except ValueError:
                pass
        return self.cached_tokens


def forward_headers(request: web.Request, engine_api_key: str | None) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    if engine_api_key:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        headers["Authorization"] = f"Bearer {engine_api_key}"
    return headers


@dataclass(slots=True)
class Sent:
    engine: str
    status: int
    cached_tokens: int | None
    response: web.StreamResponse
    first_chunk_at: float | None = None  # time.perf_counter() when the reply's first body bytes came


async def post_in_order(fleet: Fleet, metrics: RouterMetrics, session: aiohttp.ClientSession, order: list[str],
                        path: str, body: bytes, headers: dict, max_retries: int,
                        timeout: aiohttp.ClientTimeout) -> tuple[Engine, aiohttp.ClientResponse]:
    """POSTs to the first engine of `order` that answers (its reply's headers arrived), trying at most
    1 + max_retries of them. Raises RouterError when none does."""
    last: BaseException | None = None
    tried = 0
    for name in order:
        engine = fleet.engines.get(name)
        if engine is None or not engine.up:
            continue
        if tried > max_retries:
            break
        tried += 1
        engine.inflight += 1
        metrics.inflight.labels(name).set(engine.inflight)
        try:
            reply = await session.post(engine.backend.url + path, data=body, headers=headers, timeout=timeout)
        except RETRYABLE as exc:
            engine.inflight -= 1
            metrics.inflight.labels(name).set(engine.inflight)
            refused = isinstance(exc, aiohttp.ClientConnectorError)
            fleet.eject(engine, f"{'refused the connection' if refused else 'dropped it'}: {exc}")
            metrics.retries.labels(name, "refused" if refused else "disconnected").inc()
            last = exc
            logger.warning("kvservice route: engine %s failed before answering (%s); trying the next", name, exc)
            continue
        except BaseException as exc:
            engine.inflight -= 1
            metrics.inflight.labels(name).set(engine.inflight)
            if isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError)):
                raise errors.engine_failed(name, exc) from exc
            raise
        return engine, reply
    if last is None:
        raise errors.no_engine(None)
    raise errors.RouterError(503, f"No engine could take the request: the last one tried failed with "
                                  f"{type(last).__name__}: {last}", "ServiceUnavailableError")


async def relay(request: web.Request, metrics: RouterMetrics, engine: Engine, reply: aiohttp.ClientResponse,
                extra_headers: dict[str, str], sse: bool) -> Sent:
    """Passes the engine's reply through: status, headers and each chunk as it arrives. A client gone mid-way
    closes the engine's connection (vLLM aborts the request)."""
    name = engine.backend.name
    tap = UsageTap(sse or reply.headers.get("content-type", "").startswith("text/event-stream"))
    try:
        headers = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_BY_HOP}
        headers.update(extra_headers)
        response = web.StreamResponse(status=reply.status, reason=reply.reason, headers=headers)
        if reply.content_length is not None and "chunked" not in reply.headers.get("transfer-encoding", ""):
            response.content_length = reply.content_length
        await response.prepare(request)
        first = None
        async for chunk in reply.content.iter_any():
            if first is None:
                first = time.perf_counter()
            tap.feed(chunk)
            await response.write(chunk)
        await response.write_eof()
    except BaseException:
        reply.close()
        raise
    else:
        reply.release()
    finally:
        engine.inflight -= 1
        metrics.inflight.labels(name).set(engine.inflight)
    return Sent(name, reply.status, tap.finish(), response, first)
