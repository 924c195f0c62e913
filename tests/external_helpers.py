"""Building vLLM KV-event traffic without vLLM: events as vLLM 0.33 publishes them (maps, block hashes from
our re-implementation of its sha256_cbor chain), and a publisher speaking its ZMQ protocol (PUB frames
[topic, seq, payload] plus a ROUTER replaying its buffer) for tests and benchmarks of `make test`. The
vLLM-published tests (tests/vllm/) run vLLM's own ZmqEventPublisher instead."""

from __future__ import annotations

import threading
import time
from collections import deque

import msgpack
import zmq

from kvservice.external import vllm_hashes

BLOCK = 4
ALGO = "sha256_cbor"
ROOT = vllm_hashes.none_hash(ALGO)


def chain(tokens: list[int], block_size: int = BLOCK, parent: bytes | None = None, algo: str = ALGO,
          extra: list | None = None) -> list[bytes]:
    """vLLM block hashes of every full block of `tokens`, chained after `parent` (None: the root)."""
    out, prev = [], parent if parent is not None else vllm_hashes.none_hash(algo)
    for i in range(len(tokens) // block_size):
        keys = extra[i] if extra else None
        prev = vllm_hashes.block_hash(algo, prev, tokens[i * block_size:(i + 1) * block_size], keys)
        out.append(prev)
    return out


def stored(hashes: list, parent, tokens: list[int], block_size: int = BLOCK, medium: str | None = "GPU",
           lora_name: str | None = None, extra_keys: list | None = None, group_idx: int = 0) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": lora_name, "extra_keys": extra_keys, "group_idx": group_idx}


def removed(hashes: list, medium: str | None = "GPU", group_idx: int = 0) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": group_idx}


def cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def payload(*events: dict, ts: float = 1.0) -> bytes:
    return msgpack.packb([ts, list(events), 0], use_bin_type=True)


class Publisher:
    """vLLM's ZmqEventPublisher protocol on loopback: PUB binds `port` (0: a free one), ROUTER replays the
    last `buffer` batches. `drop(n)` skips sending the next n batches on PUB (they stay replayable), so a
    test makes a gap; `stall_replays(s)` leaves replay requests unanswered for s seconds (a busy engine: vLLM's
    publisher thread serves its ROUTER between sends), then answers them; a new Publisher on the same ports is
    a restarted engine (sequence from 0)."""

    def __init__(self, port: int = 0, replay_port: int | None = 0, buffer: int = 10_000, topic: bytes = b"") -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self._bind(self.pub, port)
        self.replay = None
        self.replay_port = None
        if replay_port is not None:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay_port = self._bind(self.replay, replay_port)
        self.topic = topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.next_seq = 0
        self._drop = 0
        self._replays_from = 0.0  # monotonic time before which replay requests wait
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        if self.replay is not None:
            self._thread.start()

    @staticmethod
    def _bind(sock, port: int) -> int:
        if port:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return port
        return sock.bind_to_random_port("tcp://127.0.0.1")

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else ""

    def drop(self, n: int) -> None:
        self._drop = n

    def stall_replays(self, seconds: float) -> None:
        self._replays_from = time.monotonic() + seconds

    def publish(self, *events: dict) -> int:
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            body = payload(*events, ts=time.time())
            self.buffer.append((seq, body))
            if self._drop:
                self._drop -= 1
            else:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), body])
        return seq

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if time.monotonic() < self._replays_from:
                time.sleep(0.02)
                continue
            if not self.replay.poll(50) or time.monotonic() < self._replays_from:  # (stalled while it polled)
                continue
            with self._lock:
                client, _, start = self.replay.recv_multipart()
                start_seq = int.from_bytes(start, "big")
                for seq, body in self.buffer:
                    if seq >= start_seq:
                        self.replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), body])
                self.replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.context.term()


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not reached within {timeout_s} s")
