"""Malformed and hostile messages at every RPC: a clear status, never a crash, and a rejected call
leaves every pool exactly as it was."""

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import allocator_pb2_grpc as pb_grpc
from kvservice.client.routing import open_channel
from kvservice.ops import AddRequestOp, AllocateOp
from tests.service_helpers import small_config, start_server

POOL = "hostile"
EXPECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED}
UNARY = ["OpenSession", "RegisterPool", "Step", "Allocate", "Free", "Fork", "GetRequest", "Lookup", "CommitTransfer",
         "Heartbeat", "GetStats", "ResetPrefixCache"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    proc = start_server("--max-message-mb", "1", log_dir=tmp_path_factory.mktemp("server"))
    client = proc.client()
    client.register_pool(POOL, small_config(64, 16), max_model_len=256, vocab_size=1000)
    client.step(POOL, [AddRequestOp("held", token_ids=list(range(40))), AllocateOp("held", num_new_tokens=40),
                       AddRequestOp("waiting", token_ids=[1, 2, 3])])
    channel = open_channel(proc.target)
    yield proc, client, pb_grpc.AllocatorStub(channel), channel
    channel.close()
    client.close()
    proc.stop()


def hostile_strings(session_id: str):
    return st.one_of(st.sampled_from(["", "x" * 300, "a\x00b", "\n", "ok", POOL, "held", "waiting", session_id,
                                      "é" * 200, "\x1f"]), st.text(max_size=12))


def uints(bits: int):
    top = (1 << bits) - 1
    return st.one_of(st.sampled_from([0, 1, 2, 3, 16, 255, 256, 257, 1 << 20, top]), st.integers(0, top))


def message_strategy(descriptor, session_id: str, depth: int = 0):
    """Random instances of a message: every field absent or set to an edge value, oneofs exclusive."""
    fields = {}
    for f in descriptor.fields:
        if f.containing_oneof is not None:
            continue
        fields[f.name] = field_strategy(f, session_id, depth)
    oneofs = {o.name: [f for f in o.fields] for o in descriptor.oneofs if not o.name.startswith("_")}

    @st.composite
    def build(draw):
        kwargs = {}
        for name, strat in fields.items():
            if draw(st.booleans()):
                kwargs[name] = draw(strat)
        for options in oneofs.values():
            choice = draw(st.sampled_from([None, *options]))
            if choice is not None:
                kwargs[choice.name] = draw(field_strategy(choice, session_id, depth))
        for f in descriptor.fields:  # proto3 `optional` scalars
            if f.containing_oneof is not None and f.containing_oneof.name.startswith("_") and draw(st.booleans()):
                kwargs[f.name] = draw(uints(64))
        return descriptor._concrete_class(**kwargs)
    return build()


def field_strategy(f, session_id: str, depth: int):
    if f.type == FD.TYPE_STRING:
        one = hostile_strings(session_id)
    elif f.type == FD.TYPE_BYTES:
        one = st.one_of(st.binary(max_size=70), st.sampled_from([b"\x00" * 16, b"\xff" * 1200, b"\x01\x00\x00\x00"]))
    elif f.type == FD.TYPE_BOOL:
        one = st.booleans()
    elif f.type in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        one = uints(32)
    elif f.type in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        one = uints(64)
    elif f.type == FD.TYPE_DOUBLE:
        one = st.floats(allow_nan=True)
    elif f.type == FD.TYPE_ENUM:
        one = st.sampled_from([v.number for v in f.enum_type.values])
    elif f.type == FD.TYPE_MESSAGE:
        if depth >= 3:
            one = st.just(f.message_type._concrete_class())
        else:
            one = st.deferred(lambda: message_strategy(f.message_type, session_id, depth + 1))
    else:
        raise AssertionError(f"unhandled field type {f.type} of {f.full_name}")
    if f.is_repeated:
        return st.lists(one, max_size=4)
    return one


def pool_state(client):
    stats = client.get_stats(check_invariants=True)
    pool = stats.pools[POOL]
    assert pool.invariant_violation == ""
    return (pool.num_free_blocks, pool.num_requests, pool.num_cached_blocks, pool.epoch, stats.event_sequence)


@pytest.mark.parametrize("method", UNARY)
def test_hostile_messages(env, method):
    proc, client, stub, _ = env
    service = pb.DESCRIPTOR.services_by_name["Allocator"].methods_by_name[method]
    call = getattr(stub, method)

    @settings(max_examples=40)
    @given(msg=message_strategy(service.input_type, client.session_id), use_seq=st.booleans())
    def run(msg, use_seq):
        if use_seq and hasattr(msg, "sequence"):
            msg.sequence = client.next_sequence
        before = pool_state(client)
        try:
            call(msg, timeout=10)
        except grpc.RpcError as err:
            assert err.code() in EXPECTED, f"{method}: {err.code()} {err.details()}"
            assert err.details(), "every rejection says why"
            assert pool_state(client) == before, f"{method} was rejected ({err.details()}) but changed the pool"
            return
        if hasattr(msg, "sequence") and msg.session_id == client.session_id and msg.sequence == client.next_sequence:
            client.next_sequence += 1
        pool_state(client)  # a call that was accepted may change state, but never breaks invariants

    run()


def test_garbage_bytes_and_oversized_messages(env):
    proc, client, _, channel = env
    before = pool_state(client)
    for method in UNARY:
        raw = channel.unary_unary(f"/kvservice.v1.Allocator/{method}", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        for payload in (b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", bytes(range(256))):
            with pytest.raises(grpc.RpcError) as info:
                raw(payload, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert "not a valid kvservice.v1." in info.value.details()
    huge = pb.StepRequest(session_id=client.session_id, sequence=client.next_sequence, pool_id=POOL)
    huge.ops.add().add.token_ids = b"\x01\x00\x00\x00" * (300 * 1024)  # 1.2 MB > --max-message-mb 1
    with pytest.raises(grpc.RpcError) as info:
        env[2].Step(huge, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert pool_state(client) == before
    assert proc.proc.poll() is None  # still serving
