"""The Grafana dashboard in examples/grafana: every query names a metric that a real replica or router exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.router_utils import start_router
from tests.server_utils import ServerProcess

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "kvyard.json"
METRIC = re.compile(r"\bkvyard_[a-z0-9_]+\b")


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def exported(metrics_text: str) -> set[str]:
    """Every name a query can use: samples, and for counters and histograms not yet observed, their series."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def test_every_dashboard_query_names_a_metric_kvyard_exports(llama_server: ServerProcess, tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in queries(dashboard) for name in METRIC.findall(expr)}
    assert len(used) >= 20
    router = start_router(tmp_path, [llama_server.url])
    try:
        body = {"model": "tiny-llama", "prompt": "a dashboard", "max_tokens": 2}
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).status_code == 200
        names = exported(httpx.get(f"{llama_server.url}/metrics").text) | exported(
            httpx.get(f"{router.url}/metrics").text
        )
    finally:
        router.stop()
    assert sorted(used - names) == []
    assert {"kvyard_kv_tier_hits_total", "kvyard_router_routed_requests_total"} <= used  # tier and router panels


def test_every_panel_has_a_datasource_and_a_query() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    graphs = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert graphs and all(panel["targets"] and panel["datasource"]["uid"] == "${datasource}" for panel in graphs)
    assert len({panel["title"] for panel in graphs}) == len(graphs)
