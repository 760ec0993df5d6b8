"""Which replicas hold a block key, fleet-wide: every replica's cache index turned inside out.

With a thousand replicas a decision cannot ask each replica's index about the prompt; this maps a key to the
replicas whose index holds it (device cache, own tiers, or a prompt routed there), so a decision walks the
prompt's keys once and scores only the replicas that hold its longest prefix. Each index keeps it current as
it changes (`CacheIndex`); a key with one holder costs one dict entry (the replica itself is the value).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

_NONE: tuple[Any, ...] = ()


@dataclass(slots=True)
class KeyHolders:
    _holders: dict[bytes, Any] = field(default_factory=dict)  # key -> its one holder, or a set of holders

    def add(self, key: bytes, holder: Any) -> None:
        current = self._holders.get(key)
        if current is None:
            self._holders[key] = holder
        elif current is holder:
            return
        elif type(current) is set:
            current.add(holder)
        else:
            self._holders[key] = {current, holder}

    def discard(self, key: bytes, holder: Any) -> None:
        current = self._holders.get(key)
        if current is None:
            return
        if current is holder:
            del self._holders[key]
        elif type(current) is set:
            current.discard(holder)
            if len(current) == 1:
                self._holders[key] = next(iter(current))

    def of(self, key: bytes) -> Collection[Any]:
        """The holders of `key` (do not change the collection)."""
        return _as_collection(self._holders.get(key))

    def along(self, keys: Sequence[bytes]) -> tuple[Collection[Any], Collection[Any]]:
        """Holders of the first of a prompt's chained `keys`, and of the last one held anywhere (walking them
        until a key nobody holds)."""
        holders, first, deepest = self._holders, None, None
        for key in keys:
            current = holders.get(key)
            if current is None:
                break
            if first is None:
                first = current
            deepest = current
        return _as_collection(first), _as_collection(deepest)

    def __len__(self) -> int:
        return len(self._holders)


def _as_collection(current: Any) -> Collection[Any]:
    if current is None:
        return _NONE
    return current if type(current) is set else (current,)
