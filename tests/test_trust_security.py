"""Trust, second round (issue 22, items 1, 2, 3 and 9), over real `kvservice serve` processes with tokens
for two tenants and an admin: one unsharded server, and two shards on a real Redis.

1. A transfer source (ExternalSource) is a live pin of the caller's tenant on that pool, naming exactly its
   blocks and tokens; anything else (another tenant's pin, a pin never taken or already dropped, other
   blocks) is NOT_FOUND with one message, nothing applied — on one server and across shards.
2. A wrong-shard call for a pool the caller may not see answers exactly what an absent pool answers, on
   every shard, for every RPC that redirects; an admin still gets the redirect.
3. Pool ids are one namespace across kvservice and external pools and across shards: ALREADY_EXISTS.
9. The redirect's ErrorInfo reason is POOL_MOVED, as the proto and the docs say.
"""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import allocator_pb2_grpc as pb_grpc
from kvservice.allocator.pins import no_such_pin
from kvservice.client import KVServiceClient
from kvservice.client.routing import open_channel
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.errors import AlreadyExists, NotFound
from kvservice.hashing import spec_fingerprint
from kvservice.ops import AddRequestOp, AllocateOp, ExternalSource, FreeOp, OpStatus, PinOp, UnpinOp
from kvservice.wire import encode
from kvservice.wire.status import MOVED_REASON
from tests.cluster_helpers import start_shard
from tests.redis_helpers import RedisServer
from tests.service_helpers import REPO, start_server

TOKENS = "tok-alice alice\ntok-bob bob\ntok-admin ops admin\n"
CONFIG = KVCacheConfig(33, [FullAttentionSpec(16)])
PROMPT = list(range(100, 200))  # 6 full blocks cached; a pin of PROMPT + [1] holds 96 tokens
ENDPOINT = "tcp://127.0.0.1:1"  # an external pool's publisher (never reached: these tests only register)


def register(client: KVServiceClient, pool_id: str) -> None:
    client.register_pool(pool_id, CONFIG, max_model_len=512, kv_layout="block=16")


def cache_and_pin(client: KVServiceClient, pool_id: str, pin_id: str = "pin") -> list[int]:
    """Caches PROMPT in the pool and pins it: the pinned block ids."""
    client.step(pool_id, [AddRequestOp("warm", token_ids=PROMPT), AllocateOp("warm", num_new_tokens=100),
                          FreeOp("warm")])
    pin = client.step(pool_id, [PinOp(pin_id, token_ids=PROMPT + [1])])[0]
    assert pin.status == OpStatus.OK and pin.num_computed_tokens == 96
    return list(pin.new_block_ids[0])


def admit(client: KVServiceClient, pool_id: str, request_id: str, source: ExternalSource):
    return client.step(pool_id, [AddRequestOp(request_id, token_ids=PROMPT + [1]),
                                 AllocateOp(request_id, num_new_tokens=101, allow_transfer=True,
                                            external_source=source)])


def refuse_sources(client: KVServiceClient, pool_id: str, sources: list[ExternalSource]) -> None:
    """Each source refused NOT_FOUND with the one message, nothing applied (the request was not even added)."""
    for i, source in enumerate(sources):
        with pytest.raises(NotFound) as info:
            admit(client, pool_id, f"refused-{i}", source)
        assert info.value.message == no_such_pin(source)  # whatever was wrong
        with pytest.raises(NotFound):
            client.get_request(pool_id, f"refused-{i}")


def check_transfer_sources(alice: KVServiceClient, bob: KVServiceClient, alice_src: str, alice_dst: str,
                           bob_dst: str) -> None:
    """Alice pins a prompt on `alice_src`; every source but her live pin is refused, hers gets the order."""
    blocks = cache_and_pin(alice, alice_src)
    before = alice.get_stats().pools[alice_src].num_free_blocks
    refuse_sources(bob, bob_dst, [
        ExternalSource("pin", alice_src, blocks, 96),  # Alice's live pin, on Bob's word
        ExternalSource("never-taken", alice_src, blocks, 96),
        ExternalSource("pin", "no-such-pool", blocks, 96),
    ])
    refuse_sources(alice, alice_dst, [
        ExternalSource("never-taken", alice_src, blocks, 96),  # her own pool, a pin she never took
        ExternalSource("pin", alice_src, blocks[:-1], 80),  # fewer blocks than pinned
        ExternalSource("pin", alice_src, [b + 1 for b in blocks], 96),  # other blocks
        ExternalSource("pin", alice_src, blocks, 80),  # other tokens
        ExternalSource("pin", "no-such-pool", blocks, 96),
    ])
    assert alice.get_stats().pools[alice_src].num_free_blocks == before
    # Her live pin is a source: the order names exactly the pinned blocks.
    order = admit(alice, alice_dst, "ok", ExternalSource("pin", alice_src, blocks, 96))[1].transfer
    assert order is not None and order.src_pool_id == alice_src and order.src_block_ids == blocks
    assert alice.commit_transfer(alice_dst, order.transfer_id)[0].status == OpStatus.OK
    alice.free(alice_dst, "ok")
    # Once dropped, the pin is no source any more (its blocks may be reused).
    assert alice.step(alice_src, [UnpinOp("pin")])[0].status == OpStatus.OK
    refuse_sources(alice, alice_dst, [ExternalSource("pin", alice_src, blocks, 96)])


# ---- one server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("trust")
    (d / "tokens").write_text(TOKENS)
    proc = start_server("--token-file", str(d / "tokens"), log_dir=d)
    yield proc
    proc.stop()


def test_a_transfer_source_must_be_a_live_pin_of_the_callers_tenant(server):
    alice, bob = server.client("tok-alice"), server.client("tok-bob")
    for pool_id, owner in (("alice-p", alice), ("alice-q", alice), ("bob-p", bob)):
        register(owner, pool_id)
    check_transfer_sources(alice, bob, "alice-p", "alice-q", "bob-p")
    alice.close()
    bob.close()


def test_pool_ids_are_one_namespace_across_kinds_on_one_server(server):
    alice, bob = server.client("tok-alice"), server.client("tok-bob")
    alice.register_external_pool("one-ext", ENDPOINT)
    register(alice, "one-kv")
    for attempt in (lambda: register(alice, "one-ext"), lambda: register(bob, "one-ext"),
                    lambda: alice.register_external_pool("one-kv", ENDPOINT),
                    lambda: bob.register_external_pool("one-kv", ENDPOINT)):
        with pytest.raises(AlreadyExists, match="one namespace"):
            attempt()
    assert [h.pool_id for h in alice.lookup(PROMPT).hits].count("one-ext") == 1
    alice.remove_external_pool("one-ext")
    register(alice, "one-ext")  # a removed external pool's id is free again
    alice.close()
    bob.close()


# ---- two shards ----------------------------------------------------------------------------------
class Shards:
    def __init__(self, tmp) -> None:
        (tmp / "tokens").write_text(TOKENS)
        self.redis = RedisServer(tmp / "redis")
        self.redis.start()
        args = ("--token-file", str(tmp / "tokens"))
        self.procs = {s: start_shard(self.redis.url, s, tmp, *args, namespace="trust") for s in ("s0", "s1")}
        self.address = {s: p.target for s, p in self.procs.items()}

    def client(self, token: str, shard: str | None = None) -> KVServiceClient:
        target = self.address[shard] if shard else ",".join(self.address.values())
        return KVServiceClient(target, token, failover_timeout_s=10)

    def shard_of(self, pool_id: str) -> str:
        with self.client("tok-admin") as admin:
            return dict(admin.shard_map().pools)[pool_id]

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    s = Shards(tmp_path_factory.mktemp("trust-shards"))
    yield s
    s.stop()


def register_on(shards: Shards, client: KVServiceClient, pool_id: str, shard: str) -> None:
    """Registers the pool, then moves it to `shard` if the map put it elsewhere."""
    register(client, pool_id)
    where = shards.shard_of(pool_id)
    if where != shard:
        from kvservice.shards.rebalance import Rebalancer
        with shards.client("tok-admin") as admin:
            Rebalancer(admin).move(pool_id, where, shard, shards.address)
    assert shards.shard_of(pool_id) == shard


def test_a_cross_shard_transfer_source_must_be_a_live_pin_of_the_callers_tenant(shards):
    alice, bob = shards.client("tok-alice"), shards.client("tok-bob")
    register_on(shards, alice, "x-alice-p", "s0")
    register_on(shards, alice, "x-alice-q", "s1")
    register_on(shards, bob, "x-bob-p", "s1")
    check_transfer_sources(alice, bob, "x-alice-p", "x-alice-q", "x-bob-p")
    alice.close()
    bob.close()


class Raw:
    """One shard's stub with one tenant's token (no client-side routing: what that shard itself answers)."""

    def __init__(self, address: str, token: str) -> None:
        self.channel = open_channel(address)
        self.stub = pb_grpc.AllocatorStub(self.channel)
        self.md = (("authorization", f"Bearer {token}"),)
        self.session = self.stub.OpenSession(pb.OpenSessionRequest(client_name="raw"), metadata=self.md,
                                             timeout=10).session_id

    def refusal(self, method: str, request) -> tuple:
        """(code, message, rich details) of the refused call."""
        try:
            call = getattr(self.stub, method)(request, metadata=self.md, timeout=10)
            if method == "WatchEvents":
                next(iter(call))
        except grpc.RpcError as err:
            details = dict(err.trailing_metadata() or ()).get("grpc-status-details-bin")
            return err.code(), err.details(), details
        raise AssertionError(f"{method} was not refused")

    def requests(self, pool_id: str) -> dict:
        """A request of every RPC that names one pool (and so may redirect)."""
        s = self.session
        return {
            "GetRequest": pb.GetRequestRequest(pool_id=pool_id, request_id="r"),
            "Step": pb.StepRequest(session_id=s, sequence=1, pool_id=pool_id,
                                   ops=[pb.Op(free=pb.FreeOp(request_id="r"))]),
            "Allocate": pb.AllocateRequest(session_id=s, sequence=1, pool_id=pool_id,
                                           allocate=pb.AllocateOp(request_id="r", num_new_tokens=1)),
            "Free": pb.FreeRequest(session_id=s, sequence=1, pool_id=pool_id, request_ids=["r"]),
            "Fork": pb.ForkRequest(session_id=s, sequence=1, pool_id=pool_id, parent_request_id="r",
                                   child_request_ids=["c"]),
            "CommitTransfer": pb.CommitTransferRequest(session_id=s, sequence=1, pool_id=pool_id,
                                                       transfer_id="xfer-1"),
            "Lookup": pb.LookupRequest(pool_ids=[pool_id], token_ids=b"\x01\x00\x00\x00" * 32),
            "WatchEvents": pb.WatchEventsRequest(pool_ids=[pool_id]),
            "RegisterPool": encode.register_request(pool_id, CONFIG, 512, 0, 1, True, 0, "block=16",
                                                    spec_fingerprint(), None, None),
        }

    def register_external(self, pool_id: str) -> tuple | None:
        """RegisterExternalPool on this very shard: None, or its refusal."""
        request = pb.RegisterExternalPoolRequest(spec=pb.ExternalPoolSpec(pool_id=pool_id, endpoint=ENDPOINT,
                                                                          block_size=16, hash_algo="sha256"))
        try:
            self.stub.RegisterExternalPool(request, metadata=self.md, timeout=10)
        except grpc.RpcError as err:
            return err.code(), err.details()
        return None

    def close(self) -> None:
        self.channel.close()


def register_request(raw: Raw, request: pb.RegisterPoolRequest) -> pb.RegisterPoolRequest:
    request.session_id, request.sequence = raw.session, 1
    return request


def test_a_wrong_shard_answers_another_tenants_pool_as_absent(shards):
    alice = shards.client("tok-alice")
    register_on(shards, alice, "r-alice-p", "s0")
    bob = {s: Raw(a, "tok-bob") for s, a in shards.address.items()}
    registers = {}
    for shard, raw in bob.items():
        hidden, absent = raw.requests("r-alice-p"), raw.requests("r-nowhere")
        for method in hidden:
            if method == "RegisterPool":
                continue
            got = raw.refusal(method, hidden[method])
            want = raw.refusal(method, absent[method])
            # byte for byte what an absent pool of an id as long gets, the id aside
            assert got == (want[0], want[1].replace("r-nowhere", "r-alice-p"),
                           want[2] and want[2].replace(b"r-nowhere", b"r-alice-p")), (shard, method)
            assert got[0] == grpc.StatusCode.NOT_FOUND and shards.address["s0"] not in got[1]
        # Registering her id: PERMISSION_DENIED (the id is taken, nothing more), the same on both shards.
        registers[shard] = raw.refusal("RegisterPool", register_request(raw, hidden["RegisterPool"]))
    assert registers["s0"] == registers["s1"]
    assert registers["s1"][:2] == (grpc.StatusCode.PERMISSION_DENIED,
                                   "pool 'r-alice-p' belongs to another tenant; only it or an admin may re-register it")
    # Her own pool, and an admin: redirected (reason POOL_MOVED, metadata naming the shard).
    for token in ("tok-alice", "tok-admin"):
        raw = Raw(shards.address["s1"], token)
        for method, request in raw.requests("r-alice-p").items():
            if method == "RegisterPool":
                request = register_request(raw, request)
            code, message, details = raw.refusal(method, request)
            assert code == grpc.StatusCode.FAILED_PRECONDITION and shards.address["s0"] in message, (method, message)
            info = moved_info(details)
            assert info.reason == MOVED_REASON == "POOL_MOVED"
            assert dict(info.metadata) == {"pool_id": "r-alice-p", "shard_id": "s0", "address": shards.address["s0"]}
        raw.close()
    for raw in bob.values():
        raw.close()
    alice.close()


def moved_info(details: bytes) -> error_details_pb2.ErrorInfo:
    status = rpc_status.status_pb2.Status.FromString(details)
    info = error_details_pb2.ErrorInfo()
    assert len(status.details) == 1 and status.details[0].Unpack(info)
    return info


def test_the_redirect_reason_is_the_same_in_the_proto_the_readme_and_on_the_wire():
    proto = (REPO / "proto/kvservice/v1/allocator.proto").read_text()
    # The README's scaling-out section lives on the docs site's page now.
    docs = (REPO / "README.md").read_text() + (REPO / "docs/operations/scaling.md").read_text()
    assert f"reason {MOVED_REASON}" in proto and f"reason `{MOVED_REASON}`" in docs
    assert "reason `MOVED`" not in docs


def test_pool_ids_are_one_namespace_across_kinds_and_shards(shards):
    alice, bob = shards.client("tok-alice"), shards.client("tok-bob")
    raw = {(s, t): Raw(a, t) for s, a in shards.address.items() for t in ("tok-alice", "tok-bob")}
    assert raw["s1", "tok-alice"].register_external("n-ext") is None  # it lives on the shard that subscribes
    # A kvservice pool may not take its id, whichever shard the registration reaches, whoever asks.
    for client in (alice, bob, shards.client("tok-alice", "s0"), shards.client("tok-bob", "s0")):
        with pytest.raises(AlreadyExists, match="one namespace"):
            register(client, "n-ext")
    # Nor another shard's external pool; nor an external pool a kvservice pool's id, on either shard.
    register_on(shards, alice, "n-kv", "s0")
    taken = [raw["s0", "tok-alice"].register_external("n-ext"), raw["s0", "tok-bob"].register_external("n-ext")]
    taken += [raw[s, t].register_external("n-kv") for s, t in raw]
    for refusal in taken:
        assert refusal is not None and refusal[0] == grpc.StatusCode.ALREADY_EXISTS and "one namespace" in refusal[1]
    with shards.client("tok-admin") as admin:
        pools = admin.shard_map().pools
        assert "n-ext" not in pools and pools["n-kv"] == "s0"
        assert [h.pool_id for h in admin.lookup(PROMPT).hits].count("n-ext") == 1
    # Removing the external pool frees its id, for either kind on any shard.
    raw["s1", "tok-alice"].stub.RemoveExternalPool(pb.RemoveExternalPoolRequest(pool_id="n-ext"),
                                                   metadata=raw["s1", "tok-alice"].md, timeout=10)
    assert raw["s0", "tok-alice"].register_external("n-ext") is None
    raw["s0", "tok-alice"].stub.RemoveExternalPool(pb.RemoveExternalPoolRequest(pool_id="n-ext"),
                                                   metadata=raw["s0", "tok-alice"].md, timeout=10)
    register(alice, "n-ext")
    for r in raw.values():
        r.close()
    alice.close()
    bob.close()


def test_a_step_trusts_remote_sources_only_where_they_were_checked():
    """(Review of item 1.) A Step as decoded from a request does not trust its sources on other shards' pools
    (the default is the safe value: a path that forgets to check them refuses them); one decoded from the
    WAL does, as it was journaled only after the check."""
    from kvservice.commands import StepRpc
    from kvservice.store import wal
    from kvservice.wire.decode import step_command

    request = pb.StepRequest(session_id="s", sequence=1, pool_id="p")
    command = step_command(StepRpc.STEP, request, request.SerializeToString(), "alice")
    assert command.remote_sources_checked is False
    assert wal.decode(wal.encode(command), 16).remote_sources_checked is True
