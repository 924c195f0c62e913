"""Commands <-> WAL entries. A sequenced command keeps its request bytes as they arrived (decoded again on
replay by the same `kvservice.wire.decode` the servicer uses), the others their few fields. Entries written
before commands had kind numbers are read too (`legacy_kind`)."""

from __future__ import annotations

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import state_pb2 as st
from kvservice.commands import (
    Barrier,
    Command,
    CommandKind,
    DropPool,
    ExpireSessions,
    FreezePool,
    ImportPool,
    IngestEvents,
    OpenSession,
    RegisterExternalPool,
    RegisterPool,
    RemoveExternalPool,
    ResetPrefixCache,
    RetirePools,
    StepRpc,
    ThawPool,
)
from kvservice.external.wire import spec_from_proto, spec_to_proto
from kvservice.wire.decode import STEP_REQUESTS, commit_transfer_command, step_command
from kvservice.wire.pool_spec import decode_pool_spec

_LEGACY_STEPS = {"step": StepRpc.STEP, "allocate": StepRpc.ALLOCATE, "free": StepRpc.FREE, "fork": StepRpc.FORK}


def encode(command: Command) -> bytes:
    kind = command.kind
    entry = st.WalEntry(command=kind)
    if kind in (CommandKind.STEP, CommandKind.REGISTER_POOL, CommandKind.COMMIT_TRANSFER):
        entry.session_id, entry.tenant, entry.request, entry.admin = (command.session_id, command.tenant,
                                                                      command.wire, command.admin)
        if kind is CommandKind.STEP:
            entry.rpc = command.rpc
    elif kind is CommandKind.OPEN_SESSION:
        entry.session_id, entry.tenant, entry.client_name = command.session_id, command.tenant, command.client_name
        entry.resume_session_id, entry.last_acked_sequence = command.resume_session_id, command.last_acked_sequence
        entry.pool_ids.extend(command.resume_pool_ids)
        entry.admin, entry.attach = command.admin, command.attach
    elif kind is CommandKind.EXPIRE_SESSIONS:
        entry.session_ids.extend(command.session_ids)
    elif kind in (CommandKind.RESET_PREFIX_CACHE, CommandKind.RETIRE_POOLS):
        entry.pool_ids.extend(command.pool_ids)
    elif kind is CommandKind.BARRIER:
        entry.resync = command.resync
    elif kind in (CommandKind.FREEZE_POOL, CommandKind.THAW_POOL, CommandKind.DROP_POOL, CommandKind.IMPORT_POOL):
        entry.pool_ids.append(command.pool_id)
        if kind is CommandKind.FREEZE_POOL:
            entry.shard_id = command.to_shard
        elif kind is CommandKind.IMPORT_POOL:
            entry.pool_export = command.export
    elif kind is CommandKind.INGEST_EVENTS:
        ingest = entry.ingest
        ingest.pool_id, ingest.registration, ingest.reset = command.pool_id, command.registration, command.reset
        ingest.sequences.extend(s for s, _ in command.frames)
        ingest.payloads.extend(p for _, p in command.frames)
    elif kind is CommandKind.REGISTER_EXTERNAL_POOL:
        entry.tenant, entry.admin = command.tenant, command.admin
        entry.request = spec_to_proto(command.spec).SerializeToString(deterministic=True)
    elif kind is CommandKind.REMOVE_EXTERNAL_POOL:
        entry.tenant, entry.admin = command.tenant, command.admin
        entry.pool_ids.append(command.pool_id)
    return entry.SerializeToString()


def decode(raw: bytes, hash_block_size: int) -> Command:
    entry = st.WalEntry.FromString(raw)
    if not entry.command:
        return _decode_legacy(entry, hash_block_size)
    kind = CommandKind(entry.command)
    if kind is CommandKind.STEP:
        rpc = StepRpc(entry.rpc)
        command = step_command(rpc, STEP_REQUESTS[rpc].FromString(entry.request), entry.request, entry.tenant,
                               entry.admin)
        command.remote_sources_checked = True  # journaled only once its sources were checked
        return command
    if kind is CommandKind.REGISTER_POOL:
        return _register(entry, entry.tenant, entry.admin, hash_block_size)
    if kind is CommandKind.COMMIT_TRANSFER:
        return commit_transfer_command(pb.CommitTransferRequest.FromString(entry.request), entry.request, entry.tenant,
                                       entry.admin)
    if kind is CommandKind.OPEN_SESSION:
        return OpenSession(entry.session_id, entry.tenant, entry.client_name, entry.resume_session_id,
                           entry.last_acked_sequence, list(entry.pool_ids), entry.admin, entry.attach)
    if kind is CommandKind.EXPIRE_SESSIONS:
        return ExpireSessions(list(entry.session_ids))
    if kind is CommandKind.RESET_PREFIX_CACHE:
        return ResetPrefixCache(list(entry.pool_ids))
    if kind is CommandKind.RETIRE_POOLS:
        return RetirePools(list(entry.pool_ids))
    if kind is CommandKind.FREEZE_POOL:
        return FreezePool(entry.pool_ids[0], entry.shard_id)
    if kind is CommandKind.THAW_POOL:
        return ThawPool(entry.pool_ids[0])
    if kind is CommandKind.DROP_POOL:
        return DropPool(entry.pool_ids[0])
    if kind is CommandKind.IMPORT_POOL:
        from kvservice.store.snapshot import import_pool
        return ImportPool(entry.pool_ids[0], entry.pool_export, import_pool)
    if kind is CommandKind.INGEST_EVENTS:
        ingest = entry.ingest
        return IngestEvents(ingest.pool_id, ingest.registration, list(zip(ingest.sequences, ingest.payloads)),
                            ingest.reset)
    if kind is CommandKind.REGISTER_EXTERNAL_POOL:
        return RegisterExternalPool(entry.tenant, spec_from_proto(pb.ExternalPoolSpec.FromString(entry.request)),
                                    entry.admin)
    if kind is CommandKind.REMOVE_EXTERNAL_POOL:
        return RemoveExternalPool(entry.tenant, entry.pool_ids[0], entry.admin)
    return Barrier(entry.resync)


def is_resync(raw: bytes) -> bool:
    """Whether a WAL entry is a resync barrier (without decoding the request it may carry)."""
    entry = st.WalEntry.FromString(raw)
    if entry.command:
        return entry.command == CommandKind.BARRIER and entry.resync
    return entry.legacy_kind == "barrier" and "resync" in entry.pool_ids


def _register(entry: st.WalEntry, tenant: str | None, admin: bool, hash_block_size: int) -> RegisterPool:
    request = pb.RegisterPoolRequest.FromString(entry.request)
    return RegisterPool(entry.session_id, tenant, request.sequence, decode_pool_spec(request, hash_block_size),
                        request.hash_fingerprint, admin, entry.request)


def _decode_legacy(entry: st.WalEntry, hash_block_size: int) -> Command:
    """Entries of the string-kind WAL; their tenant is the session's own (None: not checked)."""
    kind = entry.legacy_kind
    if kind in _LEGACY_STEPS:
        rpc = _LEGACY_STEPS[kind]
        command = step_command(rpc, STEP_REQUESTS[rpc].FromString(entry.request), entry.request, "", True)
        command.tenant = None
        command.remote_sources_checked = True  # journaled only once its sources were checked
        return command
    if kind == "register_pool":
        return _register(entry, None, True, hash_block_size)
    if kind == "commit_transfer":
        command = commit_transfer_command(pb.CommitTransferRequest.FromString(entry.request), entry.request, "", True)
        command.tenant = None
        return command
    if kind == "open_session":
        return OpenSession(entry.session_id, entry.tenant, entry.client_name)
    if kind == "expire":
        return ExpireSessions(list(entry.session_ids))
    if kind == "reset":
        return ResetPrefixCache(list(entry.pool_ids))
    if kind == "stale_resume":
        return RetirePools(list(entry.pool_ids))
    if kind == "barrier":
        return Barrier("resync" in entry.pool_ids)
    raise ValueError(f"unknown WAL entry kind {kind!r}")

