"""An external pool: one stock vLLM engine known through its KV events — its declared spec, the owning
tenant, where its event stream stands (epoch, last applied sequence and that batch's digest, which tells a
replay of the same publisher from a restarted one), its index and the spec check."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from enum import IntEnum

import xxhash

from kvservice.external.frames import Batch, Cleared, FrameError, Removed, Stored, decode_batch
from kvservice.external.index import ExternalIndex
from kvservice.external.spec import ExternalSpec, SpecCheck, SpecStatus

logger = logging.getLogger(__name__)


class ResetKind(IntEnum):
    """Why an ingest drops the pool's index first (stored in the WAL as numbers: never renumber)."""

    NONE = 0
    RESTART = 1  # the publisher restarted (its sequence went back, or its replay disagrees): a new epoch
    RESYNC = 2  # a gap no replay could fill: what the engine held before it is unknown


@dataclass(slots=True)
class PoolCounters:
    batches: int = 0
    events: int = 0
    restarts: int = 0
    resyncs: int = 0
    decode_errors: int = 0


def payload_digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


class ExternalPool:
    def __init__(self, spec: ExternalSpec, owner_tenant: str, registration: int, hash_block_size: int,
                 hash_seed: str) -> None:
        self.spec = spec
        self.pool_id = spec.pool_id
        self.owner_tenant = owner_tenant
        self.registration = registration
        self.epoch = 0
        self.last_sequence = -1
        self.last_digest = 0
        self.index = ExternalIndex(hash_block_size, hash_seed, spec.max_blocks)
        self.check = SpecCheck()
        self.counters = PoolCounters()

    def reset(self, kind: ResetKind) -> None:
        if kind is ResetKind.NONE:
            return
        if kind is ResetKind.RESTART:
            self.counters.restarts += 1
            self.epoch += 1
        else:
            self.counters.resyncs += 1
        self.index.reset()
        self.check = SpecCheck()
        self.last_sequence, self.last_digest = -1, 0
        logger.warning("external pool %s: %s, its index was dropped (epoch %d)", self.pool_id,
                       "the publisher restarted" if kind is ResetKind.RESTART else "a gap no replay could fill",
                       self.epoch)

    def apply(self, sequence: int, payload: bytes) -> None:
        """Applies one published batch (an undecodable one is counted and skipped)."""
        try:
            batch: Batch | None = decode_batch(sequence, payload)
        except FrameError as exc:
            batch = None
            self.counters.decode_errors += 1
            logger.error("external pool %s: batch %d is not a vLLM KV-event batch (%s); skipped", self.pool_id,
                         sequence, exc)
        if batch is not None:
            index, check, spec = self.index, self.check, self.spec
            for event in batch.events:
                kind = type(event)
                if kind is Stored:
                    if not check.done() and not check.check(spec, event):
                        logger.error("external pool %s: %s", self.pool_id, check.message)
                    index.apply_stored(event)
                elif kind is Removed:
                    index.apply_removed(event)
                elif kind is Cleared:
                    index.clear()
            self.counters.events += len(batch.events)
        self.counters.batches += 1
        self.last_sequence = sequence
        self.last_digest = payload_digest(payload)

    @property
    def spec_mismatch(self) -> bool:
        return self.check.status is SpecStatus.MISMATCH

    def counter_values(self) -> list[int]:
        return [getattr(self.counters, f.name) for f in fields(self.counters)]
