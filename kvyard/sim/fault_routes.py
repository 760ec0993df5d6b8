"""Fault injection for router tests: `POST /sim/restart` and `POST /sim/health {"healthy": bool}`."""

from __future__ import annotations

from typing import Protocol

from kvyard.api.errors import bad_request
from kvyard.api.protocol import json_object
from kvyard.net.http_server import Endpoint, HttpRequest, Responder
from kvyard.sim.engine import SimEngine


class Resettable(Protocol):
    def reset_metrics(self) -> None: ...


def fault_routes(engine: SimEngine, app: Resettable) -> dict[tuple[str, str], Endpoint]:
    """The routes for `engine`, served by `app` (whose metrics a restart zeroes)."""

    async def restart(request: HttpRequest, responder: Responder) -> None:
        engine.restart()
        app.reset_metrics()
        responder.send_json(200, {"status": "restarted"})

    async def set_health(request: HttpRequest, responder: Responder) -> None:
        healthy = json_object(request.body).get("healthy")
        if not isinstance(healthy, bool):
            raise bad_request("healthy must be true or false", "healthy")
        engine.healthy = healthy
        responder.send_json(200, {"healthy": healthy})

    return {("POST", "/sim/restart"): restart, ("POST", "/sim/health"): set_health}
