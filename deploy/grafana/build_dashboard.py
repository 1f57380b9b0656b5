#!/usr/bin/env python3
"""Writes deploy/grafana/kvpack.json, the kvpackd Grafana dashboard.

The dashboard is generated so that its panels share one selector and one layout rule; edit this
file, run it, and commit both. tests/deploy/test_dashboard.py checks that the committed JSON is what
this script writes and that every metric it queries is in docs/metrics.md.

    python3 deploy/grafana/build_dashboard.py            # rewrite kvpack.json
    python3 deploy/grafana/build_dashboard.py --check    # exit 1 if kvpack.json is stale
"""

import argparse
import json
import pathlib
import sys

OUT = pathlib.Path(__file__).resolve().parent / "kvpack.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job="kvpackd", instance=~"$instance"'
RATE = "$__rate_interval"
WIDTH = 24  # Grafana's grid is 24 columns wide


def target(expr, legend, ref):
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref,
            "range": True}


def panel(title, kind, unit, queries, description, stack=False, width=12, height=8, extra=None):
    """One panel; queries are (expr, legend) pairs. Position is filled in by layout()."""
    p = {
        "title": title,
        "type": kind,
        "description": description,
        "datasource": DS,
        "targets": [target(e, l, chr(ord("A") + i)) for i, (e, l) in enumerate(queries)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "gridPos": {"w": width, "h": height},
    }
    if kind == "timeseries":
        p["fieldConfig"]["defaults"]["custom"] = {
            "fillOpacity": 30 if stack else 0,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "lineWidth": 1,
            "showPoints": "never",
        }
        p["options"] = {"legend": {"displayMode": "table", "placement": "bottom",
                                   "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}
    if extra:
        p.update(extra)
    return p


def row(title):
    return {"title": title, "type": "row", "collapsed": False, "panels": [],
            "gridPos": {"w": WIDTH, "h": 1}}


def quantiles(bucket, by, legend_prefix):
    return [(f"histogram_quantile({q}, sum by ({by}le) (rate({bucket}{{{SEL}}}[{RATE}])))",
             f"{legend_prefix}p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


def memory_panels():
    return [
        row("Memory"),
        panel("Pool by state", "timeseries", "bytes",
              [(f"sum by (instance, state) (kvpack_pool_bytes{{{SEL}}})", "{{instance}} {{state}}"),
               (f"kvpack_budget_bytes{{{SEL}}}", "{{instance}} budget")],
              "Pool bytes by what holds them (active and kept K/V pages, cached weights, "
              "workspaces), stacked, with the --vram_budget ceiling as a line.", stack=True,
              extra={"fieldConfig": {"defaults": {"unit": "bytes", "custom": {
                  "fillOpacity": 30, "stacking": {"mode": "normal", "group": "A"},
                  "lineWidth": 1, "showPoints": "never"}},
                  "overrides": [budget_override()]}}),
        panel("Packed K/V by format", "timeseries", "bytes",
              [(f"sum by (instance, format) (kvpack_pool_format_bytes{{{SEL}}})",
                "{{instance}} {{format}}")],
              "Packed K/V page bytes by storage format (INT4, INT8, BF16).", stack=True),
        panel("High-water vs budget", "timeseries", "bytes",
              [(f"kvpack_pool_high_water_bytes{{{SEL}}}", "{{instance}} high-water"),
               (f"kvpack_pool_mapped_bytes{{{SEL}}}", "{{instance}} mapped"),
               (f"kvpack_budget_bytes{{{SEL}}}", "{{instance}} budget")],
              "Highest pool total since the daemon started, physical memory mapped behind the "
              "pool, and the budget. High-water close to the budget means requests have waited "
              "for memory or been downgraded.", width=8),
        panel("Pool use", "gauge", "percentunit",
              [(f"sum by (instance) (kvpack_pool_bytes{{{SEL}}}) "
                f"/ sum by (instance) (kvpack_budget_bytes{{{SEL}}})", "{{instance}}")],
              "Pool bytes over the budget; the KvpackPoolNearlyFull alert fires above 90% held "
              "for 10 minutes.", width=4,
              extra={"fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1,
                     "thresholds": {"mode": "absolute", "steps": [
                         {"color": "green", "value": None}, {"color": "orange", "value": 0.75},
                         {"color": "red", "value": 0.9}]}}, "overrides": []}}),
        panel("GPU memory", "timeseries", "bytes",
              [(f'sum by (instance) (kvpack_gpu_memory_bytes{{{SEL}, kind="total"}}) '
                f'- sum by (instance) (kvpack_gpu_memory_bytes{{{SEL}, kind="free"}})',
                "{{instance}} used (all processes)"),
               (f'kvpack_gpu_memory_bytes{{{SEL}, kind="total"}}', "{{instance}} total"),
               (f"sum by (instance) (kvpack_pool_mapped_bytes{{{SEL}}})",
                "{{instance}} kvpackd pool")],
              "Device memory from cudaMemGetInfo: what every process on the GPU uses (frontends "
              "too) against what kvpackd has mapped. Empty on the CPU backend.", width=12),
        panel("Per-request peak bytes", "timeseries", "bytes",
              quantiles("kvpack_request_peak_bytes_bucket", "instance, ", "{{instance}} ")
              + [(f"kvpack_budget_bytes{{{SEL}}}", "{{instance}} budget")],
              "Quantiles of the peak pool bytes one request held (the planner's predicted peak "
              "is checked against this), with the budget as a line. The histogram's buckets are "
              "fractions of the budget ending at it (1/16 of it apart above half), so no "
              "quantile can show a peak above the budget.", width=24,
              extra={"fieldConfig": {"defaults": {"unit": "bytes", "custom": {
                  "fillOpacity": 0, "stacking": {"mode": "none", "group": "A"},
                  "lineWidth": 1, "showPoints": "never"}},
                  "overrides": [budget_override()]}}),
    ]


def budget_override():
    return {"matcher": {"id": "byRegexp", "options": ".*budget"},
            "properties": [{"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
                           {"id": "custom.fillOpacity", "value": 0},
                           {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                           {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}


def latency_panels():
    return [
        row("Latency and traffic"),
        panel("Latency by stage (p50, p99)", "timeseries", "s",
              [(f"histogram_quantile(0.99, sum by (stage, le) "
                f"(rate(kvpack_stage_duration_seconds_bucket{{{SEL}}}[{RATE}])))", "{{stage}} p99"),
               (f"histogram_quantile(0.5, sum by (stage, le) "
                f"(rate(kvpack_stage_duration_seconds_bucket{{{SEL}}}[{RATE}])))", "{{stage}} p50")],
              "Time per request stage (queue, project, attend, transfer), all selected daemons "
              "together. A growing queue stage with flat attend means the GPU is saturated or "
              "requests wait for memory."),
        panel("Mean time per stage", "timeseries", "s",
              [(f"sum by (stage) (rate(kvpack_stage_duration_seconds_sum{{{SEL}}}[{RATE}])) "
                f"/ sum by (stage) (rate(kvpack_stage_duration_seconds_count{{{SEL}}}[{RATE}]))",
                "{{stage}}")],
              "Mean seconds per request in each stage, stacked: the height is the mean request "
              "time.", stack=True),
        panel("Queue depth", "timeseries", "short",
              [(f"kvpack_queue_depth{{{SEL}}}", "{{instance}}")],
              "Requests admitted and waiting for memory or the executor. KvpackQueueBacklog fires "
              "when it stays at 4 or more for 5 minutes.", width=8),
        panel("Requests by code", "timeseries", "reqps",
              [(f"sum by (code) (rate(kvpack_requests_total{{{SEL}}}[{RATE}]))", "{{code}}")],
              "Finished RPCs per second by gRPC status code. RESOURCE_EXHAUSTED: the floor plan "
              "exceeds the budget or the queue is full; UNAVAILABLE: draining.", stack=True,
              width=8),
        panel("Requests by method", "timeseries", "reqps",
              [(f"sum by (method) (rate(kvpack_requests_total{{{SEL}}}[{RATE}]))", "{{method}}")],
              "Finished RPCs per second by method.", stack=True, width=8),
        panel("Error ratio", "timeseries", "percentunit",
              [(f'sum by (instance) (rate(kvpack_requests_total{{{SEL}, code!="OK"}}[{RATE}])) '
                f"/ sum by (instance) (rate(kvpack_requests_total{{{SEL}}}[{RATE}]))",
                "{{instance}}")],
              "Share of RPCs that did not finish OK; KvpackHighErrorRate fires above 5% for 5 "
              "minutes.", width=24, height=6),
    ]


def precision_panels():
    return [
        row("Precision and handles"),
        panel("Tokens packed by format", "timeseries", "short",
              [(f"sum by (format) (rate(kvpack_tokens_total{{{SEL}}}[{RATE}]))", "{{format}}")],
              "Tokens per second packed into K/V pages, by format.", stack=True, width=8),
        panel("Precision downgrades", "timeseries", "short",
              [(f"sum by (instance) (rate(kvpack_precision_downgrades_total{{{SEL}}}[{RATE}]))",
                "{{instance}}")],
              "Ranges per second stored below their first allowed format to fit the budget.",
              width=8),
        panel("Regions and handles", "timeseries", "short",
              [(f"sum by (kind) (kvpack_regions{{{SEL}}})", "region {{kind}}"),
               (f"sum by (kind) (kvpack_handles{{{SEL}}})", "handle {{kind}}")],
              "Registered shared-memory and CUDA IPC regions; live weight and K/V handles.",
              width=8),
        panel("Daemons", "table", "short",
              [(f"kvpack_build_info{{{SEL}}}", "")],
              "One row per daemon: version and backend (cpu or cuda).", width=24, height=5,
              extra={"targets": [dict(target(f"kvpack_build_info{{{SEL}}}", "", "A"),
                                      format="table", instant=True, range=False)],
                     "transformations": [{"id": "organize", "options": {
                         "excludeByName": {"Time": True, "Value": True, "__name__": True}}}]}),
    ]


def layout(panels):
    """Places panels left to right, wrapping at the grid width; rows start a new line."""
    x = y = line_h = 0
    for i, p in enumerate(panels, start=1):
        p["id"] = i
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if p["type"] == "row" or x + w > WIDTH:
            x, y, line_h = 0, y + line_h, 0
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        x += w
        line_h = max(line_h, h)
        if p["type"] == "row":
            x, y, line_h = 0, y + h, 0
    return panels


def dashboard():
    return {
        "title": "kvpack",
        "uid": "kvpack-daemon",
        "description": "kvpackd: VRAM pool, per-request peaks, stage latency, queue, requests, "
                       "precision. Metric names: docs/metrics.md.",
        "tags": ["kvpack", "gpu", "attention"],
        "timezone": "utc",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
            {"name": "instance", "label": "Daemon", "type": "query", "datasource": DS,
             "query": {"query": 'label_values(kvpack_build_info{job="kvpackd"}, instance)',
                       "refId": "instance"},
             "definition": 'label_values(kvpack_build_info{job="kvpackd"}, instance)',
             "multi": True, "includeAll": True, "allValue": ".*", "refresh": 2, "sort": 1,
             "current": {}, "hide": 0},
        ]},
        "annotations": {"list": []},
        "links": [],
        "panels": layout(memory_panels() + latency_panels() + precision_panels()),
    }


def render():
    return json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if kvpack.json is stale")
    args = ap.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run {sys.argv[0]}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
