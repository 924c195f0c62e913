"""External pools ⇄ the snapshot's ExternalPoolState records (everything `apply` reads, so a restart from a
snapshot plus the WAL after it continues exactly where the lost allocator was)."""

from __future__ import annotations

from dataclasses import fields

import msgpack

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import state_pb2 as st
from kvservice.external.pool import ExternalPool, PoolCounters
from kvservice.external.registry import ExternalPools
from kvservice.external.spec import SpecCheck, SpecStatus
from kvservice.external.wire import spec_from_proto, spec_to_proto


def encode_into(external: ExternalPools, snap: st.Snapshot) -> None:
    snap.next_external_registration = external.next_registration
    for pool_id in sorted(external.pools):
        pool = external.pools[pool_id]
        check = pool.check
        snap.external_pools.add(spec=spec_to_proto(pool.spec).SerializeToString(deterministic=True),
                                owner_tenant=pool.owner_tenant, registration=pool.registration, epoch=pool.epoch,
                                last_sequence=pool.last_sequence, last_digest=pool.last_digest,
                                index=pool.index.encode(), counters=pool.counter_values(),
                                spec_status=check.status.value, spec_message=check.message,
                                spec_checked=check.checked, spec_mismatches=check.mismatches,
                                spec_chain=msgpack.packb(list(check.full.items())))


def decode_from(snap: st.Snapshot, external: ExternalPools, hash_block_size: int, hash_seed: str) -> None:
    external.next_registration = snap.next_external_registration or 1
    for ps in snap.external_pools:
        spec = spec_from_proto(pb.ExternalPoolSpec.FromString(ps.spec))
        pool = ExternalPool(spec, ps.owner_tenant, ps.registration, hash_block_size, hash_seed)
        pool.epoch, pool.last_sequence, pool.last_digest = ps.epoch, ps.last_sequence, ps.last_digest
        pool.index.load(ps.index)
        pool.counters = PoolCounters(*list(ps.counters)[:len(fields(PoolCounters))])
        pool.check = SpecCheck(SpecStatus(ps.spec_status), ps.spec_message, ps.spec_checked, ps.spec_mismatches,
                               dict(msgpack.unpackb(ps.spec_chain)) if ps.spec_chain else {})
        external.pools[spec.pool_id] = pool
