"""The tokens of the transfers a prefill replica exports (docs/contracts.md §6).

The router gives a disaggregated request's two legs one fresh token. The prefill leg (which only the admin may
send) files it under the transfer's id; the decode replica shows it when it pulls or releases the blocks, and
carries no key of its own, so a prefill replica that is not what it claims learns nothing it could reuse. A pull
may arrive before its prefill leg does (the router sends both at once): a token not yet filed is waited for.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass, field

TOKEN_TTL_S = 600.0  # a transfer's token is forgotten this long after its prefill leg (its lease is shorter)
MAX_TOKENS = 1 << 16  # tokens kept at most; the oldest go first


@dataclass(slots=True)
class TransferTokens:
    _digests: OrderedDict[str, tuple[bytes, float]] = field(default_factory=OrderedDict)  # id -> (digest, expiry)
    _filed: asyncio.Event | None = None  # set (and replaced) when a token is filed; made in the server's loop

    def add(self, transfer_id: str, token: str) -> None:
        self._digests[transfer_id] = (_digest(token), time.monotonic() + TOKEN_TTL_S)
        self._digests.move_to_end(transfer_id)
        while len(self._digests) > MAX_TOKENS:
            self._digests.popitem(last=False)
        if self._filed is not None:
            self._filed.set()  # wakes whoever waits for a token; they look again
            self._filed = None

    def forget(self, transfer_id: str) -> None:
        self._digests.pop(transfer_id, None)

    async def matches(self, transfer_id: str, token: str, wait_s: float) -> bool:
        """Whether `token` is the one filed for `transfer_id`, waiting up to `wait_s` for it to be filed."""
        deadline = time.monotonic() + wait_s
        while (digest := self._digest_of(transfer_id)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._filed is None:
                self._filed = asyncio.Event()
            try:
                await asyncio.wait_for(self._filed.wait(), left)
            except TimeoutError:
                return False
        return hmac.compare_digest(digest, _digest(token))

    def _digest_of(self, transfer_id: str) -> bytes | None:
        entry = self._digests.get(transfer_id)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
