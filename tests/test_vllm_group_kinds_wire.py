"""The group kinds a vLLM pool carries beside full attention, over the wire, their block ids checked against
kvservice's core called directly as vLLM's scheduler calls its KVCacheManager:

- R-SWA (vLLM's RSWASpec): the prompt's blocks stay; of the generated tokens only the last `rswa_window`
  keep theirs, the gap between is freed as decoding goes on;
- attention sinks (SinkFullAttentionSpec): allocated as full attention, `sink_len` a multiple of the block;
- a circular buffer (CircularBufferSpec): one block per request for its whole life, never cached;
and each spec round-trips through the encoding snapshots and the WAL keep; bad input is refused naming the
field.
"""

import pytest

from kvservice._proto import allocator_pb2 as pb
from kvservice.commands import VllmOptions
from kvservice.core import CircularBufferSpec, FullAttentionSpec, KVCacheConfig, RSWASpec, SinkFullAttentionSpec
from kvservice.errors import InvalidArgument
from kvservice.ops import FreeOp, NewStepOp
from kvservice.wire.encode import encode_config
from kvservice.wire.pool_spec import decode_config
from tests.test_vllm_mamba_wire import BS, MAX_LEN, SPEC, Pair

KINDS = {"rswa": RSWASpec(BS, rswa_window=4), "sink": SinkFullAttentionSpec(BS, sink_len=BS),
         "ring": CircularBufferSpec(BS)}


@pytest.fixture
def client(small_hash_client):
    return small_hash_client


def decode_steps(p: Pair, request_id: str, n: int, new_steps: bool = False) -> None:
    """`n` decode steps of one token each (one Step each), the pool checked against the core after each.
    `new_steps`: each starts a scheduler step (NewStepOp), as a pool with a Mamba group hears."""
    req = p.requests[request_id]
    for _ in range(n):
        if new_steps:
            p.core.new_step_starts()
        known = len(req.block_hashes)
        req.append_output_token_ids(7)
        op = p.run(request_id, 1)
        op.append_block_hashes, op.num_append_tokens = list(req.block_hashes[known:]), 1
        p.step([NewStepOp(), op] if new_steps else [op])
        p.check(request_id)


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_group_of_each_kind_allocates_as_vllms_core_does(client, request, kind):
    p = Pair(client, request.node.name, KVCacheConfig(48, [FullAttentionSpec(BS), KINDS[kind]]))
    prompt = list(range(50, 60))  # 2.5 blocks
    p.step([p.add("a", prompt), p.admit("a")])
    p.check("a")
    decode_steps(p, "a", 24)
    fa, second = p.core.get_block_ids("a")
    if kind == "rswa":  # the prompt's 3 blocks stay; the gap up to the 4-token window is freed: null blocks
        assert 0 not in second[:3] and second.count(0) >= 3 and second[-1] > 0, second
    elif kind == "ring":
        assert len(second) == 1, second
    else:
        assert len(second) == len(fa) and 0 not in second
    # A second request on the same prompt: the hit (if the kind caches) is the core's.
    p.step([p.add("b", prompt + [1, 2, 3]), p.admit("b")])
    p.check("a", "b")
    for rid in ("a", "b"):
        p.core.free(p.requests[rid])
    p.step([FreeOp("a"), FreeOp("b")])
    p.check()


def test_each_kind_round_trips_through_the_encoding_snapshots_and_the_wal_keep():
    """(Snapshots and WAL entries hold the RegisterPool request: encode_config, then decode_config.)"""
    config = KVCacheConfig(48, [FullAttentionSpec(BS), *KINDS.values()])
    decoded, max_model_len, dcp = decode_config(encode_config(config, MAX_LEN))
    assert [type(s) for s in decoded.groups] == [FullAttentionSpec, RSWASpec, SinkFullAttentionSpec,
                                                  CircularBufferSpec]
    assert decoded.groups[1].rswa_window == 4 and decoded.groups[2].sink_len == BS
    assert (max_model_len, dcp) == (MAX_LEN, 1)


def test_replicated_groups_under_dcp_round_trip_and_span_their_block():
    """vLLM's dcp_sharded=False (a draft model's attention, Mamba): every rank keeps the group whole, so its
    blocks span block_size tokens while a sharded group's span block_size * dcp. As in vLLM's coordinator, only
    full-attention kinds may be sharded under DCP: another kind must say it is replicated."""
    from kvservice.core import ChunkedLocalAttentionSpec, MambaSpec
    from kvservice.core.specs import effective_block_size

    config = KVCacheConfig(48, [FullAttentionSpec(BS), FullAttentionSpec(BS, dcp_sharded=False), MambaSpec(2 * BS),
                                ChunkedLocalAttentionSpec(BS, 4 * BS, dcp_sharded=False), RSWASpec(BS, rswa_window=4)])
    decoded, _, dcp = decode_config(encode_config(config, MAX_LEN, dcp_world_size=2))
    assert [s.dcp_sharded for s in decoded.groups] == [True, False, False, False, True] and dcp == 2
    assert [effective_block_size(s, dcp) for s in decoded.groups] == [2 * BS, BS, 2 * BS, BS, 2 * BS]
    msg = encode_config(KVCacheConfig(48, [FullAttentionSpec(BS), ChunkedLocalAttentionSpec(BS, 4 * BS)]), MAX_LEN,
                        dcp_world_size=2)
    with pytest.raises(InvalidArgument, match=r"config.groups\[1\].replicated = False: under decode context "
                                              r"parallelism \(dcp_world_size 2\) only full-attention groups"):
        decode_config(msg)


@pytest.mark.parametrize("index, mangle, field", [
    (1, lambda g: setattr(g.rswa, "rswa_window", 0), r"config\.groups\[1\]\.rswa\.rswa_window"),
    (2, lambda g: setattr(g.sink_full_attention, "sink_len", BS + 1),
     r"config\.groups\[2\]\.sink_full_attention\.sink_len"),
    (2, lambda g: setattr(g.sink_full_attention, "sink_len", 0), r"config\.groups\[2\]\.sink_full_attention\.sink_len"),
    (3, lambda g: setattr(g.circular_buffer, "block_size", 0), r"config\.groups\[3\]\.circular_buffer\.block_size"),
])
def test_bad_group_fields_are_refused_naming_them(index, mangle, field):
    msg = encode_config(KVCacheConfig(48, [FullAttentionSpec(BS), *KINDS.values()]), MAX_LEN)
    mangle(msg.groups[index])
    with pytest.raises(InvalidArgument, match=field):
        decode_config(msg, "config")


def test_a_refused_group_leaves_no_pool_behind(client, request):
    name = request.node.name
    bad = KVCacheConfig(20, [FullAttentionSpec(BS), SinkFullAttentionSpec(BS, sink_len=BS + 2)])
    with pytest.raises(InvalidArgument, match=r"sink_full_attention\.sink_len.*multiple of the block size"):
        client.register_pool(name, bad, max_model_len=MAX_LEN, hash_spec=SPEC, vllm=VllmOptions())
    assert name not in client.get_stats().pools
    # Decode context parallelism shards full-attention kinds only (R-SWA is one): a circular buffer under it must be
    # replicated; sharded, it is refused naming the field, and no pool is left.
    with pytest.raises(InvalidArgument, match=r"groups\[1\].replicated = False: under decode context parallelism"):
        client.register_pool(name + "-dcp", KVCacheConfig(20, [FullAttentionSpec(BS), KINDS["ring"]]),
                             max_model_len=MAX_LEN, dcp_world_size=2, hash_spec=SPEC, vllm=VllmOptions())
    assert name + "-dcp" not in client.get_stats().pools
    assert pb.KVCacheGroup.DESCRIPTOR.fields_by_name["rswa"].number == 7  # (the wire field stays put)
