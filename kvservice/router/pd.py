"""Prefill/decode disaggregation through kvservice's connector: the prompt is prefilled on a `kv_producer`
(`max_tokens=1`, not streamed), whose reply names its save in `kv_transfer_params`
(`{"kvservice": {"pool_id", "num_tokens"}}`); the request then goes to the `kv_consumer` with those params,
which loads the producer's blocks and decodes. A producer that fails or names no save leaves the consumer to
compute the prompt itself: the request still succeeds."""

from __future__ import annotations

import json
import logging

import aiohttp

from kvservice.router.errors import RouterError
from kvservice.router.fleet import Fleet
from kvservice.router.metrics import RouterMetrics
from kvservice.router.proxy import post_in_order

logger = logging.getLogger(__name__)


def prefill_body(body: dict) -> dict:
    """The prefill step's request: one token, one sample, no stream."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "kv_transfer_params")}
    out.update(max_tokens=1, stream=False, n=1)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


async def prefill(fleet: Fleet, metrics: RouterMetrics, session: aiohttp.ClientSession, order: list[str], path: str,
                  body: dict, headers: dict, max_retries: int,
                  timeout: aiohttp.ClientTimeout) -> tuple[str, dict | None]:
    """Runs the prefill step on the first producer of `order` that answers: (its name, its
    kv_transfer_params or None)."""
    try:
        engine, reply = await post_in_order(fleet, metrics, session, order, path,
                                            json.dumps(prefill_body(body)).encode(), headers, max_retries, timeout)
    except RouterError as exc:
        metrics.prefills.labels("failed").inc()
        logger.warning("kvservice route: no producer took the prefill (%s); the consumer computes the prompt",
                       exc.message)
        return "", None
    name = engine.backend.name
    try:
        data = await reply.json(content_type=None) if reply.status == 200 else None
    except (ValueError, aiohttp.ClientError) as exc:
        logger.warning("kvservice route: producer %s: unreadable reply (%s)", name, exc)
        data = None
    finally:
        reply.release()
        engine.inflight -= 1
        metrics.inflight.labels(name).set(engine.inflight)
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if reply.status != 200:
        metrics.prefills.labels("failed").inc()
        logger.warning("kvservice route: producer %s answered the prefill with %d; the consumer computes the prompt",
                       name, reply.status)
    elif not isinstance(params, dict):
        metrics.prefills.labels("no_params").inc()
        params = None
    else:
        metrics.prefills.labels("handed_over").inc()
    return name, params


def decode_body(body: dict, params: dict) -> bytes:
    return json.dumps({**body, "kv_transfer_params": params}).encode()
