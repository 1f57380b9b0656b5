"""A live kvpackd's /metrics against docs/metrics.md, the dashboard and the rules.

Runs when a kvpackd binary is found (KVPACKD, or under KVPACK_BUILD_DIR or build/: see
kvpack.testing.find_kvpackd) and skips otherwise. The daemon runs on the CPU backend on loopback ports.
"""

import json
import re
import sys

import pytest
import yaml

import metrics_contract as mc

sys.path.insert(0, str(mc.REPO / "client" / "python"))
from kvpack import testing  # noqa: E402  (standard library only)

# Families a freshly started daemon exports before any request: they carry no labels, or (build
# info) their labels are known at start. kvpack_gpu_memory_bytes is absent on the CPU backend.
UNLABELED_AT_START = {"kvpack_budget_bytes", "kvpack_pool_high_water_bytes",
                      "kvpack_pool_mapped_bytes", "kvpack_queue_depth",
                      "kvpack_request_peak_bytes", "kvpack_precision_downgrades_total",
                      "kvpack_build_info", "kvpack_inline_bytes", "kvpack_inline_budget_bytes"}

pytestmark = pytest.mark.skipif(testing.find_kvpackd() is None,
                                reason="no kvpackd binary (build the daemon or set KVPACK_BUILD_DIR)")


@pytest.fixture(scope="module")
def scrape():
    with testing.LocalDaemon() as d:
        yield d.scrape()


def test_exported_families_are_documented_with_their_type(scrape):
    fams = mc.families()
    types, samples = mc.parse_exposition(scrape)
    ours = {n: t for n, t in types.items() if n.startswith("kvpack_")}
    undocumented = sorted(set(ours) - set(fams))
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"
    wrong = {n: (t, fams[n].kind) for n, t in ours.items() if t != fams[n].kind}
    assert not wrong, f"type differs from docs/metrics.md (exported, documented): {wrong}"
    for s in samples:
        if s.startswith("kvpack_"):
            assert mc.resolve(s, fams)[0] is not None, f"{s} is not documented"


def test_families_present_at_start(scrape):
    types, _ = mc.parse_exposition(scrape)
    missing = sorted(UNLABELED_AT_START - set(types))
    assert not missing, f"a fresh daemon does not export {missing}"


def test_peak_buckets_end_at_the_budget(scrape):
    """kvpack_request_peak_bytes' buckets are fractions of the budget ending at it, at most 2x apart
    and 1/16 of the budget apart above half of it: a quantile interpolated from them can never lie
    above the budget (4x-apart buckets showed p90/p99 peaks above it on the dashboard)."""
    budget = float(re.search(r"^kvpack_budget_bytes(?:\{[^}]*\})? (\S+)$", scrape, re.M).group(1))
    bounds = sorted(float(le) for le in re.findall(r'^kvpack_request_peak_bytes_bucket\{le="([^"+]+)"\}', scrape,
                                                  re.M))
    assert bounds, "no finite peak buckets exported"
    assert bounds[-1] == pytest.approx(budget), (bounds[-1], budget)
    assert all(b / a <= 2.0 + 1e-9 for a, b in zip(bounds, bounds[1:])), bounds
    upper = [b for b in bounds if b >= budget / 2]
    assert all(b - a == pytest.approx(budget / 16) for a, b in zip(upper, upper[1:])), upper


def test_dashboard_and_rules_read_only_exported_or_labelled_families(scrape):
    """Every name the dashboard and the rules read is exported now, or is a labelled family
    (which appears with its first labelled sample) or the GPU-only memory gauge."""
    fams = mc.families()
    types, samples = mc.parse_exposition(scrape)
    exprs = [t["expr"] for p in json.loads((mc.REPO / "deploy/grafana/kvpack.json").read_text())
             ["panels"] for t in p.get("targets", [])]
    doc = yaml.safe_load((mc.REPO / "deploy/prometheus/kvpack-rules.yml").read_text())
    exprs += [r["expr"] for g in doc["groups"] for r in g["rules"]]
    for expr in exprs:
        for name in mc.metric_names(expr):
            fam, _ = mc.resolve(name, fams)
            if fam.name in types or name in samples:
                continue
            assert fam.labels or fam.name == "kvpack_gpu_memory_bytes", \
                f"{name} is queried but a running daemon does not export it"


def test_label_values_after_traffic():
    """After a few layers, every exported sample's labels are documented, with documented values
    where docs/metrics.md lists them (state, format, kind, stage, backend)."""
    import grpc
    import numpy as np
    import kvpack
    from kvpack import tensors
    from kvpack.types import Range

    fams = mc.families()
    with testing.LocalDaemon() as d, kvpack.Client(d.target, timeout=60) as c:
        r = np.random.default_rng(2)
        x = tensors.to_bf16_bits(r.standard_normal((150, 64)))
        w = c.register_weights(tensors.to_bf16_bits(r.standard_normal((192, 64)) / 8),
                               n_heads=2, head_dim=32)
        for fmt in ("int4", "int8", "bf16"):
            c.attention_layer(x, w, n_heads=2, head_dim=32, ranges=[Range(0, 150, 0, (fmt,))])
        kept = c.project(x, w, n_heads=2, head_dim=32, ranges=[Range(0, 150)])
        with pytest.raises(kvpack.NotFound):
            c.release_kv("kv-0")
        text = d.scrape()
        c.release_kv(kept.result.kv_handle)
    bad = []
    for line in text.splitlines():
        if not line.startswith("kvpack_"):
            continue
        name = re.match(r"[a-z_0-9]+", line).group(0)
        fam, suffix = mc.resolve(name, fams)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        for label, value in labels.items():
            if label == "le" and suffix == "_bucket":
                continue
            if label not in fam.labels:
                bad.append(f"{line}: label {label} undocumented")
            elif fam.labels[label] and value not in fam.labels[label]:
                bad.append(f"{line}: {label}={value} not in {sorted(fam.labels[label])}")
    assert not bad, "\n".join(bad)
    codes = set(re.findall(r'kvpack_requests_total\{[^}]*code="(\w+)"', text))
    assert "NOT_FOUND" in codes and "OK" in codes
    assert codes <= {c.name for c in grpc.StatusCode}, "code is a gRPC code name"
    assert re.search(r'kvpack_tokens_total\{format="int8"\} 150', text)
