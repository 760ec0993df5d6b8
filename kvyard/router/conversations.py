"""The conversations each replica is home to, learned from the prompts alone (no session key needed).

A conversation's next turn sends its whole history again, so its prompt contains the last full block of the
previous turn's prompt. The router remembers that block's key (the conversation's tip) with the replica the turn
went to; a later prompt holding a remembered tip continues that conversation, and its own last full block becomes
the tip. A conversation idle for longer than `idle_s` is over. From the counts the router also learns how many
more turns a conversation brings after any one of its turns (continuations over conversations started), which
is what a placement commits: a multi-turn fleet's conversations come back, a fleet of one-shot requests' never do.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

# Before the router has seen conversations, it assumes one more turn per turn: a placement matters beyond its
# first request, but not yet as much as a long conversation's does.
PRIOR_STARTED = 4.0
PRIOR_CONTINUED = 4.0
TURN_WORK_WEIGHT = 0.05  # a continuing turn's share of the moving average of turn work


@dataclass(slots=True)
class Conversation:
    url: str  # the replica that served its last turn
    seen: float  # time.monotonic() of its last turn


@dataclass(slots=True)
class LiveConversations:
    idle_s: float = 60.0
    max_tracked: int = 1 << 16
    _tips: OrderedDict[bytes, Conversation] = field(default_factory=OrderedDict)  # oldest first
    _homed: Counter[str] = field(default_factory=Counter)  # replica url -> live conversations there
    started: int = 0
    continued: int = 0
    turn_work: float = 0.0  # recent continuing turns' prefill work, in prefill-token equivalents (0: none yet)

    def find(self, keys: Sequence[bytes], max_blocks: int) -> bytes | None:
        """The tip of the conversation `keys` (a prompt's block keys) continues, if any: the deepest remembered
        tip among its first `max_blocks` keys."""
        tips = self._tips
        for index in range(min(max_blocks, len(keys)) - 1, -1, -1):
            if keys[index] in tips:
                return keys[index]
        return None

    def home_of(self, tip: bytes | None) -> str | None:
        conversation = self._tips.get(tip) if tip is not None else None
        return conversation.url if conversation is not None else None

    def record(self, previous_tip: bytes | None, tip: bytes | None, url: str, now: float, work: float = 0.0) -> None:
        """A turn of `work` went to `url`: the conversation of `previous_tip` (None: a new one) now ends at `tip`."""
        self.expire(now)
        previous = self._tips.pop(previous_tip, None) if previous_tip is not None else None
        if previous is not None:
            self._homed[previous.url] -= 1
            self.continued += 1
            self.turn_work += TURN_WORK_WEIGHT * (work - self.turn_work) if self.turn_work else work
        else:
            self.started += 1
        if tip is None:
            return
        replaced = self._tips.pop(tip, None)  # the same prompt again: one conversation, not two
        if replaced is not None:
            self._homed[replaced.url] -= 1
        self._tips[tip] = Conversation(url, now)
        self._homed[url] += 1
        if len(self._tips) > self.max_tracked:
            _, oldest = self._tips.popitem(last=False)
            self._homed[oldest.url] -= 1

    def expire(self, now: float) -> None:
        tips = self._tips
        while tips:
            oldest = next(iter(tips.values()))
            if now - oldest.seen <= self.idle_s:
                return
            tips.popitem(last=False)
            self._homed[oldest.url] -= 1

    def homed(self, url: str) -> int:
        """Live conversations whose last turn went to `url`."""
        return self._homed[url]

    @property
    def total(self) -> int:
        return len(self._tips)

    def future_turns(self) -> float:
        """How many more turns a conversation is expected to bring after one of its turns."""
        return (self.continued + PRIOR_CONTINUED) / (self.started + PRIOR_STARTED)
