"""What the replica API serves: an engine, real or simulated, seen from the event loop.

`AsyncEngine` (the model on its own thread) and `kvyard.sim.SimEngine` (the engine core with a cost
model, stepped on the event loop) both have this shape, so one set of handlers serves both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from prometheus_client.registry import Collector

from kvyard.api.checks import ContextLimits
from kvyard.engine.core import EngineStats, KVSnapshot, RequestOutput
from kvyard.engine.kv_links.exports import ExportRead
from kvyard.engine.pooling.params import PoolingParams
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.scheduling.request import KVTransferParams
from kvyard.kvcache.events import KVEventLog


class Vocabulary(Protocol):
    """Text to token ids and back, with the model's chat template."""

    cheap: bool  # True: fast enough to run on the event loop whatever the size (the simulator's bytes)

    @property
    def chat_template(self) -> str | None:
        """The template's source, when the model has one."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt of a chat (with the functions it may call); raises `InputError` when the template cannot
        render these messages."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ReplicaEngine(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def limits(self) -> ContextLimits: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def scheduling_policy(self) -> str:
        """fcfs, or priority: requests may then carry priorities."""
        ...

    @property
    def vocabulary(self) -> Vocabulary | None: ...

    def check_ready(self) -> None:
        """Raise `APIError` 503 when the engine cannot take requests now."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        final_only: bool = False,
        resumed_output_ids: Sequence[int] = (),
        kv_transfer: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (only the last when `final_only`); closing the iterator early
        aborts the request. `resumed_output_ids` continue another replica's output, `kv_transfer` disaggregates
        it (see `EngineCore.add_request`). Raises `InputError` for a request the engine refuses."""
        ...

    async def pool(
        self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams, cache_salt: str | None = None
    ) -> RequestOutput:
        """Run a prompt-only request and return its final output, whose `pooled` is the embedding or score;
        cancelling the call aborts the request. Raises `APIError` where the engine computes no such thing."""
        ...

    async def read_export(self, transfer_id: str, start: int) -> ExportRead | None:
        """Encoded blocks `start`, ... of a transfer this replica prefills (`EngineCore.read_export`)."""
        ...

    async def release_export(self, transfer_id: str) -> bool:
        """Unpin a transfer's blocks: its decode replica has them; False when it is unknown or expired."""
        ...

    def stats(self) -> EngineStats: ...

    def kv_event_log(self) -> KVEventLog | None: ...

    async def kv_snapshot(self) -> KVSnapshot: ...

    def collectors(self) -> list[Collector]:
        """Engine-specific Prometheus collectors (the KV tier's counters, the simulator's lag)."""
        ...

    def server_info(self) -> dict[str, Any]:
        """Engine-specific fields for `/server_info`."""
        ...
