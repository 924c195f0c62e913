"""What the connector's scheduler side tells its worker side each step (vLLM's connector metadata): the loads
(pinned store pages into the engine's blocks) and the saves (the engine's blocks into store pages it was given)."""

from __future__ import annotations

from dataclasses import dataclass, field

STORE_PREFIX = "kvstore:"


def store_name(pool_id: str) -> str:
    return pool_id[len(STORE_PREFIX):]


@dataclass(slots=True)
class Load:
    """Copy store pages `store_block_ids` of `pool_id` into the engine's `local_block_ids`, then unpin."""

    req_id: str
    pool_id: str
    pin_id: str
    generation: int  # the store's, when the pin was taken: another one means the pages are gone
    store_block_ids: list[int]
    local_block_ids: list[int]


@dataclass(slots=True)
class Save:
    """Copy the engine's `local_block_ids` into store pages `store_block_ids` (either may be empty: nothing
    new), then cache the store request `save_id` up to `num_tokens` and free it."""

    req_id: str
    save_id: str
    pool_id: str
    generation: int
    num_tokens: int
    local_block_ids: list[int]
    store_block_ids: list[int]


@dataclass(slots=True)
class Hit:
    """A pinned prefix of one request, answered to get_num_new_matched_tokens and not loaded yet."""

    pool_id: str
    pin_id: str
    generation: int
    num_tokens: int  # the pinned prefix, whole blocks
    store_block_ids: list[int]
    num_computed_tokens: int = 0  # the engine's own hit it was answered against


@dataclass(slots=True)
class Tracked:
    """A request the scheduler side follows until its prompt is saved: its prompt and its blocks."""

    prompt: list[int]
    cache_salt: str | None
    block_ids: list[int] = field(default_factory=list)
    saved: bool = False
    loaded_blocks: int = 0  # the whole blocks its admission loaded from a store (the engine's hit included)
