"""`kvservice route`: an OpenAI-compatible front door for a fleet of stock vLLM servers.

    router = Router(RouterSettings(backends=[parse_backend("e0=http://10.0.0.1:8000,pool=e0")]))
    await router.start()          # listens; router.url
    ...
    await router.stop()

`/v1/completions` and `/v1/chat/completions` (streamed or not) go to the engine the policy picks, unchanged,
with `x-kvservice-engine` and `x-kvservice-predicted-cached-tokens` on the reply; `/v1/models` merges the
engines' models; `/health` is 200 while an engine is up; `/metrics` is the router's; `POST /v1/route` answers
the decision alone (what a request would do); other `/v1/*`, `/tokenize` and `/detokenize` calls go to the least
loaded engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvservice.router import errors, pd
from kvservice.router.decide import Decider, Decision
from kvservice.router.fleet import Fleet
from kvservice.router.metrics import RouterMetrics
from kvservice.router.prompts import Tokenizers, prompt_ids
from kvservice.router.proxy import forward_headers, post_in_order, relay
from kvservice.router.registration import Registrar
from kvservice.router.settings import RouterSettings
from kvservice.router.tenants import Tenants, Unauthorized

logger = logging.getLogger(__name__)
ENGINE_HEADER = "x-kvservice-engine"
PREDICTED_HEADER = "x-kvservice-predicted-cached-tokens"
PREFILL_HEADER = "x-kvservice-prefill-engine"
KINDS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self.metrics.decision.labels(settings.policy)
        self.tokenizers = Tokenizers(settings.tokenizer)
        self.session: aiohttp.ClientSession | None = None
        self.fleet: Fleet | None = None
        self.tenants: Tenants | None = None
        self.decider: Decider | None = None
        self.registrar: Registrar | None = None
        self.runner: web.AppRunner | None = None
        self._preload: asyncio.Task | None = None
        self.url = ""
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=settings.request_timeout_s)
        self.app = web.Application(client_max_size=settings.max_body_bytes)
        self.app.router.add_post("/v1/completions", self.generate)
        self.app.router.add_post("/v1/chat/completions", self.generate)
        self.app.router.add_post("/v1/route", self.route_only)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.prometheus)
        for path in ("/tokenize", "/detokenize", "/v1/{tail:.*}"):
            self.app.router.add_route("*", path, self.other)

    async def start(self) -> str:
        """Connects to the allocator, checks every engine once, then listens. Returns the router's URL."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.tenants = Tenants(self.settings)
        self.fleet = Fleet(self.settings, self.session, self.metrics)
        self.registrar = Registrar(self.settings, self.tenants)
        self.fleet.on_change = self.registrar.wanted
        self.registrar.wanted(list(self.fleet.engines[n].backend for n in self.fleet.engines))
        self.decider = Decider(self.settings, self.fleet, self.tenants, self.metrics)
        await self.fleet.check_all()
        roots = {e.root for e in self.fleet.up() if e.root}
        for root in sorted(roots)[:1] or [None]:  # loaded before the first text request needs it
            self._preload = asyncio.get_running_loop().create_task(self.tokenizers.get(root))
        self.fleet.start()
        self.registrar.start()
        self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.settings.host, self.settings.port, backlog=1024)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port 0 picked
        self.url = f"http://{self.settings.host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._preload is not None and not self._preload.done():
            self._preload.cancel()
        if self.runner is not None:
            await self.runner.cleanup()
        for part in (self.registrar, self.fleet):
            if part is not None:
                await part.stop()
        if self.tenants is not None:
            await self.tenants.close()
        if self.session is not None:
            await self.session.close()

    # ---- the decision ------------------------------------------------------------------------------
    async def _decide(self, request: web.Request, kind: str) -> tuple[dict, Decision]:
        """Parses and checks the request, then decides. Raises RouterError (answered as vLLM would)."""
        token = self.tenants.allocator_token(request.headers.get("Authorization"))
        raw = await request.read()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise errors.invalid_json(exc) from None
        if not isinstance(body, dict):
            body = {}  # the engine says what is wrong with it
        model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else None
        served = self.fleet.served_models()
        if model is not None and served and model not in served:
            raise errors.unknown_model(model, served)
        serving = self.fleet.serving(model)
        tokens = await prompt_ids(kind, body, lambda: self.tokenizers.get(serving[0].root if serving else None))
        max_len = self.fleet.max_model_len(model)
        if tokens is not None and max_len and len(tokens) > max_len:
            raise errors.prompt_too_long(len(tokens), max_len)
        user = body.get("user") if isinstance(body.get("user"), str) else None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        decision = await self.decider.decide(tokens, model, token, user or request.headers.get(
            self.settings.session_header), salt)
        if not decision.order:
            raise errors.no_engine(model)
        return body, decision

    async def route_only(self, request: web.Request) -> web.Response:
        try:
            body, d = await self._decide(request, "chat" if "messages" in await self._peek(request) else "completions")
        except errors.RouterError as exc:
            return exc.response()
        except Unauthorized:
            return errors.unauthorized()
        return web.json_response({
            "engine": d.order[0], "order": d.order, "prefill_order": d.prefill_order,
            "prefill_skipped": d.prefill_skipped, "prompt_tokens": d.prompt_tokens, "prompt_token_ids": d.tokens,
            "lookup_ok": d.lookup_ok,
            "predicted_cached_tokens": d.predicted.get(d.order[0], 0), "hits": d.hits,
            "estimates": {n: {"ttft_s": e.ttft_s, "cached_tokens": e.cached_tokens, "engine_tokens": e.engine_tokens,
                              "loaded_tokens": e.loaded_tokens, "load_from": e.load_from, "load_s": e.load_s,
                              "compute_s": e.compute_s, "queue_s": e.queue_s} for n, e in d.estimates.items()}})

    @staticmethod
    async def _peek(request: web.Request) -> dict:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    # ---- generation --------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        policy, endpoint = self.settings.policy, KINDS[request.path]
        try:
            body, decision = await self._decide(request, endpoint)
        except errors.RouterError as exc:
            self.metrics.requests.labels("none", policy, endpoint, str(exc.status)).inc()
            return exc.response()
        except Unauthorized:
            self.metrics.requests.labels("none", policy, endpoint, "401").inc()
            return errors.unauthorized()
        self.metrics.decision.labels(policy).observe(time.perf_counter() - started)
        headers = forward_headers(request, self.settings.engine_api_key)
        data = await request.read()
        extra = {}
        if decision.prefill_order:
            producer, params = await pd.prefill(self.fleet, self.metrics, self.session, decision.prefill_order,
                                                request.path, body, headers, self.settings.max_retries, self.timeout)
            extra[PREFILL_HEADER] = producer
            if params is not None:
                data = pd.decode_body(body, params)
        elif decision.prefill_skipped:
            self.metrics.prefills.labels("skipped").inc()
        try:
            engine, reply = await post_in_order(self.fleet, self.metrics, self.session, decision.order, request.path,
                                                data, headers, self.settings.max_retries, self.timeout)
        except errors.RouterError as exc:
            self.metrics.requests.labels("none", policy, endpoint, str(exc.status)).inc()
            return exc.response()
        name = engine.backend.name
        predicted = decision.predicted.get(name, 0)
        extra.update({ENGINE_HEADER: name, PREDICTED_HEADER: str(predicted)})
        try:
            sent = await relay(request, self.metrics, engine, reply, extra, bool(body.get("stream")))
        except BaseException:
            self.metrics.requests.labels(name, policy, endpoint, "cut").inc()  # the engine or the client went away
            raise
        self.metrics.requests.labels(name, policy, endpoint, str(sent.status)).inc()
        if sent.status == 200:
            if body.get("stream") and sent.first_chunk_at is not None and not decision.prefill_order:
                self.decider.observe(name, decision, sent.first_chunk_at - started)
            self.metrics.predicted.labels(name).inc(predicted)
            if sent.cached_tokens is not None:
                self.metrics.realized.labels(name).inc(sent.cached_tokens)
                self.metrics.realized_predicted.labels(name).inc(predicted)
                self.metrics.prediction_error.observe(abs(sent.cached_tokens - predicted))
        return sent.response

    # ---- the rest ----------------------------------------------------------------------------------
    def _refused(self, request: web.Request) -> web.Response | None:
        """With tenants, /v1/* wants a known bearer token (as vLLM's --api-key does)."""
        try:
            self.tenants.allocator_token(request.headers.get("Authorization"))
        except Unauthorized:
            return errors.unauthorized()
        return None

    async def models(self, request: web.Request) -> web.Response:
        refused = self._refused(request)
        if refused is not None:
            return refused

        async def fetch(engine):
            try:
                async with self.session.get(engine.backend.url + "/v1/models", headers=forward_headers(
                        request, self.settings.engine_api_key), timeout=aiohttp.ClientTimeout(total=10)) as reply:
                    return await reply.json(content_type=None) if reply.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None

        cards: dict[str, dict] = {}
        for answer in await asyncio.gather(*(fetch(e) for e in self.fleet.up())):
            for card in (answer or {}).get("data", []):
                if isinstance(card, dict) and "id" in card:
                    cards.setdefault(card["id"], card)
        if not cards and not self.fleet.up():
            return errors.no_engine(None).response()
        return web.json_response({"object": "list", "data": list(cards.values())})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.fleet.up() else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def other(self, request: web.Request) -> web.StreamResponse:
        """Any other call, unchanged, to the least loaded engine up."""
        refused = self._refused(request) if request.path.startswith("/v1/") else None
        if refused is not None:
            return refused
        up = sorted(self.fleet.up(), key=lambda e: (e.current_load().waiting, e.current_load().running, e.inflight))
        if not up:
            return errors.no_engine(None).response()
        engine = up[0]
        engine.inflight += 1
        try:
            reply = await self.session.request(request.method, engine.backend.url + request.path_qs,
                                               data=await request.read(), timeout=self.timeout,
                                               headers=forward_headers(request, self.settings.engine_api_key))
        except aiohttp.ClientError as exc:
            engine.inflight -= 1
            return errors.engine_failed(engine.backend.name, exc).response()
        sent = await relay(request, self.metrics, engine, reply, {ENGINE_HEADER: engine.backend.name}, False)
        return sent.response
