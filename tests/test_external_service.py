"""External pools on a real `kvservice serve` (loopback): `--vllm-events` and the RegisterExternalPool RPC,
fed by a publisher speaking vLLM's ZMQ protocol (PUB frames + ROUTER replay): Lookup and placement,
tenancy, gaps filled by replay, a restarted publisher, a gap without replay, stats and metrics."""

import urllib.request

import pytest

from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.errors import InvalidArgument, NotFound, PermissionDenied
from tests.external_helpers import Publisher, chain, cleared, removed, stored, wait_for
from tests.redis_helpers import free_port
from tests.service_helpers import start_server

B = 4


@pytest.fixture
def publisher():
    pub = Publisher()
    yield pub
    pub.close()


def ext(client, pool_id="vllm-0"):
    return client.get_stats().external_pools[pool_id]


def applied(client, seq, pool_id="vllm-0"):
    return wait_for(lambda: ext(client, pool_id).last_sequence >= seq, what=f"batch {seq} applied")


def test_vllm_events_flag_lookup_placement_and_stats(publisher, tmp_path):
    metrics_port = free_port()
    flag = (f"vllm-0={publisher.endpoint},replay={publisher.replay_endpoint},block-size={B},hash=sha256_cbor")
    server = start_server("--hash-block-size", "4", "--vllm-events", flag, "--metrics-port", str(metrics_port),
                          log_dir=tmp_path)
    try:
        with server.client(hash_block_size=4) as client:
            wait_for(lambda: ext(client).connected, what="subscription connected")
            prompt = list(range(21))
            h = chain(prompt)
            seq = publisher.publish(stored(h, None, prompt[:20]))
            applied(client, seq)
            client.register_pool("own-0", KVCacheConfig(64, [FullAttentionSpec(4)]), max_model_len=256)
            result = client.lookup(prompt)
            assert result.tokens("vllm-0") == 20 and result.tokens("own-0") == 0
            assert result.best_pool_id == "vllm-0"  # ranked with the kvservice pool
            hit = next(x for x in result.hits if x.pool_id == "vllm-0")
            assert hit.external and hit.tiers["GPU"] == 20
            seq = publisher.publish(removed(h[2:3]))
            applied(client, seq)
            assert client.lookup(prompt).tokens("vllm-0") == 8
            s = ext(client)
            assert (s.batches, s.stored_blocks, s.removed_blocks, s.block_size, s.tiers["GPU"]) == (2, 5, 1, 4, 4)
            assert s.spec_status == "ok" and s.spec_blocks_checked == 5  # concluded by the root block
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            assert 'kvservice_external_blocks{medium="GPU",pool="vllm-0"} 4.0' in text
            assert 'kvservice_external_batches_total{pool="vllm-0"} 2.0' in text
            assert 'kvservice_external_spec_status{pool="vllm-0",status="ok"} 1.0' in text
    finally:
        server.stop()


def test_gap_is_filled_by_replay_and_a_replayed_store_never_resurrects(publisher, tmp_path):
    server = start_server("--hash-block-size", "4", log_dir=tmp_path)
    try:
        with server.client(hash_block_size=4) as client:
            client.register_external_pool("vllm-0", publisher.endpoint, publisher.replay_endpoint, block_size=B)
            wait_for(lambda: ext(client).connected, what="subscription connected")
            prompt = list(range(13))
            h = chain(prompt)
            publisher.publish(stored(h, None, prompt[:12]))
            applied(client, publisher.publish(removed(h[1:2])))
            publisher.drop(2)  # lost on the wire, still in the publisher's replay buffer
            publisher.publish(stored(h[1:2], h[0], prompt[4:8]))
            publisher.publish(removed(h[:1]))
            seq = publisher.publish(stored(h[:1], None, prompt[:4]))
            applied(client, seq)
            s = ext(client)
            assert s.gaps >= 1 and s.replays >= 2 and s.resyncs == 0 and s.restarts == 0
            assert client.lookup(prompt).tokens("vllm-0") == 12
            # The publisher replays everything from our position on every catch-up: nothing applies twice.
            applied(client, publisher.publish(removed(h[2:3])))
            assert client.lookup(prompt).tokens("vllm-0") == 8
            assert ext(client).batches == seq + 2
    finally:
        server.stop()


def test_publisher_restart_starts_a_new_epoch(tmp_path):
    pub = Publisher()
    server = start_server("--hash-block-size", "4", log_dir=tmp_path)
    try:
        with server.client(hash_block_size=4) as client:
            client.register_external_pool("vllm-0", pub.endpoint, pub.replay_endpoint, block_size=B)
            wait_for(lambda: ext(client).connected, what="subscription connected")
            old, new = list(range(9)), list(range(50, 59))
            for _ in range(5):
                pub.publish(stored(chain(old), None, old[:8]))
            applied(client, 4)
            port, replay_port = pub.port, pub.replay_port
            pub.close()
            pub = Publisher(port, replay_port)  # the engine restarted: its KV cache is empty, seq from 0
            pub.publish(stored(chain(new), None, new[:8]))
            wait_for(lambda: ext(client).epoch == 1 and ext(client).last_sequence == 0, what="new epoch")
            assert client.lookup(old).tokens("vllm-0") == 0 and client.lookup(new).tokens("vllm-0") == 8
            assert ext(client).restarts == 1
    finally:
        pub.close()
        server.stop()


def test_gap_without_replay_resyncs_and_clear_empties(publisher, tmp_path):
    server = start_server("--hash-block-size", "4", log_dir=tmp_path)
    try:
        with server.client(hash_block_size=4) as client:
            client.register_external_pool("vllm-0", publisher.endpoint, block_size=B)
            wait_for(lambda: ext(client).connected, what="subscription connected")
            a, b = list(range(9)), list(range(30, 39))
            applied(client, publisher.publish(stored(chain(a), None, a[:8])))
            publisher.drop(1)
            publisher.publish(removed(chain(a)[:1]))  # lost, and no replay to ask
            applied(client, publisher.publish(stored(chain(b), None, b[:8])))
            s = ext(client)
            assert s.resyncs == 1 and s.gaps == 1
            assert client.lookup(a).tokens("vllm-0") == 0  # dropped: never a stale hit
            assert client.lookup(b).tokens("vllm-0") == 8
            applied(client, publisher.publish(cleared()))
            assert client.lookup(b).tokens("vllm-0") == 0 and ext(client).clears == 1
    finally:
        server.stop()


def test_tenancy_validation_and_removal(publisher, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-a alpha\ntok-b beta\ntok-admin ops admin\n")
    server = start_server("--hash-block-size", "4", "--token-file", str(tokens), log_dir=tmp_path)
    try:
        with server.client("tok-a", hash_block_size=4) as alpha, server.client("tok-b", hash_block_size=4) as beta:
            registration, new = alpha.register_external_pool("vllm-a", publisher.endpoint, block_size=B)
            assert new and alpha.register_external_pool("vllm-a", publisher.endpoint, block_size=B) == (
                registration, False)
            wait_for(lambda: ext(alpha, "vllm-a").connected, what="subscription connected")
            p = list(range(9))
            applied(alpha, publisher.publish(stored(chain(p), None, p[:8])), "vllm-a")
            assert alpha.lookup(p).tokens("vllm-a") == 8
            assert beta.lookup(p).hits == [] and "vllm-a" not in beta.get_stats().external_pools
            with pytest.raises(NotFound):
                beta.lookup(p, pool_ids=["vllm-a"])
            with pytest.raises(PermissionDenied):
                beta.register_external_pool("vllm-a", publisher.endpoint)
            with pytest.raises(PermissionDenied, match="admin"):
                beta.register_external_pool("vllm-b", "tcp://127.0.0.1:5999", bind=True)
            with pytest.raises(InvalidArgument) as err:
                beta.register_external_pool("vllm-b", "udp://127.0.0.1:1")
            assert err.value.field == "spec.endpoint"
            with pytest.raises(InvalidArgument) as err:
                beta.register_external_pool("vllm-b", "tcp://127.0.0.1:1", hash_algo="md5")
            assert err.value.field == "spec.hash_algo"
            with pytest.raises(NotFound):
                beta.remove_external_pool("vllm-a")
            alpha.remove_external_pool("vllm-a")
            assert alpha.lookup(p).hits == []
    finally:
        server.stop()


def test_bad_flag_refuses_to_start(tmp_path):
    with pytest.raises(RuntimeError, match="hash"):
        start_server("--vllm-events", "vllm-0=tcp://127.0.0.1:5557,hash=md5", log_dir=tmp_path)


def test_a_replay_that_answers_without_the_gap_still_resyncs_in_bounded_time(tmp_path):
    """A replay socket that answers but never brings the missing batch (its buffer is behind the live stream)
    is no progress: the held batches resync after `resync_after_s` (10 s) as an unanswered replay does, instead
    of holding the stream (and the index as of the gap) forever."""
    pub = Publisher()
    server = start_server("--hash-block-size", "4", log_dir=tmp_path)
    try:
        with server.client(hash_block_size=4) as client:
            client.register_external_pool("vllm-0", pub.endpoint, pub.replay_endpoint, block_size=4)
            wait_for(lambda: ext(client).connected, what="subscription connected")
            a, b = list(range(9)), list(range(30, 39))
            seq = pub.publish(stored(chain(a), None, a[:8]))
            wait_for(lambda: ext(client).last_sequence >= seq, what="batch 0 applied")
            pub.drop(1)
            pub.publish(stored(chain(b), None, b[:8]))  # lost on the wire ...
            with pub._lock:
                pub.buffer.pop()  # ... and never in the replay buffer, which answers with batch 0 only
            seq = pub.publish(stored(chain(b), None, b[:8]))
            with pub._lock:
                pub.buffer.pop()
            wait_for(lambda: ext(client).last_sequence >= seq, timeout_s=40,
                     what="the held batch applied after a resync")
            assert ext(client).resyncs == 1
            assert client.lookup(b).tokens("vllm-0") == 8
    finally:
        pub.close()
        server.stop()
