"""`kvservice route` alone, in front of stub engines (tests/router_stub.py) and a real `kvservice serve`: the
routing decision from the Lookup and the engines' load, replies passed through byte for byte (SSE unbuffered),
its headers, retries on a refused connection, and bad input answered in vLLM's error shape."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.router_helpers import BLOCK, LoopThread, Rig, cache_prompt, metric
from tests.service_helpers import start_server


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def allocator(tmp_path_factory):
    server = start_server(log_dir=tmp_path_factory.mktemp("alloc"))
    with server.client() as client:
        yield server, client
    server.stop()


@pytest.fixture
def rig(loop, allocator, request):
    names = getattr(request, "param", ["e0", "e1"])
    made = Rig(loop, allocator[0].target, names, policy="precise-stores")
    yield made
    made.close()


def prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


def test_a_prompt_goes_where_it_is_cached_and_the_headers_say_so(rig, allocator):
    _, client = allocator
    tokens = prompt(1)
    cache_prompt(client, "e1", tokens)
    reply = rig.post("/v1/completions", {"model": "m", "prompt": tokens, "max_tokens": 2})
    assert reply.status == 200 and reply.headers["x-kvservice-engine"] == "e1"
    assert reply.headers["x-kvservice-predicted-cached-tokens"] == str((len(tokens) - 1) // BLOCK * BLOCK)
    assert rig.state("e1").requests[-1] == {"model": "m", "prompt": tokens, "max_tokens": 2}
    decision = rig.post("/v1/route", {"model": "m", "prompt": tokens}).json()
    assert decision["engine"] == "e1" and decision["hits"]["e1"] == 96 and decision["lookup_ok"]
    assert decision["estimates"]["e1"]["ttft_s"] < decision["estimates"]["e0"]["ttft_s"]
    # a longer queue on e1 outweighs its cache: e1's 96 cached tokens save 96 / 5000 s, 3 waiting cost 0.6 s
    rig.loop.call(setattr, rig.state("e1"), "waiting", 3.0)
    rig.wait(lambda: rig.router.fleet.engines["e1"].load.waiting == 3.0, what="e1's load scraped")
    assert rig.post("/v1/completions", {"model": "m", "prompt": tokens}).headers["x-kvservice-engine"] == "e0"
    rig.loop.call(setattr, rig.state("e1"), "waiting", 0.0)


def test_store_tiers_count_with_the_connectors_namespace(loop, allocator):
    """Pools named as a store's tiers (kvstore:NODE, kvdisk:NODE) hold prompts under the connector's namespace;
    an engine on NODE is predicted to load them, one on another node to read them remotely."""
    server, client = allocator
    tokens = prompt(31, 300)
    cache_prompt(client, "kvstore:node-b", tokens[:200], salt="ns")  # another node's RAM
    cache_prompt(client, "kvdisk:node-a", tokens, salt="ns")  # node a's disk
    cache_prompt(client, "kvstore:node-a", tokens, tag="unsalted")  # not under the namespace: no hit
    rig = Rig(loop, server.target, ["s0", "s1"], {"s0": ",node=node-a", "s1": ",node=node-c"},
              store_namespace="ns", disk_gbps=100, remote_gbps=100)
    try:
        d = rig.post("/v1/route", {"prompt": tokens}).json()
        assert d["hits"]["kvstore:node-a"] == 0 and d["hits"]["kvdisk:node-a"] == 288
        s0, s1 = d["estimates"]["s0"], d["estimates"]["s1"]
        assert (s0["load_from"], s0["loaded_tokens"], s0["cached_tokens"]) == ("disk", 288, 288)
        assert (s1["load_from"], s1["loaded_tokens"], s1["cached_tokens"]) == ("remote", 192, 192)
        assert d["engine"] == "s0" and d["predicted_cached_tokens"] == 288
    finally:
        rig.close()


@pytest.mark.parametrize("calibrate", [True, False], ids=["calibrated", "settings"])
def test_slow_loads_measured_send_the_prompt_where_it_is_cached(loop, allocator, calibrate):
    """The settings say s0 loads the prompt from its node's RAM faster than s1 prefills what its own cache
    lacks; s0's replies say otherwise (0.3 s to the first token). After three streamed replies (the rate's
    samples; unstreamed ones teach nothing) the router sends the prompt to s1, unless --no-calibrate."""
    server, client = allocator
    tokens = prompt(41, 300)
    cache_prompt(client, "kvstore:node-a", tokens, salt="ns")
    cache_prompt(client, "s1", tokens[:200])
    rig = Rig(loop, server.target, ["s0", "s1"], {"s0": ",node=node-a", "s1": ",connector=false"},
              store_namespace="ns", calibrate=calibrate)
    try:
        rig.loop.call(setattr, rig.state("s0"), "first_chunk_delay_s", 0.3)
        d = rig.post("/v1/route", {"prompt": tokens}).json()
        assert d["engine"] == "s0" and d["estimates"]["s0"]["loaded_tokens"] == 288
        assert d["estimates"]["s1"]["engine_tokens"] == 192
        for _ in range(3):
            assert rig.post("/v1/completions", {"prompt": tokens}).headers["x-kvservice-engine"] == "s0"
        chosen = []
        for _ in range(4):
            reply = rig.post("/v1/completions", {"prompt": tokens, "stream": True})
            assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
            chosen.append(reply.headers["x-kvservice-engine"])
        learned = metric(rig.get("/metrics").body.decode(), "kvservice_router_seconds_per_token",
                         rate="ram")
        if calibrate:
            assert chosen == ["s0", "s0", "s0", "s1"], chosen
            assert 0.3 / 288 <= learned < 5.0 / 288  # the first token's wait (and the hops), over the tokens loaded
            d = rig.post("/v1/route", {"prompt": tokens}).json()
            assert d["estimates"]["s0"]["load_s"] == pytest.approx(288 * learned)
        else:
            assert chosen == ["s0"] * 4, chosen
            assert learned == pytest.approx(rig.settings.weights().load_seconds_per_token("ram"))  # the setting's
    finally:
        rig.close()


def test_cold_prompts_spread_by_their_first_block_and_stick(rig):
    chosen = {}
    for seed in range(12):
        tokens = prompt(100 + seed)
        first = rig.post("/v1/completions", {"prompt": tokens}).headers["x-kvservice-engine"]
        again = rig.post("/v1/completions", {"prompt": tokens + [5, 6]}).headers["x-kvservice-engine"]
        assert first == again
        chosen[seed] = first
    assert set(chosen.values()) == {"e0", "e1"}


def test_replies_pass_through_byte_for_byte(rig):
    rig.loop.call(setattr, rig.state("e0"), "cached_tokens", 48)
    rig.loop.call(setattr, rig.state("e1"), "cached_tokens", 48)
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {"model": "m", "prompt": prompt(7)} if "chat" not in path else \
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        reply = rig.post(path, body)
        engine = reply.headers["x-kvservice-engine"]
        assert reply.status == 200 and reply.body == rig.state(engine).sent[-1]
        assert reply.headers["x-stub"] == engine and reply.headers["content-type"] == "application/json"
        assert int(reply.headers["content-length"]) == len(reply.body)
    page = rig.get("/metrics").body.decode()
    assert metric(page, "kvservice_router_realized_cached_tokens_total", engine=engine) >= 48


def test_a_stream_passes_each_chunk_as_it_comes(rig, loop):
    """The stub holds its last chunk until the client has read the first: a buffering router would hang."""
    gate = loop.run(_event())
    for name in ("e0", "e1"):
        loop.call(setattr, rig.state(name), "hold_last", gate)

    async def read_stream():
        body = {"model": "m", "prompt": prompt(9), "stream": True, "stream_options": {"include_usage": True}}
        async with aiohttp.ClientSession() as session:
            async with session.post(rig.url + "/v1/completions", json=body) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                engine = r.headers["x-kvservice-engine"]
                got = bytearray()
                while b"t0" not in got:
                    got += await asyncio.wait_for(r.content.readany(), 10)
                gate.set()  # only now may the stub send its last chunk
                got += await r.content.read()
                return engine, bytes(got)

    engine, got = loop.run(read_stream())
    assert got == rig.state(engine).sent[-1] and got.endswith(b"data: [DONE]\n\n")
    for name in ("e0", "e1"):
        loop.call(setattr, rig.state(name), "hold_last", None)


async def _event() -> asyncio.Event:
    return asyncio.Event()


def test_a_refused_connection_is_retried_on_the_next_engine(loop, allocator):
    server, client = allocator
    rig = Rig(loop, server.target, ["r0", "r1"], policy="precise", health_interval_s=60)  # no check meanwhile
    try:
        tokens = prompt(21)
        cache_prompt(client, "r0", tokens)  # r0 is the best choice...
        loop.run(rig.stubs["r0"].stop())  # ...but refuses connections now, before any health check noticed
        reply = rig.post("/v1/completions", {"prompt": tokens})
        assert reply.status == 200 and reply.headers["x-kvservice-engine"] == "r1"
        page = rig.get("/metrics").body.decode()
        assert metric(page, "kvservice_router_retries_total", engine="r0", reason="refused") == 1
        assert metric(page, "kvservice_router_ejections_total", engine="r0") == 1
        assert metric(page, "kvservice_router_engine_up", engine="r0") == 0
        assert rig.post("/v1/completions", {"prompt": tokens}).headers["x-kvservice-engine"] == "r1"  # ejected
    finally:
        rig.close()


def test_bad_input_gets_vllms_error_shape(rig):
    cases = [
        (b'{"model": "m", "prompt": [1, 2', 400, "Bad Request", "body.30", "JSON decode error"),
        (json.dumps({"model": "nope", "prompt": [1]}).encode(), 404, "NotFoundError", "model",
         "The model `nope` does not exist. Valid aliases: m."),
        (json.dumps({"model": "m", "prompt": []}).encode(), 400, "BadRequestError", None,
         "You must pass at least one prompt"),
        (json.dumps({"model": "m", "prompt": [[]]}).encode(), 400, "BadRequestError", None,
         "The decoder prompt cannot be empty"),
        (json.dumps({"model": "m", "prompt": [1] * 2100}).encode(), 400, "BadRequestError", "input_tokens",
         "This model's maximum context length is 2048 tokens. However, your prompt contains 2100 input tokens"),
        (json.dumps({"model": "m", "prompt": [1] * 2049}).encode(), 400, "BadRequestError", "input_tokens",
         "However, your prompt contains at least 2049 input tokens"),  # vLLM's words one over the limit
    ]
    for raw, status, err_type, param, message in cases:
        reply = rig.post("/v1/completions", raw=raw)
        assert reply.status == status, reply.body
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == (err_type, param, status)
        assert message in error["message"]
    assert all(not s.requests or s.requests[-1].get("model") == "m" for s in (rig.state("e0"), rig.state("e1")))
    page = rig.get("/metrics").body.decode()
    assert metric(page, "kvservice_router_requests_total", engine="none", status="404") >= 1
