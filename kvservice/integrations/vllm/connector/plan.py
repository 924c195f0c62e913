"""What the connector's scheduler side tells its worker side each step (vLLM's connector metadata): the loads
(pinned store pages into the engine's blocks) and the saves (the engine's blocks into store pages it was given)."""

from __future__ import annotations

from dataclasses import dataclass, field

STORE_PREFIX = "kvstore:"  # a store's RAM tier (host memory, a shared-memory segment)
DISK_PREFIX = "kvdisk:"  # a store's local-disk tier (page files; read on the store's node only)


def store_name(pool_id: str) -> str:
    """The store a tier's pool belongs to."""
    return pool_id.split(":", 1)[1]


def is_disk(pool_id: str) -> bool:
    return pool_id.startswith(DISK_PREFIX)


def is_store_pool(pool_id: str) -> bool:
    return pool_id.startswith((STORE_PREFIX, DISK_PREFIX))


def block_tags(block_hashes: list[bytes]) -> list[int]:
    """Each block's page tag: 64 bits of its chained block hash (the prompt's prefix up to it, the namespace
    included), never 0 (0 marks a slice being written). A page tagged otherwise holds another prefix."""
    return [int.from_bytes(h[:8], "little") or 1 for h in block_hashes]


def tier_label(pool_id: str) -> str:
    """The counters' label of a tier's pool: the store's name, and ":disk" for its disk tier."""
    return store_name(pool_id) + (":disk" if is_disk(pool_id) else "")


@dataclass(slots=True)
class Load:
    """Copy store pages `store_block_ids` of `pool_id` into the engine's `local_block_ids`; the scheduler side
    unpins once every worker reported it (`Done.loads`)."""

    req_id: str
    pool_id: str
    pin_id: str
    generation: int  # the store's, when the pin was taken: another one means the pages are gone
    store_block_ids: list[int]
    local_block_ids: list[int]
    async_load: bool = False  # vLLM waits for it (WAITING_FOR_REMOTE_KVS): reported in finished_recving
    failed: str = ""  # a reason: nothing to read (a hand-over whose pages never came), the blocks fail
    tags: list[int] = field(default_factory=list)  # each page's expected tag: its block's identity (block_tags)


@dataclass(slots=True)
class DiskSave:
    """The same prompt's pages into the store's disk tier: disk pages `page_ids` take the RAM pages `src_rows`
    (the RAM save's, fresh or already there); reported under `save_id` once durable."""

    save_id: str
    pool_id: str
    epoch: int
    page_ids: list[int]
    src_rows: list[int]
    tags: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Save:
    """Copy the engine's `local_block_ids` into store pages `store_block_ids` (either may be empty: nothing
    new); once every worker reported it written (`Done.saves`) the scheduler side caches the store request
    `save_id` up to `num_tokens` and frees it."""

    req_id: str
    save_id: str
    pool_id: str
    generation: int
    num_tokens: int
    local_block_ids: list[int]
    store_block_ids: list[int]
    disk: DiskSave | None = None  # write-through to the store's disk tier, from the RAM pages once sealed
    tags: list[int] = field(default_factory=list)  # each page's tag: its block's identity (block_tags)


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
class Handoff:
    """A prefill/decode hand-over: the producer's `kv_transfer_params` named a save of `num_tokens` on
    `pool_id`; this consumer waits for its pages (an asynchronous load) until `deadline`."""

    pool_id: str
    num_tokens: int
    deadline: float
    claimed: int = 0  # tokens past the engine's own hit, answered to vLLM
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    next_try: float = 0.0


@dataclass(slots=True)
class Tracked:
    """A request the scheduler side follows until its prompt is saved: its prompt and its blocks."""

    prompt: list[int]
    cache_salt: str | None
    block_ids: list[int] = field(default_factory=list)
    saved: bool = False
    loaded_blocks: int = 0  # the whole blocks its admission loaded from a store (the engine's hit included)
    loaded_from_disk: bool = False  # ...from a disk tier: saved into RAM again (promoted)
    handoff: Handoff | None = None  # a producer's save this request waits for (prefill/decode)
    tags: list[int] | None = None  # its whole blocks' page tags (SchedulerSide.tags), once computed


@dataclass(slots=True)
class Done:
    """What the workers finished (vLLM adds up every rank's report of a step, so counts are ranks): pins whose
    loads ended, saves written or failed, asynchronous loads done."""

    loads: dict[str, int] = field(default_factory=dict)  # pin id -> ranks
    saves: dict[str, int] = field(default_factory=dict)  # save id -> ranks that wrote their slice
    failed_saves: dict[str, int] = field(default_factory=dict)  # save id -> ranks that could not
    evict: dict[str, list[int]] = field(default_factory=dict)  # pool -> pages whose checksum failed at load

    def merge(self, other: Done) -> Done:
        for mine, theirs in ((self.loads, other.loads), (self.saves, other.saves),
                             (self.failed_saves, other.failed_saves)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        for pool_id, pages in other.evict.items():
            self.evict.setdefault(pool_id, []).extend(pages)
        return self

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.failed_saves or self.evict)
