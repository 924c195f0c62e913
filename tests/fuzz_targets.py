"""Fuzz target for the request decoding and validation paths, without gRPC.

An input is a 4-byte header and a serialized request: `[method, who, sequence, pool] + proto bytes`.
`run_one` parses the bytes with the servicer's own `parse` and calls the servicer's method body (the
`rpc` wrapper, which would turn a bug into an INTERNAL status, is skipped) against a module-level
allocator holding two sessions (two tenants, one with a block quota) and three small pools (full
attention, its transfer peer, hybrid full + sliding window) with running, waiting, forked and
transferring requests. The header bytes steer the call onto live state: most calls carry a real session
and its next sequence number, so mutations really apply. The allocator is rebuilt every `RESET_EVERY`
calls so it stays small.

The contract (`FuzzCrash` when broken): only `KVServiceError` subclasses escape, with a message, and an
`InvalidArgument` names a field of the request; a rejected call changes no state (`state_digest`); a read
changes none either; a retried mutation answers the stored reply; the state still encodes (as WAL
snapshots and GetStats encode it); every pool keeps its block invariants. A crash can depend on the
calls since the last rebuild, so `history()` lists them and `replay` re-runs them from a fresh allocator
(regression files in the `SEQUENCE_MAGIC` format).
"""

from __future__ import annotations

import inspect
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from unittest import mock

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.core import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec
from kvservice.errors import InvalidArgument, KVServiceError
from kvservice.hashing import MultiModalItem, spec_fingerprint
from kvservice.ops import AddRequestOp, AdmitBatchOp, AllocateOp, DecodeBatchOp, ForkOp, FreeOp
from kvservice.server import servicer as servicer_module
from kvservice.server.auth import Authenticator, Principal
from kvservice.server.metrics import Metrics
from kvservice.server.servicer import AllocatorServicer, parse
from kvservice.store.snapshot import state_digest
from kvservice.wire import encode
from kvservice.wire.encode import encode_add
from kvservice.wire.fields import encode_u32

METHODS = ("Step", "Allocate", "Free", "Fork", "RegisterPool", "CommitTransfer", "Lookup", "GetRequest",
           "OpenSession", "ResetPrefixCache", "Heartbeat", "GetStats")
MUTATING = {"Step", "Allocate", "Free", "Fork", "RegisterPool", "CommitTransfer"}
READS = {"Lookup", "GetRequest", "Heartbeat", "GetStats"}
HEADER = 4
POOLS = ("full", "full-b", "hybrid")
TOKENS = {"tok-admin": Principal("", True), "tok-acme": Principal("acme", False)}
RESET_EVERY = 32
MAX_POOL_BLOCKS = 256  # RegisterPool builds num_blocks block objects; the fuzzer keeps pools small
NOW = 1000.0
SEQUENCE_MAGIC = b"KVFUZZSEQ1\n"
PROMPT = list(range(1, 81))  # 80 tokens: 5 full blocks of 16
QUOTA = 8  # blocks for tenant "acme", which holds 2


class FuzzCrash(AssertionError):
    """The contract was broken (the cause, when an exception, is chained)."""


@dataclass(slots=True)
class _Context:
    """What the servicer reads of a gRPC context: the caller's metadata."""

    metadata: tuple[tuple[str, str], ...]

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


class Fixture:
    """An allocator behind a servicer, with live sessions, pools and requests."""

    def __init__(self) -> None:
        self.allocator = Allocator(quotas={"acme": QUOTA}, min_transfer_tokens=16)
        self.servicer = AllocatorServicer(self.allocator, Authenticator(TOKENS), Metrics(self.allocator),
                                          clock=lambda: NOW)
        self.tokens = {"": "tok-admin", "acme": "tok-acme"}
        admin = self.open("tok-admin")
        acme = self.open("tok-acme")
        full = KVCacheConfig(20, [FullAttentionSpec(16)])  # 12 blocks free: long lookaheads get NO_SPACE
        hybrid = KVCacheConfig(48, [FullAttentionSpec(16), SlidingWindowSpec(16, 32)])
        for pool_id, config, vocab in (("full", full, 1000), ("full-b", full, 1000), ("hybrid", hybrid, 0)):
            msg = encode.register_request(pool_id, config, 256, 0, 1, True, vocab, "nhd",
                                               self.allocator.fingerprint)
            self.mutate(admin, "RegisterPool", msg)
        self.step(admin, "full", [AddRequestOp("r0", token_ids=PROMPT), AllocateOp("r0", num_new_tokens=80),
                                  AddRequestOp("r1", token_ids=list(range(20))), ForkOp("r0", "c0")])
        # The same prompt on the peer pool adopts full's cached prefix: transfer xfer-1 stays pending.
        self.step(admin, "full-b", [AddRequestOp("x0", token_ids=[*PROMPT, 7, 8]),
                                    AllocateOp("x0", num_new_tokens=82, allow_transfer=True),
                                    AddRequestOp("b0", token_ids=list(range(40))), AllocateOp("b0", 0, 40)])
        self.step(admin, "hybrid", [AddRequestOp("h0", token_ids=list(range(50))), AllocateOp("h0", 0, 50),
                                    AddRequestOp("h1", block_hashes=[bytes([i]) * 16 for i in range(1, 3)],
                                                 num_tokens=40),
                                    AllocateOp("h1", 0, 40), AddRequestOp("r1", token_ids=list(range(20)))])
        # acme's own pool (a pool belongs to its tenant): where its quota applies.
        self.mutate(acme, "RegisterPool", encode.register_request("acme-pool", full, 256, 0, 1, True, 1000, "nhd",
                                                                  self.allocator.fingerprint))
        self.step(acme, "acme-pool", [AddRequestOp("r0", token_ids=PROMPT[:24]), AllocateOp("r0", 0, 24)])
        for pool in self.allocator.state.pools.values():
            if self.allocator.invariant_violation(pool):
                raise AssertionError(self.allocator.invariant_violation(pool))
        if "xfer-1" not in self.allocator.state.transfers.transfers:
            raise AssertionError("the fixture's transfer did not open")

    def open(self, token: str) -> str:
        reply = call(self.servicer, "OpenSession", pb.OpenSessionRequest(client_name="fuzz"), _auth(token))
        return reply.session_id

    def mutate(self, session_id: str, method: str, msg) -> object:
        session = self.allocator.state.sessions.sessions[session_id]
        msg.session_id, msg.sequence = session_id, session.last_sequence + 1
        return call(self.servicer, method, msg, _auth(self.tokens[session.tenant]))

    def step(self, session_id: str, pool_id: str, ops) -> None:
        reply = self.mutate(session_id, "Step", encode.step_request(pool_id, ops))
        bad = [r for r in reply.results if r.status != pb.OK]
        if bad:
            raise AssertionError(f"fixture step failed: {bad}")


def _auth(token: str | None) -> _Context:
    return _Context((("authorization", f"Bearer {token}"),) if token else ())


def call(servicer: AllocatorServicer, method: str, request, context: _Context):
    """The servicer's method body, driven to completion (with the null journal nothing awaits)."""
    body = getattr(AllocatorServicer, method).__wrapped__
    args = (servicer, request, context)
    if "raw" in inspect.signature(body).parameters:  # a mutation: it also gets the bytes the WAL keeps
        args += (request.SerializeToString(),)
    coro = body(*args)
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise FuzzCrash(f"{method} suspended: the fuzz target has no event loop")


_fixture: Fixture | None = None
_calls = 0
_history: list[bytes] = []
_outcome = ""


def _no_gc_freeze():
    """The servicer freezes the heap after a new pool (a server's pools live long); thousands of fuzz pools
    would pile up in the permanent generation, each freeze after a full collection."""
    return mock.patch.object(servicer_module, "freeze_long_lived", lambda: None)


def reset() -> Fixture:
    """A fresh fixture state (and an empty history)."""
    global _fixture, _calls
    with _no_gc_freeze():
        _fixture = Fixture()
    _calls = 0
    _history.clear()
    return _fixture


def history() -> list[bytes]:
    """The inputs run since the last reset, oldest first (the last one included)."""
    return list(_history)


def last_outcome() -> str:
    """How the last call ended: "OK", or the gRPC status name it was rejected with ("" when too short)."""
    return _outcome


def steer(fixture: Fixture, method: str, who: int, seq: int, pool: int, request) -> _Context:
    """Points the request at live state as the header bytes say; returns the caller's context."""
    sessions = list(fixture.allocator.state.sessions.sessions.values())
    session = sessions[(who & 3) % len(sessions)] if sessions and who & 3 != 3 else None
    tenant = session.tenant if session is not None else ""
    if who & 4:
        tenant = "acme" if tenant == "" else ""
    context = _auth(None if who & 0xF0 == 0xF0 else fixture.tokens.get(tenant))
    if session is not None and hasattr(request, "session_id"):
        request.session_id = session.session_id
    elif session is not None and method == "OpenSession" and who & 8:
        request.resume_session_id = session.session_id
    if session is not None and method in MUTATING:
        if seq < 200:
            request.sequence = session.last_sequence + 1
        elif seq < 230:
            request.sequence = session.last_sequence
    if pool & 3 and hasattr(request, "pool_id") and pool < 0xF0:
        request.pool_id = POOLS[(pool & 3) - 1]
    if method == "RegisterPool" and MAX_POOL_BLOCKS < request.config.num_blocks <= 1 << 31:
        request.config.num_blocks = 2 + request.config.num_blocks % (MAX_POOL_BLOCKS - 1)
    return context


def _check_error(method: str, request, exc: BaseException) -> None:
    if not isinstance(exc, KVServiceError):
        raise FuzzCrash(f"{method}: {type(exc).__name__}: {exc}") from exc
    if not exc.message or not str(exc):
        raise FuzzCrash(f"{method}: {type(exc).__name__} without a message") from exc
    if exc.code == KVServiceError.code:
        raise FuzzCrash(f"{method}: a bare KVServiceError maps to INTERNAL: {exc.message}") from exc
    if isinstance(exc, InvalidArgument):
        field = exc.field
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not field or not exc.message.startswith(f"{field} = "):
            raise FuzzCrash(f"{method}: InvalidArgument names no field: {exc.message!r}") from exc
        if root != "request" and root not in request.DESCRIPTOR.fields_by_name:
            raise FuzzCrash(f"{method}: InvalidArgument names {field!r}, not a field of "
                            f"{request.DESCRIPTOR.name}: {exc.message!r}") from exc


def _digest(fixture: Fixture, method: str) -> str:
    try:
        return state_digest(fixture.allocator)
    except Exception as exc:  # what the WAL snapshots and GetStats encode
        raise FuzzCrash(f"after {method}: the state no longer encodes: {type(exc).__name__}: {exc}") from exc


def _check_invariants(fixture: Fixture, method: str) -> None:
    allocator = fixture.allocator
    for pool in allocator.state.pools.values():
        violation = allocator.invariant_violation(pool)
        if violation:
            raise FuzzCrash(f"after {method}: pool {pool.pool_id!r}: {violation}")


def run_one(data: bytes) -> None:
    """Interprets `data` as one call (see the module docstring); raises FuzzCrash when the contract breaks."""
    global _calls, _outcome
    if _fixture is None or _calls >= RESET_EVERY:
        reset()
    fixture = _fixture
    _calls += 1
    _history.append(bytes(data))
    _outcome = ""
    if len(data) < HEADER:
        return
    method = METHODS[data[0] % len(METHODS)]
    raw = bytes(data[HEADER:])
    before = _digest(fixture, "the previous call")
    try:
        request = parse(method, raw)
    except KVServiceError as exc:
        _outcome = exc.code.name
        _check_error(method, pb.StepRequest(), exc)
        return
    context = steer(fixture, method, data[1], data[2], data[3], request)
    with _no_gc_freeze():
        try:
            reply = call(fixture.servicer, method, request, context)
        except FuzzCrash:
            raise
        except Exception as exc:
            _check_error(method, request, exc)
            _outcome = exc.code.name
            if _digest(fixture, method) != before:
                raise FuzzCrash(f"{method} was rejected ({exc}) but changed the state") from exc
            _check_invariants(fixture, method)
            return
        try:
            encoded = reply.SerializeToString()
        except Exception as exc:
            raise FuzzCrash(f"{method}: the reply does not serialize: {exc}") from exc
        _outcome = "OK"
        _check_invariants(fixture, method)
        after = _digest(fixture, method)
        if method in READS and after != before:
            raise FuzzCrash(f"{method} is a read but changed the state")
        if method in MUTATING and hasattr(request, "sequence"):
            _check_retry(fixture, method, request, context, encoded, after)


def _check_retry(fixture: Fixture, method: str, request, context: _Context, encoded: bytes, digest: str) -> None:
    """A retried mutation (same sequence) answers the stored reply and changes nothing."""
    session = fixture.allocator.state.sessions.sessions.get(request.session_id)
    if session is None or session.last_sequence != request.sequence:
        return
    try:
        again = call(fixture.servicer, method, request, context).SerializeToString()
    except Exception as exc:
        raise FuzzCrash(f"{method}: the retry of sequence {request.sequence} failed: {exc}") from exc
    if again != encoded:
        raise FuzzCrash(f"{method}: the retry of sequence {request.sequence} answered another reply")
    if _digest(fixture, method) != digest:
        raise FuzzCrash(f"{method}: the retry of sequence {request.sequence} changed the state")


# ---- inputs --------------------------------------------------------------------------------------
def encode_input(method: str, request, who: int = 0, seq: int = 0, pool: int = 0) -> bytes:
    """One input: the header (defaults: first session, its next sequence, the request's own pool id)."""
    return bytes([METHODS.index(method), who, seq, pool]) + request.SerializeToString()


def encode_sequence(inputs: Iterable[bytes]) -> bytes:
    """Several inputs run in order from a fresh fixture (a crash that needs the calls before it)."""
    return SEQUENCE_MAGIC + b"".join(struct.pack("<I", len(d)) + d for d in inputs)


def decode_file(data: bytes) -> list[bytes]:
    """The inputs of a corpus or regression file: a sequence file, or a single input."""
    if not data.startswith(SEQUENCE_MAGIC):
        return [data]
    out, i = [], len(SEQUENCE_MAGIC)
    while i + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, i)
        out.append(data[i + 4:i + 4 + n])
        i += 4 + n
    return out


def replay(inputs: Iterable[bytes], run: Callable[[bytes], None] = run_one) -> None:
    """Runs inputs in order from a fresh fixture."""
    reset()
    for data in inputs:
        run(data)


def seed_inputs() -> dict[str, bytes]:
    """Valid requests for every method, built with the client's message builders: where fuzzing starts."""
    step = encode.step_request
    hashes = [bytes([i]) * 16 for i in range(3, 6)]
    add = pb.AllocateRequest(pool_id="full")
    encode_add(AddRequestOp("n1", token_ids=[5, 6, 7, 8] * 5, cache_salt="s", lora_name="l"), add.add)
    add.allocate.request_id, add.allocate.num_new_tokens = "n1", 20
    decode = pb.Op()
    decode.decode.request_ids.extend(["r0", "c0"])
    decode.decode.num_computed_tokens = encode_u32([80, 80])
    decode.decode.append_token_ids = encode_u32([9, 10])
    lookup = pb.LookupRequest(token_ids=encode_u32(PROMPT), pool_ids=["full", "full-b"])
    fingerprint = spec_fingerprint()
    register = encode.register_request("extra", KVCacheConfig(8, [FullAttentionSpec(16)]), 64, 0, 1, True, 0,
                                            "", fingerprint)
    chunked = encode.register_request("hybrid", KVCacheConfig(24, [FullAttentionSpec(32),
                                                                       SlidingWindowSpec(16, 64),
                                                                       ChunkedLocalAttentionSpec(16, 64),
                                                                       MambaSpec(16)]), 128, 1, 1, True, 0, "",
                                           fingerprint)
    dcp = encode.register_request("full", KVCacheConfig(16, [FullAttentionSpec(16)]), 256, 1, 2, False, 1000,
                                       "nhd", fingerprint)
    seeds = {
        "step-add-allocate": encode_input("Step", step("full", [AddRequestOp("n0", token_ids=list(range(30))),
                                                               AllocateOp("n0", 0, 30, num_lookahead_tokens=2)])),
        "step-decode": encode_input("Step", step("full", [AllocateOp("r0", 80, 1, append_token_ids=[3])])),
        "step-decode-batch": encode_input("Step", pb.StepRequest(pool_id="full", ops=[decode])),
        "step-admit-batch": encode_input("Step", step("full", [AdmitBatchOp(
            ["n2", "n3", "r0"], [list(range(40)), list(range(36)) + [7], [1]], [40, 20, 1], 1, ["s", "", ""],
            None)])),
        "step-hashes": encode_input("Step", step("hybrid", [
            AddRequestOp("hn", block_hashes=hashes, num_tokens=50), AllocateOp("hn", 0, 50),
            AllocateOp("h1", 40, 16, append_block_hashes=[b"\x09" * 16], num_append_tokens=16)])),
        "step-fork-free": encode_input("Step", step("full", [ForkOp("r0", "c1"), FreeOp("c1"), FreeOp("r1")])),
        "step-mm": encode_input("Step", step("hybrid", [AddRequestOp("m0", token_ids=list(range(40)),
                                                                      mm_items=(MultiModalItem("img", 4, 8),))])),
        "step-decode-op": encode_input("Step", step("hybrid", [DecodeBatchOp(["h0"], [50], [11], 1, 0)])),
        "allocate-add": encode_input("Allocate", add),
        "allocate-transfer": encode_input("Allocate", encode.allocate_request(
            "full-b", AllocateOp("y0", 0, 84, allow_transfer=True), AddRequestOp("y0", token_ids=[*PROMPT, 1, 2, 3,
                                                                                                   4]))),
        "free": encode_input("Free", pb.FreeRequest(pool_id="full", request_ids=["r1", "c0"])),
        "fork": encode_input("Fork", pb.ForkRequest(pool_id="hybrid", parent_request_id="h0",
                                                    child_request_ids=["h2", "h3"])),
        "fork-not-running": encode_input("Step", step("full-b", [ForkOp("x0", "x1"), ForkOp("b0", "b0"),
                                                                  ForkOp("nope", "x2")])),
        "step-no-space": encode_input("Step", step("full", [AllocateOp("r0", 80, 1, [5], num_lookahead_tokens=256),
                                                            ForkOp("r1", "r2"), AllocateOp("r1", 0, 20)])),
        "step-quota": encode_input("Step", step("acme-pool", [AddRequestOp("q0", token_ids=list(range(200))),
                                                              AllocateOp("q0", 0, 200)]), who=1),
        "register": encode_input("RegisterPool", register),
        "register-new-epoch": encode_input("RegisterPool", chunked),
        "register-dcp": encode_input("RegisterPool", dcp),
        "commit": encode_input("CommitTransfer", pb.CommitTransferRequest(pool_id="full-b", transfer_id="xfer-1")),
        "abort": encode_input("CommitTransfer", pb.CommitTransferRequest(pool_id="full-b", transfer_id="xfer-1",
                                                                         abort=True)),
        "lookup": encode_input("Lookup", lookup),
        "lookup-hashes": encode_input("Lookup", pb.LookupRequest(block_hashes=b"".join(hashes), num_tokens=50)),
        "get-request": encode_input("GetRequest", pb.GetRequestRequest(pool_id="hybrid", request_id="h0")),
        "open-session": encode_input("OpenSession", pb.OpenSessionRequest(client_name="c", resume_session_id="x",
                                                                          last_acked_sequence=3,
                                                                          resume_pool_ids=["hybrid"])),
        "resume-session": encode_input("OpenSession", pb.OpenSessionRequest(resume_session_id="x",
                                                                            last_acked_sequence=9), who=8),
        "reset": encode_input("ResetPrefixCache", pb.ResetPrefixCacheRequest(pool_ids=["full"])),
        "heartbeat": encode_input("Heartbeat", pb.HeartbeatRequest()),
        "stats": encode_input("GetStats", pb.GetStatsRequest(check_invariants=True, include_state_digest=True)),
    }
    return seeds
