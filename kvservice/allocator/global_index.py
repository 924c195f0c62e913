"""One prefix index over many pools: block key -> the pools holding it, as a bitmask of their slots.

A Lookup walks the prompt's keys once, whatever the number of pools: at each key it keeps the pools that
still continue the chain (one AND of two ints), and each pool's hit is where it dropped out. The pools keep
their own maps (they allocate from them); this index is told each key a pool gains or loses (`Member`, a
`BlockHashToBlockMap` or `ExternalIndex` listener), so it never disagrees with them. Members join when a
Lookup first needs them (with every key they hold then) and leave when their map is cleared (a retired epoch
releases its blocks) or when they are dropped; the per-pool path (`Placement`, `lookup_index` off) is the
reference it is tested against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class Listened(Protocol):
    """A pool's map: it tells its listener each key it gains or loses."""

    def listen(self, listener) -> None: ...

    def listened_keys(self) -> Iterable[bytes]: ...


class Member:
    """One pool's slot in a GlobalIndex: the listener its map calls."""

    __slots__ = ("index", "bit", "owner")

    def __init__(self, index: GlobalIndex, bit: int, owner: object) -> None:
        self.index, self.bit, self.owner = index, bit, owner

    def added(self, key: bytes) -> None:
        keys = self.index.keys
        keys[key] = keys.get(key, 0) | self.bit

    def removed(self, key: bytes) -> None:
        keys = self.index.keys
        left = keys.get(key, 0) & ~self.bit
        if left:
            keys[key] = left
        else:
            keys.pop(key, None)


class GlobalIndex:
    def __init__(self) -> None:
        self.keys: dict[bytes, int] = {}
        self.members: dict[int, Member] = {}  # id(owner) -> its member
        self._free: list[int] = []  # slots of members that left
        self._next = 0

    def member(self, owner: Listened) -> Member:
        """`owner`'s member (a pool's map), joining it first: subscribed to `owner`, which reports every key it
        holds now."""
        member = owner.listener
        if member is not None and member.index is self:
            return member
        slot = self._free.pop() if self._free else self._take_slot()
        member = Member(self, 1 << slot, owner)
        self.members[id(owner)] = member
        owner.listen(member)
        return member

    def leave(self, owner: Listened) -> None:
        """Takes `owner` out: unsubscribed, the keys it holds lose its bit, its slot is free again."""
        member = self.members.pop(id(owner), None)
        if member is None or member.owner is not owner:
            return
        owner.listen(None)
        for key in owner.listened_keys():
            member.removed(key)
        self._free.append(member.bit.bit_length() - 1)

    def _take_slot(self) -> int:
        self._next += 1
        return self._next - 1

    def walk(self, keys: Sequence[bytes], members: Sequence[Member], max_blocks: int) -> list[int]:
        """For each member, how many of `keys` (at most `max_blocks`) it holds in an unbroken run from the
        first: the chain its Lookup hit covers."""
        alive = 0
        for m in members:
            alive |= m.bit
        depth: dict[int, int] = {}
        get = self.keys.get
        n = min(max_blocks, len(keys))
        i = 0
        while i < n and alive:
            held = get(keys[i], 0) & alive
            if held != alive:
                gone = alive & ~held
                while gone:
                    low = gone & -gone
                    depth[low] = i
                    gone ^= low
                alive = held
            i += 1
        return [depth.get(m.bit, n) for m in members]
