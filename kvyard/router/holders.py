"""Which replicas hold a block key, fleet-wide: every replica's cache index turned inside out.

With a thousand replicas a decision cannot ask each replica's index about the prompt; this maps a key to the
replicas whose index holds it (device cache, own tiers, or a prompt routed there), so a decision walks the
prompt's keys once and scores only the replicas that hold its longest prefix. Each index keeps it current as
it changes (`CacheIndex`).

A key maps to a bit mask of its holders (each holder gets a bit the first time it holds a key). Integers are
not objects the garbage collector tracks, so the collector does not walk the map, which holds millions of keys
in a large fleet; a map to the replicas themselves, or to sets of them, was walked at every full collection.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

_NONE: tuple[Any, ...] = ()
MAX_REMEMBERED_MASKS = 4096


@dataclass(slots=True)
class KeyHolders:
    _masks: dict[bytes, int] = field(default_factory=dict)  # key -> bit mask of its holders
    _bits: dict[int, int] = field(default_factory=dict)  # id(holder) -> its bit
    _holders: list[Any] = field(default_factory=list)  # bit index -> holder (None: free)
    _free: list[int] = field(default_factory=list)  # bit indexes of retired holders, to reuse
    _members: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # mask -> its holders, remembered

    def add(self, key: bytes, holder: Any) -> None:
        masks = self._masks
        masks[key] = masks.get(key, 0) | self._bit(holder)

    def add_all(self, keys: Iterable[bytes], holder: Any) -> None:
        masks, bit = self._masks, self._bit(holder)
        for key in keys:
            masks[key] = masks.get(key, 0) | bit

    def discard(self, key: bytes, holder: Any) -> None:
        masks = self._masks
        current = masks.get(key)
        bit = self._bits.get(id(holder))
        if current is None or bit is None:
            return
        current &= ~bit
        if current:
            masks[key] = current
        else:
            del masks[key]

    def of(self, key: bytes) -> Collection[Any]:
        """The holders of `key`."""
        return self._decode(self._masks.get(key, 0))

    def along(self, keys: Sequence[bytes]) -> tuple[Collection[Any], Collection[Any]]:
        """Holders of the first of a prompt's chained `keys`, and of the last one held anywhere (walking them
        until a key nobody holds)."""
        masks, first, deepest = self._masks, 0, 0
        for key in keys:
            current = masks.get(key)
            if current is None:
                break
            if not first:
                first = current
            deepest = current
        return self._decode(first), self._decode(deepest)

    def __len__(self) -> int:
        return len(self._masks)

    @property
    def mask_bits(self) -> int:
        """Bits a mask may use: the most holders the fleet had at once."""
        return len(self._holders)

    def retire(self, holder: Any) -> None:
        """`holder` left the fleet and holds no key any more: its bit goes to the next new holder, so masks stay
        as wide as the fleet, however many replicas come and go."""
        bit = self._bits.pop(id(holder), None)
        if bit is None:
            return
        index = bit.bit_length() - 1
        self._holders[index] = None
        self._free.append(index)
        self._members.clear()

    def _bit(self, holder: Any) -> int:
        bit = self._bits.get(id(holder))
        if bit is None:  # the list keeps the holder alive, so its id() is not reused while it has a bit
            if self._free:
                index = self._free.pop()
                self._holders[index] = holder
            else:
                index = len(self._holders)
                self._holders.append(holder)
            bit = self._bits[id(holder)] = 1 << index
        return bit

    def _decode(self, mask: int) -> tuple[Any, ...]:
        if not mask:
            return _NONE
        members = self._members.get(mask)
        if members is None:
            holders = self._holders
            members = tuple(holders[i] for i in range(mask.bit_length()) if mask >> i & 1)
            if len(self._members) >= MAX_REMEMBERED_MASKS:
                self._members.clear()
            self._members[mask] = members
        return members
