"""Fleet membership: the backends (flags, or a file re-read when it changes), each engine health-checked
(`/health`) and its load scraped (`/metrics`) every interval, a dead engine ejected (a refused connection at
once, failed checks after `eject_after` in a row) and readmitted after `readmit_after` good checks."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

import aiohttp

from kvservice.router.backends import Backend, read_backends_file
from kvservice.router.background import Background
from kvservice.router.metrics import RouterMetrics
from kvservice.router.scoring import Load
from kvservice.router.settings import RouterSettings

logger = logging.getLogger(__name__)
LOAD_SERIES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
               "vllm:kv_cache_usage_perc": "kv_usage"}


@dataclass(slots=True)
class Engine:
    backend: Backend
    up: bool = False
    seen: bool = False  # answered a health check once (a new engine is admitted at its first good check)
    failures: int = 0  # health checks failed in a row
    successes: int = 0  # good ones in a row, while ejected
    load: Load = field(default_factory=Load)
    inflight: int = 0  # requests this router has on it now
    inflight_at_scrape: int = 0
    models: dict[str, int | None] = field(default_factory=dict)  # served model -> its max_model_len
    root: str | None = None  # the model dir its /v1/models names

    def current_load(self) -> Load:
        """Its scraped load, plus what this router sent it since the scrape (not in those numbers yet)."""
        extra = max(0, self.inflight - self.inflight_at_scrape)
        return Load(self.load.running, self.load.waiting + extra, self.load.kv_usage)


def parse_load(text: str) -> Load:
    """vLLM's load gauges, summed over its engines' samples (usage: their mean)."""
    sums = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    usage_samples = 0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        what = LOAD_SERIES.get(name)
        if what is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        sums[what] += value
        usage_samples += what == "kv_usage"
    return Load(sums["running"], sums["waiting"], sums["kv_usage"] / max(1, usage_samples))


class Fleet(Background):
    def __init__(self, settings: RouterSettings, session: aiohttp.ClientSession, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.session = session
        self.metrics = metrics
        self.engines: dict[str, Engine] = {}
        self._file_stamp: tuple | None = None
        self.on_change = None  # called with the new backends (external pools to register)
        self.set_backends(list(settings.backends))
        if settings.backends_file:
            self.reload_file()

    # ---- membership ------------------------------------------------------------------------------
    def set_backends(self, backends: list[Backend]) -> None:
        wanted = {b.name: b for b in backends}
        for name in list(self.engines):
            if name not in wanted:
                logger.info("kvservice route: backend %s removed", name)
                del self.engines[name]
                self.metrics.forget_engine(name)
        for name, backend in wanted.items():
            engine = self.engines.get(name)
            if engine is None:
                logger.info("kvservice route: backend %s at %s (pool %s, role %s)", name, backend.url, backend.pool,
                            backend.role)
                self.engines[name] = Engine(backend)
                self.metrics.add_engine(name)
            elif engine.backend != backend:
                same_place = engine.backend.url == backend.url
                self.engines[name] = Engine(backend, up=engine.up and same_place, seen=engine.seen and same_place)
        if self.on_change is not None:
            self.on_change(backends)

    def reload_file(self) -> bool:
        """Re-reads the backends file when it changed (mtime, size); a file that does not parse keeps the
        fleet as it was (logged, counted)."""
        path = self.settings.backends_file
        try:
            st = os.stat(path)
        except OSError as exc:
            if self._file_stamp != ("missing",):
                logger.error("kvservice route: backends file %s: %s; the fleet stays as it is", path, exc)
                self.metrics.backends_file_errors.inc()
                self._file_stamp = ("missing",)
            return False
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._file_stamp:
            return False
        self._file_stamp = stamp
        try:
            backends = read_backends_file(path)
        except Exception as exc:  # noqa: BLE001 - an operator's typo must not empty the fleet
            logger.error("kvservice route: backends file %s: %s; the fleet stays as it is", path, exc)
            self.metrics.backends_file_errors.inc()
            return False
        self.set_backends(list(self.settings.backends) + backends)
        self.metrics.backends_file_reloads.inc()
        return True

    # ---- state -----------------------------------------------------------------------------------
    def up(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.up]

    def serving(self, model: str | None) -> list[Engine]:
        """Engines up that serve `model` (None: any); an engine whose models are not known yet serves all."""
        return [e for e in self.up() if model is None or not e.models or model in e.models]

    def served_models(self) -> list[str]:
        return sorted({m for e in self.engines.values() for m in e.models})

    def max_model_len(self, model: str | None) -> int | None:
        lens = [n for e in self.serving(model) for m, n in e.models.items() if n and (model is None or m == model)]
        return min(lens) if lens else None

    def eject(self, engine: Engine, why: str) -> None:
        if engine.up:
            engine.up = False
            engine.successes = 0
            logger.warning("kvservice route: engine %s ejected (%s)", engine.backend.name, why)
            self.metrics.ejections.labels(engine.backend.name).inc()
            self.metrics.engine_up.labels(engine.backend.name).set(0)

    def admit(self, engine: Engine) -> None:
        if not engine.up:
            if engine.seen:
                logger.info("kvservice route: engine %s readmitted", engine.backend.name)
                self.metrics.readmissions.labels(engine.backend.name).inc()
            engine.up, engine.seen, engine.failures = True, True, 0
            self.metrics.engine_up.labels(engine.backend.name).set(1)

    # ---- the checks ------------------------------------------------------------------------------
    async def check(self, engine: Engine) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
        url = engine.backend.url
        try:
            async with self.session.get(url + "/health", timeout=timeout) as reply:
                ok = reply.status == 200
                await reply.read()
            if ok:
                async with self.session.get(url + "/metrics", timeout=timeout) as reply:
                    if reply.status == 200:
                        engine.load = parse_load(await reply.text())
                        engine.inflight_at_scrape = engine.inflight
                if not engine.models or not engine.up:
                    await self._models(engine, timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok = False
            why = f"{type(exc).__name__}: {exc}"
        else:
            why = "its /health did not answer 200"
        if ok:
            engine.failures = 0
            engine.successes += 1
            if not engine.up and (not engine.seen or engine.successes >= self.settings.readmit_after):
                self.admit(engine)
        else:
            engine.successes = 0
            engine.failures += 1
            if engine.failures >= self.settings.eject_after:
                self.eject(engine, why)

    async def _models(self, engine: Engine, timeout: aiohttp.ClientTimeout) -> None:
        key = self.settings.engine_api_key  # vLLM's --api-key guards /v1/*, not /health or /metrics
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with self.session.get(engine.backend.url + "/v1/models", timeout=timeout, headers=headers) as reply:
            if reply.status != 200:
                return
            data = await reply.json(content_type=None)
        cards = data.get("data", []) if isinstance(data, dict) else []
        engine.models = {c["id"]: c.get("max_model_len") for c in cards if isinstance(c, dict) and "id" in c}
        roots = [c.get("root") for c in cards if isinstance(c, dict) and c.get("root")]
        engine.root = roots[0] if roots else None

    async def check_all(self) -> None:
        if self.settings.backends_file:
            self.reload_file()
        engines = list(self.engines.values())
        await asyncio.gather(*(self.check(e) for e in engines))

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the checks go on whatever one round met
                logger.exception("kvservice route: a health-check round failed")
            await asyncio.sleep(max(0.0, self.settings.health_interval_s - (time.monotonic() - started)))
