"""External pools survive `kill -9` of the allocator by snapshot + WAL (their ingested batches are journaled
like every other mutation); what the engine published while the allocator was down comes by replay."""

import random
import signal
from collections import Counter

from kvservice._proto import allocator_pb2 as pb
from tests.external_helpers import Publisher, chain, removed, stored, wait_for
from tests.service_helpers import start_server

B = 4


def digest(client) -> str:
    return client.stub.GetStats(pb.GetStatsRequest(include_state_digest=True), timeout=10).state_digest


def last_sequence(client) -> int:
    pools = client.get_stats().external_pools
    return pools["vllm-0"].last_sequence if "vllm-0" in pools else -2


def test_kill_9_restart_recovers_the_index_and_catches_up(tmp_path):
    rng = random.Random(5)
    pub = Publisher()
    data = tmp_path / "data"
    flag = f"vllm-0={pub.endpoint},replay={pub.replay_endpoint},block-size={B},hash=sha256_cbor"
    args = ("--data-dir", str(data), "--hash-block-size", "4", "--vllm-events", flag)
    cached: Counter = Counter()
    prompts = [[rng.randrange(20) for _ in range(12)] + [0] for _ in range(12)]

    def publish_some(n: int) -> int:
        seq = -1
        for _ in range(n):
            p = rng.choice(prompts)
            h = chain(p)
            if rng.random() < 0.35 and +cached:
                victim = rng.choice(sorted(+cached))
                cached[victim] -= 1
                seq = pub.publish(removed([victim]))
            else:
                k = rng.randrange(len(h))
                cached.update(h[k:])
                seq = pub.publish(stored(h[k:], h[k - 1] if k else None, p[k * B:12]))
        return seq

    def expected(p) -> int:
        n = 0
        for h in chain(p)[:(len(p) - 1) // B]:
            if not cached[h]:
                break
            n += B
        return n

    server = start_server(*args, persistence=True, log_dir=tmp_path)
    try:
        with server.client(hash_block_size=4) as client:
            wait_for(lambda: client.get_stats().external_pools["vllm-0"].connected, what="connected")
            seq = publish_some(80)
            wait_for(lambda: last_sequence(client) == seq, what="caught up")
            before = digest(client)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        seq = publish_some(40)  # while the allocator is down: only the replay buffer has these

        server = start_server(*args, persistence=True, log_dir=tmp_path)
        with server.client(hash_block_size=4) as client:
            wait_for(lambda: last_sequence(client) == seq, what="caught up by replay after the restart")
            stats = client.get_stats().external_pools["vllm-0"]
            assert stats.restarts == 0 and stats.resyncs == 0 and stats.epoch == 0
            for p in prompts:
                assert client.lookup(p).tokens("vllm-0") == expected(p)
            quiet = digest(client)
            assert quiet != before
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)

        server = start_server(*args, persistence=True, log_dir=tmp_path)
        with server.client(hash_block_size=4) as client:
            wait_for(lambda: client.get_stats().external_pools["vllm-0"].replays >= 1, what="replay check")
            assert digest(client) == quiet  # block for block, counters included
            for p in prompts:
                assert client.lookup(p).tokens("vllm-0") == expected(p)
    finally:
        server.stop()
        pub.close()
