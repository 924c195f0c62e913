"""The external pools in the allocator's state, and the three commands that change them. Reads: which pools
a caller sees (its tenant's; an admin: all) and their Lookup hits."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvservice.commands import IngestEvents, RegisterExternalPool, RemoveExternalPool
from kvservice.errors import NotFound, PermissionDenied, pool_id_taken
from kvservice.external.nodes import TIERS
from kvservice.external.pool import ExternalPool, ResetKind
from kvservice.hashing import hash_prompt
from kvservice.results import PoolHit

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ExternalRegistered:
    pool_id: str
    registration: int
    new_registration: bool


class ExternalPools:
    """The state's part: pools by id, and the next registration number (never reused)."""

    def __init__(self) -> None:
        self.pools: dict[str, ExternalPool] = {}
        self.next_registration = 1

    def get(self, pool_id: str) -> ExternalPool | None:
        return self.pools.get(pool_id)

    def __contains__(self, pool_id: str) -> bool:
        return pool_id in self.pools


class ExternalRegistry:
    def __init__(self, state) -> None:
        self.state = state  # AllocatorState (its `external` and `pools`)

    @property
    def external(self) -> ExternalPools:
        return self.state.external

    # ---- commands --------------------------------------------------------------------------------
    def apply(self, command, guard: Callable[[], None]) -> tuple[object, bool]:
        """(reply, mutated) of one external-pool command."""
        kind = type(command)
        if kind is IngestEvents:
            return self._ingest(command, guard)
        if kind is RegisterExternalPool:
            return self._register(command, guard)
        if kind is RemoveExternalPool:
            pool = self.pool(command.pool_id, command.tenant, command.admin)
            guard()
            del self.external.pools[pool.pool_id]
            logger.info("external pool %s removed", pool.pool_id)
            return True, True
        raise TypeError(f"not an external-pool command: {command!r}")

    def _register(self, command: RegisterExternalPool, guard) -> tuple[ExternalRegistered, bool]:
        spec = command.spec
        if spec.pool_id in self.state.pools:
            raise pool_id_taken(spec.pool_id)
        current = self.external.get(spec.pool_id)
        if current is not None and not command.admin and current.owner_tenant != command.tenant:
            raise PermissionDenied(f"external pool {spec.pool_id!r} belongs to another tenant")
        if spec.bind and not command.admin:
            raise PermissionDenied("bind makes the allocator listen on an address: only an admin may ask for it")
        if current is not None and current.spec == spec:
            return ExternalRegistered(spec.pool_id, current.registration, False), False
        guard()
        settings = self.state.settings
        registration = self.external.next_registration
        self.external.next_registration += 1
        owner = current.owner_tenant if current is not None else command.tenant
        self.external.pools[spec.pool_id] = ExternalPool(spec, owner, registration, settings.hash_block_size,
                                                         settings.hash_seed)
        logger.info("external pool %s registered (%s, replay %s, block size %d, hash %s), registration %d",
                    spec.pool_id, spec.endpoint, spec.replay_endpoint or "none", spec.block_size, spec.hash_algo,
                    registration)
        return ExternalRegistered(spec.pool_id, registration, True), True

    def _ingest(self, command: IngestEvents, guard) -> tuple[None, bool]:
        pool = self.external.get(command.pool_id)
        if pool is None or pool.registration != command.registration:
            return None, False  # removed or replaced since its subscription read these
        guard()
        pool.reset(ResetKind(command.reset))
        for sequence, payload in command.frames:
            if sequence > pool.last_sequence:  # a batch applied already (a replay overlapping) never re-applies
                pool.apply(sequence, payload)
        return None, True

    # ---- reads -----------------------------------------------------------------------------------
    def pool(self, pool_id: str, tenant: str | None = None, admin: bool = True) -> ExternalPool:
        pool = self.external.get(pool_id)
        if pool is None or not (admin or tenant is None or pool.owner_tenant == tenant):
            raise NotFound(f"external pool {pool_id!r} is not registered; call RegisterExternalPool first")
        return pool

    def visible(self, tenant: str, admin: bool) -> list[ExternalPool]:
        return [p for p in self.external.pools.values() if admin or p.owner_tenant == tenant]

    def hits(self, pools: Sequence[ExternalPool], fine_hashes: list[bytes], num_tokens: int, token_ids=None,
             cache_salt: str | None = None, lora_name: str | None = None) -> list[PoolHit]:
        """Per pool: its GPU tier's hit (what the engine's get_computed_blocks gives) and every tier's.
        `fine_hashes` are the prompt's hashes at the allocator's hash block size; a pool whose block size is
        not a multiple of it needs the tokens (a Lookup by hashes answers 0 there)."""
        h = self.state.settings.hash_block_size
        other_sizes: dict[int, list[bytes]] = {}
        out = []
        for pool in pools:
            index = pool.index
            hashes = fine_hashes
            if index.key_block_size != h:
                size = index.key_block_size
                if size not in other_sizes:
                    other_sizes[size] = ([] if token_ids is None else
                                         hash_prompt(token_ids, size, self.state.settings.hash_seed, cache_salt,
                                                     lora_name))
                hashes = other_sizes[size]
            tiers = index.hits(hashes, num_tokens)
            out.append(PoolHit(pool.pool_id, tiers[0], 0, external=True, tiers=dict(zip(TIERS, tiers))))
        return out
