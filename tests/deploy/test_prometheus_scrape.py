"""deploy/prometheus/prometheus.yml and kvpack-rules.yml in a real Prometheus scraping a real
kvpackd (CPU backend, loopback ports): the target is up, the rules load and evaluate without
error, the recording rules produce series, and no alert fires for a healthy idle daemon.
Skips without a kvpackd binary or without prometheus."""

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml

import metrics_contract as mc

sys.path.insert(0, str(mc.REPO / "client" / "python"))
from kvpack import testing  # noqa: E402

PROM = mc.REPO / "deploy" / "prometheus"
pytestmark = [
    pytest.mark.skipif(testing.find_kvpackd() is None,
                       reason="no kvpackd binary (build the daemon or set KVPACK_BUILD_DIR)"),
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed"),
]


def get(base, path, **params):
    url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError("condition not met in time")


def test_prometheus_scrapes_the_daemon_with_the_shipped_config(tmp_path):
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = "1s"
    with testing.LocalDaemon(budget_bytes=64 << 20) as d:
        job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "kvpackd")
        job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{d.metrics_port}"]
        cfg["rule_files"] = [str(PROM / "kvpack-rules.yml")]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        port = testing.free_port()
        base = f"http://127.0.0.1:{port}"
        with open(tmp_path / "prometheus.log", "w") as log:
            prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=log, stderr=subprocess.STDOUT)
            try:
                def query(expr):
                    try:
                        return get(base, "/api/v1/query", query=expr)["data"]["result"]
                    except OSError:
                        return []

                up = wait_for(lambda: query('up{job="kvpackd"} == 1'))
                assert up[0]["metric"]["gpu"] == "0"
                budget = wait_for(lambda: query("kvpack_budget_bytes"))
                assert float(budget[0]["value"][1]) == 64 << 20
                ratio = wait_for(lambda: query("kvpack:pool_used:ratio"))
                assert 0 <= float(ratio[0]["value"][1]) < 0.9

                def evaluated():
                    groups = get(base, "/api/v1/rules")["data"]["groups"]
                    rules = [r for g in groups for r in g["rules"]]
                    done = rules and all(r.get("lastEvaluation", "").startswith("20")
                                         and r["health"] != "unknown" for r in rules)
                    return rules if done else None
                rules = wait_for(evaluated)
                bad = [(r["name"], r["health"], r.get("lastError")) for r in rules
                       if r["health"] != "ok"]
                assert not bad, bad
                # An evaluation that ran before the first scrape may have left absent(up) pending;
                # the next one (1 s later) must clear it, and nothing else may be pending or firing.
                def alerts():
                    return get(base, "/api/v1/alerts")["data"]["alerts"]
                try:
                    wait_for(lambda: alerts() == [] or None, timeout_s=10.0)
                except TimeoutError:
                    pass
                assert alerts() == [], alerts()
            finally:
                prom.terminate()
                prom.wait(timeout=20)
