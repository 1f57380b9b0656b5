"""deploy/grafana/kvpack.json: structure, freshness, and every query against docs/metrics.md."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

import metrics_contract as mc

GRAFANA = mc.REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "kvpack.json"


@pytest.fixture(scope="module")
def dash():
    return json.loads(DASHBOARD.read_text())


def queries(dash):
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_committed_json_matches_generator():
    r = subprocess.run([sys.executable, str(GRAFANA / "build_dashboard.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_structure(dash):
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= names
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["targets"], f"{p['title']} has no query"
            assert p["datasource"]["uid"] == "${datasource}"
            for t in p["targets"]:
                assert t["refId"] and t["expr"]


def test_panels_do_not_overlap(dash):
    cells = {}
    for p in dash["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_required_views_present(dash):
    text = json.dumps(dash)
    for needed in ["kvpack_pool_bytes", "kvpack_pool_format_bytes", "kvpack_pool_high_water_bytes",
                   "kvpack_budget_bytes", "kvpack_request_peak_bytes_bucket",
                   "kvpack_stage_duration_seconds_bucket", "kvpack_queue_depth",
                   "kvpack_requests_total", "kvpack_precision_downgrades_total",
                   "kvpack_gpu_memory_bytes"]:
        assert needed in text, f"the dashboard does not show {needed}"
    assert "histogram_quantile" in text


def test_peak_quantiles_are_drawn_against_the_budget(dash):
    """The per-request peak panel shows its quantiles beside the budget, the one bound they must
    respect (test_live_metrics checks that the buckets end at the budget)."""
    peak = [p for p in dash["panels"]
            if any("kvpack_request_peak_bytes_bucket" in t["expr"] for t in p.get("targets", []))]
    assert len(peak) == 1
    exprs = [t["expr"] for t in peak[0]["targets"]]
    assert any(e.startswith("kvpack_budget_bytes") for e in exprs), exprs
    assert all("histogram_quantile" in e for e in exprs if "peak" in e), exprs


def test_every_query_follows_the_metrics_contract(dash):
    fams = mc.families()
    bad = [f"{title}: {p}" for title, expr in queries(dash) for p in mc.problems(expr, fams)]
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_every_query_parses(dash, tmp_path):
    """promtool parses each query, as a recording rule with Grafana's variables filled in."""
    rules = [{"record": f"dashboard:query{i}",
              "expr": expr.replace("$__rate_interval", "1m").replace("$instance", ".*")}
             for i, (_, expr) in enumerate(queries(dash))]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
