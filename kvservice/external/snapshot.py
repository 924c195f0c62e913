"""External pools ⇄ the snapshot's ExternalPoolState records (everything `apply` reads, so a restart from a
snapshot plus the WAL after it continues exactly where the lost allocator was), and an index ⇄ bytes."""

from __future__ import annotations

from array import array
from dataclasses import fields

import msgpack

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import state_pb2 as st
from kvservice.external.index import ExternalIndex
from kvservice.external.nodes import TIERS, IndexCounters, Node, Orphan, tier_count
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
                                index=encode_index(pool.index), counters=pool.counter_values(),
                                spec_status=check.status.value, spec_message=check.message,
                                spec_checked=check.checked, spec_mismatches=check.mismatches,
                                spec_chain=msgpack.packb(list(check.full.items())))


def decode_from(snap: st.Snapshot, external: ExternalPools, hash_block_size: int, hash_seed: str) -> None:
    external.next_registration = snap.next_external_registration or 1
    for ps in snap.external_pools:
        spec = spec_from_proto(pb.ExternalPoolSpec.FromString(ps.spec))
        pool = ExternalPool(spec, ps.owner_tenant, ps.registration, hash_block_size, hash_seed)
        pool.epoch, pool.last_sequence, pool.last_digest = ps.epoch, ps.last_sequence, ps.last_digest
        load_index(pool.index, ps.index)
        pool.counters = PoolCounters(*list(ps.counters)[:len(fields(PoolCounters))])
        pool.check = SpecCheck(SpecStatus(ps.spec_status), ps.spec_message, ps.spec_checked, ps.spec_mismatches,
                               dict(msgpack.unpackb(ps.spec_chain)) if ps.spec_chain else {})
        external.pools[spec.pool_id] = pool


def encode_index(index: ExternalIndex) -> bytes:
    """The whole index, canonical (equal indexes encode equal): nodes in index order with their parent's
    position, the leaf queue's live entries, the orphans in queue order, the counters."""
    position = {}
    keys, parents, counts, engines = [], array("i"), array("Q"), []
    for i, node in enumerate(index.by_key.values()):
        position[id(node)] = i
        keys.append(node.key)
    for node in index.by_key.values():
        parents.append(position[id(node.parent)] if node.parent is not None else -1)
        counts.append(node.counts)
        engines.append(node.engine)
    leaves = [position[id(node)] for node in index.live_leaves()]
    orphans = [[o.engine, o.parent, o.tokens, o.salt, o.lora, o.sealed, o.tier] for o in index.orphan_queue
               if index.orphans.get(o.engine) is o]
    c = index.counters
    body = [index.block_size, b"".join(keys), parents.tobytes(), counts.tobytes(), engines, leaves, orphans,
            [getattr(c, f.name) for f in fields(c)]]
    return msgpack.packb(body, use_bin_type=True)


def load_index(index: ExternalIndex, data: bytes) -> None:
    """Replaces `index`'s contents with an `encode_index` result."""
    block_size, keys, raw_parents, raw_counts, engines, leaves, orphans, counters = msgpack.unpackb(
        data, raw=False, strict_map_key=False)
    index.reset()
    if block_size is not None:
        index.learn_block_size(block_size)
    parents, counts = array("i"), array("Q")
    parents.frombytes(raw_parents)
    counts.frombytes(raw_counts)
    nodes = []
    for i in range(len(counts)):
        engine = engines[i]
        node = Node(keys[16 * i:16 * (i + 1)], engine, None, counts[i])
        nodes.append(node)
        index.by_key[node.key] = node
        for e in engine if isinstance(engine, list) else (engine,):
            index.by_engine[e] = node
        for t in range(len(TIERS)):
            if tier_count(node.counts, t):
                index.tier_blocks[t] += 1
    for node, p in zip(nodes, parents):
        if p >= 0:
            node.parent = nodes[p]
            nodes[p].children += 1
    for i in leaves:
        index.push_leaf(nodes[i])
    for engine, parent, tokens, salt, lora, sealed, tier in orphans:
        orphan = Orphan(engine, parent, tokens, salt, lora, sealed, tier)
        index.orphans[engine] = orphan
        index.waiting.setdefault(parent, []).append(orphan)
        index.orphan_queue.append(orphan)
    index.counters = IndexCounters(*counters)
    if index.listener is not None:  # reset() told the listener each key went; tell it the loaded ones came
        index.listen(index.listener)
