"""Views of a request's block hashes at a group's block size (hashes are computed at the finer
hash block size; a chained hash fingerprints its whole prefix, so a coarse block's hash is the last
fine hash inside it)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvservice.hashing import BlockHash


class CoarseBlockHashes(Sequence):
    """vLLM's `BlockHashListWithBlockSize`: `hashes` at `hash_block_size` seen at `target_block_size`
    (a multiple of it), lazily."""

    __slots__ = ("block_hashes", "scale_factor")

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int, target_block_size: int) -> None:
        if target_block_size % hash_block_size != 0:
            raise ValueError(f"block size {target_block_size} is not a multiple of the hash block size "
                             f"{hash_block_size}")
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def __getitem__(self, idx):  # type: ignore[override]
        if isinstance(idx, int):
            if idx < 0:
                idx += len(self)
            if not 0 <= idx < len(self):
                raise IndexError(idx)
            return self.block_hashes[(idx + 1) * self.scale_factor - 1]
        if isinstance(idx, slice):
            return [self.block_hashes[(i + 1) * self.scale_factor - 1] for i in range(*idx.indices(len(self)))]
        raise TypeError(f"Invalid index type: {type(idx)!r}")

    def __iter__(self) -> Iterator[BlockHash]:
        hashes, scale = self.block_hashes, self.scale_factor
        for i in range(len(self)):
            yield hashes[(i + 1) * scale - 1]


def resolve_block_hashes(block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int, *,
                         supports_fine_grained_hash_lookup: bool = False,
                         alignment_tokens: int | None = None) -> Sequence[BlockHash]:
    """The hashes at `block_size`: the list itself when the sizes agree, or when a fine-grained lookup
    (`alignment_tokens` a proper divisor of `block_size`) probes boundaries inside a block."""
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, CoarseBlockHashes):
        if block_hashes.scale_factor != block_size // hash_block_size:
            raise AssertionError(f"a view at scale {block_hashes.scale_factor} cannot serve block size "
                                 f"{block_size} over hash block size {hash_block_size}")
        return block_hashes
    if (supports_fine_grained_hash_lookup and alignment_tokens is not None and alignment_tokens < block_size
            and block_size % alignment_tokens == 0):
        return block_hashes
    return CoarseBlockHashes(block_hashes, hash_block_size, block_size)
