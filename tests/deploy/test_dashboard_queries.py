"""Every dashboard query returns data from a real Prometheus holding synthetic series of every
family in docs/metrics.md (backfilled with promtool, served on a loopback port). This catches
queries that parse but match nothing: a wrong label, a vector match that never joins, a rate over
a gauge that is always empty."""

import json
import random
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

import metrics_contract as mc

pytestmark = pytest.mark.skipif(not (shutil.which("prometheus") and shutil.which("promtool")),
                                reason="prometheus/promtool not installed (Debian package prometheus)")

STEP_S, STEPS = 15, 120                     # 30 minutes of samples
INSTANCES = ("gpu-a:9464", "gpu-b:9464")
BUCKETS = ("0.01", "0.1", "1", "10", "+Inf")


def label_sets(fam):
    """The label combinations to generate: every documented value, or two made-up ones."""
    combos = [{}]
    for label, values in fam.labels.items():
        values = sorted(values) if values else [f"{label}-1", f"{label}-2"]
        if label == "code":
            values = ["OK", "RESOURCE_EXHAUSTED"]
        combos = [dict(c, **{label: v}) for c in combos for v in values]
    return combos


def fmt(labels):
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def openmetrics(fams, t0):
    rng = random.Random(5)
    out = []
    for fam in fams.values():
        # OpenMetrics names a counter family without its _total suffix.
        base = fam.name[:-len("_total")] if fam.kind == "counter" else fam.name
        out.append(f"# TYPE {base} {fam.kind}")
        for inst in INSTANCES:
            for ls in label_sets(fam):
                ls = dict(ls, job="kvpackd", instance=inst)
                if fam.kind == "histogram":
                    counts = [0] * len(BUCKETS)
                    total = 0.0
                    lines = {b: [] for b in BUCKETS}
                    sums, cnts = [], []
                    for i in range(STEPS):
                        t = t0 + i * STEP_S
                        for _ in range(3):
                            v = rng.expovariate(2.0)
                            total += v
                            for j, b in enumerate(BUCKETS):
                                counts[j] += v <= float(b)
                        for j, b in enumerate(BUCKETS):
                            lines[b].append(f"{fam.name}_bucket{fmt(dict(ls, le=b))} {counts[j]} {t}")
                        sums.append(f"{fam.name}_sum{fmt(ls)} {total:.4f} {t}")
                        cnts.append(f"{fam.name}_count{fmt(ls)} {counts[-1]} {t}")
                    for b in BUCKETS:
                        out += lines[b]
                    out += sums + cnts
                elif fam.kind == "counter":
                    value = 0
                    for i in range(STEPS):
                        value += rng.randint(1, 20)
                        out.append(f"{base}_total{fmt(ls)} {value} {t0 + i * STEP_S}")
                else:
                    value = 1 if fam.name == "kvpack_build_info" else rng.randint(1, 1 << 30)
                    if fam.name == "kvpack_gpu_memory_bytes":
                        value = (150 << 30) if ls.get("kind") == "total" else (40 << 30)
                    for i in range(STEPS):
                        out.append(f"{fam.name}{fmt(ls)} {value} {t0 + i * STEP_S}")
    out.append("# EOF")
    return "\n".join(out) + "\n"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prom")
    t_end = int(time.time()) - 600
    t0 = t_end - STEPS * STEP_S
    (tmp / "data.om").write_text(openmetrics(mc.families(), t0))
    data = tmp / "tsdb"
    r = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics",
                        str(tmp / "data.om"), str(data)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={data}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(base + "/-/ready", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError((tmp / "prometheus.log").read_text())
                time.sleep(0.1)
        yield base, t_end - STEP_S
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def query(base, expr, at):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": at})
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def dashboard_queries():
    dash = json.loads((mc.REPO / "deploy" / "grafana" / "kvpack.json").read_text())
    return [(p["title"], t["refId"], t["expr"]) for p in dash["panels"]
            for t in p.get("targets", [])]


@pytest.mark.parametrize("title,ref,expr", dashboard_queries(),
                         ids=[f"{t}/{r}" for t, r, _ in dashboard_queries()])
def test_query_returns_data(prom, title, ref, expr):
    base, at = prom
    expr = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
    answer = query(base, expr, at)
    assert answer["status"] == "success", answer
    assert answer["data"]["result"], f"{title} {ref} returns nothing: {expr}"
