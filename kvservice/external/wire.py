"""External pools on the wire: ExternalPoolSpec ⇄ ExternalSpec (every field validated, errors naming it),
the stats record GetStats carries, and the Lookup tiers."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvservice._proto import allocator_pb2 as pb
from kvservice.errors import InvalidArgument
from kvservice.external.nodes import TIERS
from kvservice.external.pool import ExternalPool
from kvservice.external.spec import DEFAULT_BLOCK_SIZE, DEFAULT_HASH, DEFAULT_MAX_BLOCKS, ExternalSpec, SpecError

_FIELD_NAMES = {"pool_id": "spec.pool_id", "endpoint": "spec.endpoint", "replay": "spec.replay_endpoint",
                "block-size": "spec.block_size", "hash": "spec.hash_algo", "max-blocks": "spec.max_blocks",
                "topic": "spec.topic"}


def spec_from_proto(msg: pb.ExternalPoolSpec) -> ExternalSpec:
    """Raises InvalidArgument naming the field."""
    spec = ExternalSpec(msg.pool_id, msg.endpoint, msg.replay_endpoint, msg.block_size or DEFAULT_BLOCK_SIZE,
                        msg.hash_algo or DEFAULT_HASH, msg.hash_seed if msg.has_hash_seed else None, msg.bind,
                        msg.topic, msg.max_blocks or DEFAULT_MAX_BLOCKS)
    try:
        return spec.validated()
    except SpecError as exc:
        raise InvalidArgument(_FIELD_NAMES.get(exc.field, exc.field), exc.value, exc.why) from None


def spec_to_proto(spec: ExternalSpec) -> pb.ExternalPoolSpec:
    return pb.ExternalPoolSpec(pool_id=spec.pool_id, endpoint=spec.endpoint, replay_endpoint=spec.replay_endpoint,
                               block_size=spec.block_size, hash_algo=spec.hash_algo, hash_seed=spec.hash_seed or "",
                               has_hash_seed=spec.hash_seed is not None, bind=spec.bind, topic=spec.topic,
                               max_blocks=spec.max_blocks)


@dataclass(slots=True)
class ExternalPoolStats:
    """GetStats' view of one external pool (field meanings: allocator.proto's ExternalPoolStats)."""

    pool_id: str
    endpoint: str = ""
    connected: bool = False
    epoch: int = 0
    last_sequence: int = -1
    num_blocks: int = 0
    max_blocks: int = 0
    tiers: dict[str, int] = field(default_factory=dict)
    block_size: int = 0
    spec_status: str = ""
    spec_message: str = ""
    spec_blocks_checked: int = 0
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    evictions: int = 0
    restarts: int = 0
    resyncs: int = 0
    gaps: int = 0
    replays: int = 0
    clears: int = 0
    orphans: int = 0
    orphans_adopted: int = 0
    orphans_dropped: int = 0
    unknown_removals: int = 0
    duplicate_stores: int = 0
    ignored_events: int = 0
    decode_errors: int = 0
    owner_tenant: str = ""


def pool_stats(pool: ExternalPool, connected: bool = False, gaps: int = 0, replays: int = 0) -> ExternalPoolStats:
    """`connected`, `gaps`, `replays`: the subscription's (not part of the journaled state)."""
    index, c, ic = pool.index, pool.counters, pool.index.counters
    return ExternalPoolStats(
        pool.pool_id, pool.spec.endpoint, connected, pool.epoch, pool.last_sequence, len(index), index.max_blocks,
        dict(zip(TIERS, index.tier_blocks)), index.block_size or 0, pool.check.status.value, pool.check.message,
        pool.check.checked, c.batches, ic.stored_blocks, ic.removed_blocks, ic.evictions, c.restarts, c.resyncs,
        gaps, replays, ic.clears, len(index.orphans), ic.orphans_adopted, ic.orphans_dropped, ic.unknown_removals,
        ic.duplicate_stores, ic.ignored_events, c.decode_errors, pool.owner_tenant)


def encode_stats(s: ExternalPoolStats, out: pb.ExternalPoolStats) -> None:
    for f in fields(s):
        if f.name == "tiers":
            for medium, n in s.tiers.items():
                out.tiers.add(medium=medium, num_blocks=n)
        else:
            setattr(out, f.name, getattr(s, f.name))


def decode_stats(msg: pb.ExternalPoolStats) -> ExternalPoolStats:
    values = {f.name: getattr(msg, f.name) for f in fields(ExternalPoolStats) if f.name != "tiers"}
    return ExternalPoolStats(**values, tiers={t.medium: t.num_blocks for t in msg.tiers})
