"""A stock vLLM 0.33.0 engine as kvservice sees it, for the vLLM-published tests: vLLM's own
`KVCacheManager` (events on) driven the way its scheduler drives it, and vLLM's own `ZmqEventPublisher`
publishing every step's events. Runs only in the project's vLLM environment (`make vllm-env`)."""

from __future__ import annotations

import random
import threading
import time

import torch
import zmq
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

BLOCK = 16


class VllmEngine:
    """One engine instance: a KV-cache manager of `num_blocks`, requests admitted with prefix-cache hits,
    decoded, freed; `step()` publishes what the step changed, as vLLM's scheduler does."""

    def __init__(self, endpoint: str, replay_endpoint: str, num_blocks: int = 64, hash_algo: str = "sha256",
                 buffer_steps: int = 10_000) -> None:
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(self.hash_fn)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.manager = KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                                      enable_caching=True, enable_kv_cache_events=True)
        self.publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay_endpoint,
                                           buffer_steps=buffer_steps)
        self.running: list[Request] = []
        self.num_published = 0
        self._ids = 0

    def request(self, prompt: list[int]) -> Request:
        self._ids += 1
        params = SamplingParams(max_tokens=64)
        return Request(f"r{self._ids}", list(prompt), params, None,
                       block_hasher=get_request_block_hasher(BLOCK, self.hash_fn))

    def computed_tokens(self, prompt: list[int]) -> int:
        """What vLLM's get_computed_blocks answers for `prompt` now (a read: no request is admitted)."""
        _, num_computed, _ = self.manager.get_computed_blocks(self.request(prompt))
        return num_computed

    def admit(self, prompt: list[int]) -> bool:
        req = self.request(prompt)
        blocks, num_computed, _ = self.manager.get_computed_blocks(req)
        if self.manager.allocate_slots(req, req.num_tokens - num_computed, num_computed, blocks) is None:
            return False
        req.num_computed_tokens = req.num_tokens
        self.running.append(req)
        return True

    def decode(self, req: Request, token: int) -> bool:
        req.append_output_token_ids(token)
        if self.manager.allocate_slots(req, 1) is None:
            self.free(req)  # preempted: its blocks go back (cached ones stay cached until evicted)
            return False
        req.num_computed_tokens += 1
        return True

    def free(self, req: Request) -> None:
        self.manager.free(req)
        self.running.remove(req)

    def step(self) -> int:
        """Publishes this step's events (when any): returns the number of batches published so far."""
        events = self.manager.take_events()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.num_published += 1
        return self.num_published

    def shutdown(self) -> None:
        self.publisher.shutdown()


def random_step(engine: VllmEngine, rng: random.Random, prefixes: list[list[int]], max_running: int = 4) -> None:
    """One scheduler step of a random workload: admissions over shared prefixes, decodes (greedy-like
    repeats, so identical blocks get cached twice), finishes; small pools make eviction churn."""
    if len(engine.running) < max_running and rng.random() < 0.6:
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        engine.admit(prompt)
    for req in list(engine.running):
        r = rng.random()
        if r < 0.15:
            engine.free(req)
        elif r < 0.8:
            for _ in range(rng.randrange(1, 12)):
                if not engine.decode(req, 7 if rng.random() < 0.7 else rng.randrange(1000)):
                    break


class Proxy:
    """A ZMQ forwarder between an engine's PUB socket and kvservice (both on loopback): the engine connects
    to `upstream`, kvservice subscribes to `downstream`. `drop(n)` loses the next n batches; `cut()` closes
    the downstream socket (kvservice's subscription is gone), `heal()` binds it again."""

    def __init__(self, upstream_port: int, downstream_port: int) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(f"tcp://127.0.0.1:{upstream_port}")
        self.downstream_port = downstream_port
        self.pub = self._bind_pub()
        self._drop = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.forwarded = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _bind_pub(self):
        pub = self.context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{self.downstream_port}")
        return pub

    def drop(self, n: int) -> None:
        with self._lock:
            self._drop = n

    def cut(self) -> None:
        with self._lock:
            self.pub.close(0)
            self.pub = None

    def heal(self) -> None:
        with self._lock:
            self.pub = self._bind_pub()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sub.poll(50):
                continue
            parts = self.sub.recv_multipart()
            with self._lock:
                if self._drop:
                    self._drop -= 1
                elif self.pub is not None:
                    self.pub.send_multipart(parts)
                    self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with self._lock:
            if self.pub is not None:
                self.pub.close(0)
        self.sub.close(0)
        self.context.term()
