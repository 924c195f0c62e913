"""Hash specs on the wire: a pool declares vLLM's chain at RegisterPool (32-byte sha256 hashes travel as they
are), the fingerprint handshake names both specs on a mismatch, tenants stay apart with 32-byte hashes, and
the WAL and snapshots carry the spec (replay and restore reach the same state, block for block)."""

import pytest

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.client.base import Call
from kvservice.commands import StepRpc
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.errors import Code, FailedPrecondition, InvalidArgument, KVServiceError
from kvservice.hashing import HashSpec
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, OpStatus
from kvservice.store import wal
from kvservice.store.snapshot import dump, load, state_digest
from kvservice.wire import decode, encode, replies
from tests.service_helpers import small_config, start_server

TOKENS = "tok-a tenant-a\ntok-b tenant-b\ntok-admin ops admin\n"
SHA = HashSpec("sha256")
# vLLM 0.33.0's own sha256 hash of block 0 = tokens 0..15 (README "Hash specs").
SHA_BLOCK0 = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"


def chain(spec: HashSpec, tokens: list[int], block: int = 16) -> list[bytes]:
    out, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % block, block):
        parent = spec.hash_block(parent, tokens[i:i + block])
        out.append(parent)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("hash-specs")
    (d / "tokens").write_text(TOKENS)
    proc = start_server("--token-file", str(d / "tokens"), log_dir=d)
    yield proc
    proc.stop()


def test_a_sha256_pool_takes_vllms_hashes_as_they_are(server):
    a = server.client("tok-a")
    reply = a.register_pool("sha", small_config(33, 16), max_model_len=512, hash_spec=SHA)
    assert (reply.hash_algorithm, reply.hash_fingerprint) == ("sha256", SHA.fingerprint())
    prompt = list(range(64))
    hashes = chain(SHA, prompt)
    assert hashes[0].hex() == SHA_BLOCK0 and len(hashes) == 4 and all(len(h) == 32 for h in hashes)
    r = a.step("sha", [AddRequestOp("by-hashes", block_hashes=hashes, num_tokens=64),
                       AllocateOp("by-hashes", num_new_tokens=64)])
    assert [x.status for x in r.results] == [OpStatus.OK, OpStatus.OK] and r[1].new_block_ids == ([1, 2, 3, 4],)
    # The server hashes token-added requests of this pool in its spec too: they hit the blocks above.
    r = a.step("sha", [AddRequestOp("by-tokens", token_ids=prompt + [7]), AllocateOp("by-tokens", num_new_tokens=65)])
    assert r[1].num_computed_tokens == 64 and r[1].new_block_ids == ([1, 2, 3, 4, 5],)
    # Lookup in either form: by 32-byte hashes, or by tokens (hashed in each pool's own spec).
    assert a.lookup(block_hashes=hashes, num_tokens=65, pool_ids=["sha"]).tokens("sha") == 64
    assert a.lookup(prompt + [1], pool_ids=["sha"]).tokens("sha") == 64
    # Appends carry 32-byte hashes too; 16-byte ones are refused, naming the field.
    more = chain(SHA, prompt + list(range(100, 116)))[4:]
    r = a.step("sha", [AllocateOp("by-hashes", num_computed_tokens=64, num_new_tokens=16,
                                  append_block_hashes=more, num_append_tokens=16)])
    assert r[0].status == OpStatus.OK and r[0].new_block_ids == ([6],)
    with pytest.raises(InvalidArgument, match="32 bytes each") as err:
        a.step("sha", [AddRequestOp("short", block_hashes=[h[:16] for h in hashes[:3]], num_tokens=48)])
    assert err.value.field == "ops[0].add.block_hashes"
    a.free("sha", "by-hashes", "by-tokens")
    stats = a.get_stats().pools["sha"]
    assert stats.num_free_blocks == 32 and stats.num_cached_blocks == 5
    a.close()


def test_fingerprint_and_respecified_pools_are_refused_naming_both(server):
    a = server.client("tok-a")
    # A spec hashed at another block size than the allocator's (16): the fingerprints differ.
    wrong = HashSpec("sha256", None, 32).fingerprint()
    msg = encode.register_request("fp", small_config(9, 16), 256, 0, 1, True, 0, "", wrong, SHA)
    with pytest.raises(FailedPrecondition) as err:
        register_raw(a, msg)
    assert wrong in str(err.value) and SHA.fingerprint() in str(err.value)
    a.register_pool("respec", small_config(9, 16), max_model_len=256, hash_spec=SHA)
    with pytest.raises(FailedPrecondition, match="registered at epoch 0 with hash spec") as err:
        a.register_pool("respec", small_config(9, 16), max_model_len=256, hash_spec=HashSpec("xxhash"))
    assert SHA.fingerprint() in str(err.value) and HashSpec("xxhash").fingerprint() in str(err.value)
    # Another epoch is new memory: the spec may change with it.
    reply = a.register_pool("respec", small_config(9, 16), max_model_len=256, epoch=1, hash_spec=HashSpec("xxhash"))
    assert reply.new_epoch and reply.hash_algorithm == "xxhash"
    msg = encode.register_request("bad", small_config(9, 16), 256, 0, 1, True, 0, "", "0" * 16, SHA)
    msg.hash_spec.algorithm = "md5"
    with pytest.raises(InvalidArgument, match="hash_spec.algorithm") as err:
        register_raw(a, msg)
    assert err.value.field == "hash_spec.algorithm"
    a.close()


def register_raw(client, msg: pb.RegisterPoolRequest):
    return client._run(Call("RegisterPool", msg, replies.decode_register_result, True, msg.pool_id))


def test_tenants_stay_apart_with_32_byte_hashes(server):
    """A hash is namespaced as `hash || tenant` whatever its length: the same 32-byte hashes in one pool,
    from its owner and from an admin's tenant, never hit each other, and each tenant's events come back in
    its own raw hashes (the tenant read after 32 bytes, not 16)."""
    a, admin, b = server.client("tok-a"), server.client("tok-admin"), server.client("tok-b")
    a.register_pool("shared", small_config(33, 16), max_model_len=512, hash_spec=SHA)
    b.register_pool("b-sha", small_config(33, 16), max_model_len=512, hash_spec=SHA)
    prompt = list(range(200, 264))
    hashes = chain(SHA, prompt)
    start = a.get_stats().event_sequence + 1
    r = a.step("shared", [AddRequestOp("r", block_hashes=hashes, num_tokens=64), AllocateOp("r", num_new_tokens=64)])
    assert r[1].new_block_ids == ([1, 2, 3, 4],)
    r = admin.step("shared", [AddRequestOp("r", block_hashes=hashes, num_tokens=64),
                              AllocateOp("r", num_new_tokens=64)])
    assert r[1].num_computed_tokens == 0 and r[1].new_block_ids == ([5, 6, 7, 8],)
    r = b.step("b-sha", [AddRequestOp("r", block_hashes=hashes, num_tokens=64), AllocateOp("r", num_new_tokens=64)])
    assert r[1].num_computed_tokens == 0
    seen_by_b = b.lookup(block_hashes=hashes)
    assert seen_by_b.tokens("b-sha") == 48 and [h.pool_id for h in seen_by_b.hits] == ["b-sha"]
    seen = _drain(a, "shared", start)
    assert [e.kind for e in seen] == ["stored"] and seen[0].block_hashes == hashes
    assert set(seen[0].block_ids) == {1, 2, 3, 4}  # tenant-a's own; the admin's tenant's blocks are not shown
    admin.free("shared", "r")
    a.free("shared", "r")
    b.free("b-sha", "r")
    for c in (a, admin, b):
        c.close()


def _drain(client, pool_id, start):
    out = []
    try:
        for e in client.watch_events([pool_id], start_sequence=start, timeout_s=2):
            out.append(e)
    except KVServiceError as exc:
        assert exc.code == Code.DEADLINE_EXCEEDED
    return out


def test_wal_replay_and_snapshots_keep_the_spec():
    """Commands as the servicer decodes them, journaled and replayed into a second allocator, and a snapshot
    restored into a third: all three reach the same state digest; the restored pool still takes 32-byte
    hashes and hashes appended tokens in vLLM's spec."""
    leader, replica = Allocator(), Allocator()
    session = pb.OpenSessionRequest(client_name="t")
    open_cmd = decode.open_session_command(session, "s", "", True)
    for a in (leader, replica):
        a.apply(open_cmd, 0.0)
    seq = iter(range(1, 100))
    reg = encode.register_request("p", KVCacheConfig(17, [FullAttentionSpec(16)]), 256, 0, 1, True, 0, "",
                                  SHA.fingerprint(), SHA)
    reg.session_id, reg.sequence = "s", next(seq)
    commands = [decode.register_command(reg, reg.SerializeToString(), "", True, 16)]
    prompt = list(range(40))
    for ops in ([AddRequestOp("x", block_hashes=chain(SHA, prompt), num_tokens=40), AllocateOp("x", num_new_tokens=40)],
                [AddRequestOp("y", token_ids=prompt), AllocateOp("y", num_new_tokens=40)],
                [FreeOp("x")]):
        msg = encode.step_request("p", ops)
        msg.session_id, msg.sequence = "s", next(seq)
        commands.append(decode.step_command(StepRpc.STEP, msg, msg.SerializeToString(), "", True))
    for command in commands:
        leader.apply(command, 0.0)
        replica.apply(wal.decode(wal.encode(command), 16), 0.0)
    assert state_digest(leader) == state_digest(replica)
    assert leader.state.pools["p"].hash_spec == SHA and replica.state.pools["p"].hash_spec == SHA
    restored = Allocator()
    load(dump(leader), restored, 0.0)
    assert state_digest(restored) == state_digest(leader)
    pool = restored.state.pools["p"]
    assert pool.hash_spec == SHA and pool.requests["y"].hash_spec == SHA
    y = pool.requests["y"]
    y.append_output_token_ids(list(range(40, 48)))
    assert y.block_hashes == chain(SHA, list(range(48)))
