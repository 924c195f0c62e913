"""A KV-aware router for a fleet of stock vLLM servers on external pools (`kvservice serve --vllm-events`).

    python examples/router.py --allocator 127.0.0.1:50051 \
        --backend vllm-0=http://10.0.0.1:8000 --backend vllm-1=http://10.0.0.2:8000 --port 8080

Listens on HTTP (loopback by default). `POST /v1/completions` (or any POST path) with a JSON body whose
`prompt` is a list of token ids (or text, with `--tokenizer DIR`): asks the allocator's Lookup which pool
holds the longest cached prefix of the prompt (`best_pool_id`, ties to the freest pool), forwards the
request unchanged to that pool's backend, and answers its reply with the header `x-kvservice-pool: POOL`.
`POST /route` answers only the choice, `{"pool": ..., "cached_tokens": ..., "backend": ...}`. A prompt no
pool has cached (or a best pool without a backend) goes to the backend its first tokens hash to, so a
prompt family keeps landing on the same engine. Each vLLM engine publishes its KV events to the allocator
(`--kv-events-config`, see the README's "Stock vLLM fleets"); the pool ids here are the `--vllm-events` ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout without installing

from kvservice.argparsing import Parser  # noqa: E402
from kvservice.client import KVServiceClient  # noqa: E402


class Router:
    """Picks a backend per prompt from the allocator's Lookup (one client, shared by the handler threads)."""

    def __init__(self, client: KVServiceClient, backends: dict[str, str], tokenizer=None) -> None:
        self.client = client
        self.backends = backends
        self.tokenizer = tokenizer
        self.lock = threading.Lock()  # KVServiceClient is not for concurrent use

    def token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and self.tokenizer is not None:
            return self.tokenizer(prompt).input_ids
        raise ValueError("prompt must be a non-empty list of token ids (or text, with --tokenizer)")

    def route(self, prompt) -> tuple[str, int]:
        """(pool id, its cached prefix tokens) for `prompt`."""
        ids = self.token_ids(prompt)
        with self.lock:
            found = self.client.lookup(ids, pool_ids=sorted(self.backends))
        best = found.best_pool_id
        if best in self.backends and found.hits[best].num_cached_tokens > 0:
            return best, found.hits[best].num_cached_tokens
        names = sorted(self.backends)  # nothing cached anywhere: a stable choice by the prompt's start
        digest = hashlib.blake2b(json.dumps(ids[:64]).encode(), digest_size=8).digest()
        return names[int.from_bytes(digest, "big") % len(names)], 0


def handler_for(router: Router, timeout_s: float):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            try:
                pool, cached = router.route(json.loads(body or b"{}").get("prompt"))
            except (ValueError, AttributeError) as exc:
                return self.reply(400, json.dumps({"error": str(exc)}).encode())
            backend = router.backends[pool]
            if self.path == "/route":
                answer = {"pool": pool, "cached_tokens": cached, "backend": backend}
                return self.reply(200, json.dumps(answer).encode(), pool)
            forward = urllib.request.Request(backend.rstrip("/") + self.path, data=body, method="POST",
                                             headers={"content-type": self.headers.get("content-type",
                                                                                       "application/json")})
            try:
                with urllib.request.urlopen(forward, timeout=timeout_s) as reply:
                    return self.reply(reply.status, reply.read(), pool)
            except urllib.error.HTTPError as exc:
                return self.reply(exc.code, exc.read(), pool)
            except OSError as exc:
                return self.reply(502, json.dumps({"error": f"backend {pool} at {backend}: {exc}"}).encode(), pool)

        def reply(self, status: int, data: bytes, pool: str = "") -> None:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            if pool:
                self.send_header("x-kvservice-pool", pool)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # one line per request is noise at fleet rates
            pass

    return Handler


def parse_backend(text: str) -> tuple[str, str]:
    pool, _, url = text.partition("=")
    if not pool or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"--backend wants POOL=http://HOST:PORT, got {text!r}")
    return pool, url


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="router.py", description=__doc__.splitlines()[0])
    parser.add_argument("--allocator", default="127.0.0.1:50051", help="the allocator (default: %(default)s)")
    parser.add_argument("--token", help="bearer token, when the allocator has --token-file")
    parser.add_argument("--backend", type=parse_backend, action="append", required=True, metavar="POOL=URL",
                        help="a pool id (its --vllm-events name) and its vLLM server's URL; repeat per engine")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="listen port, 0: a free one (default: %(default)s)")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer dir, for text prompts")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a backend's reply")
    args = parser.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    client = KVServiceClient(args.allocator, args.token, client_name="router", timeout_s=10)
    router = Router(client, dict(args.backend), tokenizer)
    server = ThreadingHTTPServer((args.host, args.port), handler_for(router, args.timeout))
    print(f"router for {', '.join(sorted(router.backends))} listening on {args.host}:{server.server_address[1]}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
