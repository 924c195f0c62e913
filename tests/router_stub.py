"""A stub vLLM OpenAI server for the router's own tests and bench (`kvservice route` without an engine): real
HTTP (aiohttp), vLLM 0.32's reply shapes, deterministic bytes, and knobs a test turns: health, load on
/metrics, the cached tokens it reports, an SSE stream held before its last chunk, a producer's
kv_transfer_params.

    python -m tests.router_stub --port 8001 --name e0      # a stub server of its own (bench/router_bench.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web

MODEL = "m"


@dataclass(slots=True)
class StubState:
    name: str
    model: str = MODEL
    max_model_len: int = 2048
    healthy: bool = True
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    cached_tokens: int = 0  # reported in usage.prompt_tokens_details.cached_tokens
    chunks: int = 4  # SSE content chunks
    chunk_delay_s: float = 0.0
    first_chunk_delay_s: float = 0.0  # a stream's wait before its first chunk (its headers go at once, as vLLM's)
    producer_params: dict | None = None  # a producer's kv_transfer_params, answered to max_tokens=1
    hold_last: asyncio.Event | None = None  # a stream waits for it before its last content chunk
    requests: list[dict] = field(default_factory=list)  # the bodies received, in order
    sent: list[bytes] = field(default_factory=list)  # the bytes of each reply body, in order


def prompt_len(body: dict) -> int:
    prompt = body.get("prompt", body.get("messages", ""))
    return len(prompt) if isinstance(prompt, (list, str)) else 0


def completion(state: StubState, body: dict, chat: bool) -> dict:
    n = prompt_len(body)
    choice = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": f"{state.name}:{n}"}
    else:
        choice["text"] = f"{state.name}:{n}"
    out = {"id": f"cmpl-{state.name}-{len(state.requests)}", "object": "chat.completion" if chat else "text_completion",
           "created": 1700000000, "model": body.get("model") or state.model, "choices": [choice],
           "usage": {"prompt_tokens": n, "total_tokens": n + 2, "completion_tokens": 2,
                     "prompt_tokens_details": {"cached_tokens": state.cached_tokens}}}
    if state.producer_params is not None and body.get("max_tokens") == 1:
        out["kv_transfer_params"] = state.producer_params
    return out


def make_app(state: StubState) -> web.Application:
    async def health(request):
        return web.Response(status=200 if state.healthy else 503)

    async def metrics(request):
        labels = f'{{engine="0",model_name="{state.model}"}}'
        text = (f"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {state.running}\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} {state.waiting}\n"
                f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{labels} {state.kv_usage}\n")
        return web.Response(text=text, content_type="text/plain")

    async def models(request):
        return web.json_response({"object": "list", "data": [
            {"id": state.model, "object": "model", "created": 1700000000, "owned_by": "vllm",
             "root": f"/nonexistent/{state.model}", "parent": None, "max_model_len": state.max_model_len,
             "permission": []}]})

    async def generate(request: web.Request):
        body = json.loads(await request.read())
        state.requests.append(body)
        chat = request.path.endswith("chat/completions")
        reply = completion(state, body, chat)
        if not body.get("stream"):
            data = json.dumps(reply).encode()
            state.sent.append(data)
            return web.Response(body=data, content_type="application/json", headers={"x-stub": state.name})
        response = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8",
                                               "x-stub": state.name})
        await response.prepare(request)
        if state.first_chunk_delay_s:
            await asyncio.sleep(state.first_chunk_delay_s)
        sent = bytearray()
        for i in range(state.chunks):
            if i == state.chunks - 1 and state.hold_last is not None:
                await asyncio.wait_for(state.hold_last.wait(), 30)
            delta = {"index": 0, "finish_reason": None, "logprobs": None}
            delta.update({"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"})
            chunk = {"id": reply["id"], "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 1700000000, "model": reply["model"], "choices": [delta]}
            line = f"data: {json.dumps(chunk)}\n\n".encode()
            sent += line
            await response.write(line)
            if state.chunk_delay_s:
                await asyncio.sleep(state.chunk_delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": reply["id"], "object": "text_completion", "created": 1700000000, "model": reply["model"],
                     "choices": [], "usage": reply["usage"]}
            line = f"data: {json.dumps(usage)}\n\n".encode()
            sent += line
            await response.write(line)
        sent += b"data: [DONE]\n\n"
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        state.sent.append(bytes(sent))
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


class StubServer:
    """One stub on loopback, in the running event loop."""

    def __init__(self, state: StubState) -> None:
        self.state = state
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, port: int = 0) -> str:
        self.runner = web.AppRunner(make_app(self.state), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port or self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="stub")
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()
    web.run_app(make_app(StubState(args.name, chunks=args.chunks)), host="127.0.0.1", port=args.port,
                access_log=None, print=None)


if __name__ == "__main__":
    main()
