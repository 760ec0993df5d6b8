"""The Grafana dashboard in examples/grafana: every query names a metric that a real replica or router exports, and
the replicas' queries keep to the models picked in its `model_name` variable, a label every replica metric has."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.router_utils import start_router
from tests.server_utils import ServerProcess, model_names

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "kvyard.json"
METRIC = re.compile(r"\bkvyard_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\{[^}]*\}")
MODEL_FILTER = 'model_name=~"$model_name"'


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def variable(dashboard: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(v for v in dashboard["templating"]["list"] if v["name"] == name)
    return found


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
    expressions = [*queries(dashboard), variable(dashboard, "model_name")["query"]["query"]]
    used = {name for expr in expressions for name in METRIC.findall(expr)}
    assert len(used) >= 20
    router = start_router(tmp_path, [llama_server.url])
    try:
        body = {"model": "tiny-llama", "prompt": "a dashboard", "max_tokens": 2}
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).status_code == 200
        replica_text = httpx.get(f"{llama_server.url}/metrics").text
        names = exported(replica_text) | exported(httpx.get(f"{router.url}/metrics").text)
    finally:
        router.stop()
    assert sorted(used - names) == []
    assert model_names(replica_text)["kvyard_num_requests_running"] == {"tiny-llama"}  # what the variable lists
    assert {"kvyard_kv_tier_hits_total", "kvyard_router_routed_requests_total"} <= used  # tier and router panels


def test_replica_queries_show_the_models_picked() -> None:
    """Every selector of a replica metric filters by the variable (All, `.*`, also matches a replica older than the
    label); the router's metrics have no model_name (one router fronts every model), so theirs do not."""
    dashboard = json.loads(DASHBOARD.read_text())
    model = variable(dashboard, "model_name")
    assert model["type"] == "query" and "model_name)" in model["query"]["query"]
    assert model["includeAll"] and model["allValue"] == ".*" and model["datasource"]["uid"] == "${datasource}"
    selectors = [selector for expr in queries(dashboard) for selector in SELECTOR.findall(expr)]
    replica = [selector for selector in selectors if "$replica_job" in selector]
    assert len(replica) >= 20 and all(MODEL_FILTER in selector for selector in replica)
    assert all("model_name" not in selector for selector in selectors if "$router_job" in selector)


def test_every_panel_has_a_datasource_and_a_query() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    graphs = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert graphs and all(panel["targets"] and panel["datasource"]["uid"] == "${datasource}" for panel in graphs)
    assert len({panel["title"] for panel in graphs}) == len(graphs)
