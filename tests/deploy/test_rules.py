"""deploy/prometheus: every rule reads documented metrics; recording rules are defined before use."""

import re

import yaml

import metrics_contract as mc

PROM = mc.REPO / "deploy" / "prometheus"


def rules():
    doc = yaml.safe_load((PROM / "kvpack-rules.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_rules_follow_the_metrics_contract():
    fams = mc.families()
    bad = [f"{r.get('alert') or r.get('record')}: {p}"
           for r in rules() for p in mc.problems(r["expr"], fams)]
    assert not bad, "\n".join(bad)


def test_recorded_series_used_by_alerts_exist():
    recorded = {r["record"] for r in rules() if "record" in r}
    for r in rules():
        for name in re.findall(r"\bkvpack:[a-z0-9_:]+", r["expr"]):
            assert name in recorded, f"{r.get('alert')}: {name} is never recorded"


def test_alerts_have_severity_and_text():
    alerts = [r for r in rules() if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "KvpackDaemonDown", "KvpackDaemonAbsent", "KvpackPoolNearlyFull", "KvpackQueueBacklog",
        "KvpackHighErrorRate", "KvpackPrecisionDowngrades", "KvpackGpuMemoryLow"}
    for a in alerts:
        assert a["labels"]["severity"] in {"critical", "warning", "info"}
        assert a["annotations"]["summary"] and a["annotations"]["description"]


def test_every_alert_has_a_unit_test():
    tested = set()
    for path in (PROM / "tests").glob("*.yml"):
        for t in yaml.safe_load(path.read_text())["tests"]:
            for case in t.get("alert_rule_test", []):
                if case["exp_alerts"]:
                    tested.add(case["alertname"])
    missing = {r["alert"] for r in rules() if "alert" in r} - tested
    assert not missing, f"alerts without a firing test case: {sorted(missing)}"


def test_scrape_config_targets_the_documented_port():
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "kvpackd")
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9464"]
    assert "127.0.0.1:9464" in mc.METRICS_DOC.read_text()
