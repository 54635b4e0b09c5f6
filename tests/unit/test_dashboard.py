"""The Grafana dashboard (dashboards/freetoken.json): importable shape, its data source a
variable every panel uses, and every panel's every query evaluated by a real Prometheus holding
the known load (tests/unit/promfixture.py), with no error and a non-empty answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from freetoken_infra import dashboard as dashboard_page
from tests.unit.promfixture import SPAN_S, loaded_prometheus  # noqa: F401

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "freetoken.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# What Grafana puts for its own variables when it runs a query; $host is the "All" value.
SUBSTITUTE = {"__rate_interval": "5m", "__interval": "1m", "__range": f"{SPAN_S}s", "host": ".*"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def targets() -> list[tuple[str, str, str]]:
    return [(p["title"], t["refId"], t["expr"]) for p in dashboard()["panels"] for t in p["targets"]]


def substitute(expr: str) -> str:
    """The page's substitution (freetoken_infra.dashboard), with the values the test gives."""
    return dashboard_page.substitute(expr, SUBSTITUTE)


def test_the_dashboard_has_a_prometheus_datasource_variable_and_a_host_variable():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    host = variables["host"]
    assert host["type"] == "query" and host["datasource"] == DATASOURCE
    assert host["includeAll"] and host["allValue"] == ".*"


def test_every_panel_and_every_target_uses_the_datasource_variable():
    d = dashboard()
    assert d["panels"], "no panels"
    for p in d["panels"]:
        assert p.get("datasource") == DATASOURCE, f"panel {p['title']!r}: datasource {p.get('datasource')}"
        assert p["targets"], f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t.get("datasource", DATASOURCE) == DATASOURCE, f"panel {p['title']!r} {t['refId']}"
            assert "$host" in t["expr"] or "proxy=" in t["expr"], f"panel {p['title']!r} {t['refId']}: ignores $host"


def test_panel_ids_are_unique_and_the_grid_has_no_overlap():
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine


@pytest.mark.parametrize(("title", "ref", "expr"), targets(), ids=[f"{t}:{r}" for t, r, _ in targets()])
def test_every_panel_query_answers_with_data_from_a_real_prometheus(loaded_prometheus, title, ref, expr):
    query = substitute(expr)
    r = requests.get(
        loaded_prometheus.url + "/api/v1/query", params={"query": query, "time": loaded_prometheus.end}, timeout=30
    )
    answer = r.json()
    assert answer["status"] == "success", f"{title} {ref}: {answer.get('error')} in {query}"
    assert answer["data"]["result"], f"{title} {ref}: no data for {query}"


def test_the_host_variable_lists_the_hosts(loaded_prometheus):
    (host,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "host"]
    inner = re.fullmatch(r"label_values\((.+), host\)", host["definition"])
    assert inner, host["definition"]
    r = requests.get(
        loaded_prometheus.url + "/api/v1/series",
        params={"match[]": inner.group(1), "start": loaded_prometheus.t0, "end": loaded_prometheus.end},
        timeout=30,
    ).json()
    assert {s["host"] for s in r["data"]} == {"ws1", "ws2", "ws3"}
