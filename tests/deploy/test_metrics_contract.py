"""The metrics contract parser itself, on the real docs/metrics.md and on made-up expressions."""

import metrics_contract as mc


def test_doc_table_parses():
    fams = mc.families()
    assert fams["kvpack_pool_bytes"].labels == {
        "state": {"kv_active", "kv_kept", "weights", "workspace"}}
    assert fams["kvpack_requests_total"].kind == "counter"
    assert fams["kvpack_requests_total"].labels == {"method": None, "code": None}
    assert fams["kvpack_stage_duration_seconds"].kind == "histogram"
    assert fams["kvpack_build_info"].labels == {"version": None, "backend": {"cpu", "cuda"}}
    assert fams["kvpack_budget_bytes"].labels == {}
    assert len(fams) >= 15


def test_histogram_suffixes_resolve_only_for_histograms():
    fams = mc.families()
    assert mc.resolve("kvpack_stage_duration_seconds_bucket", fams)[1] == "_bucket"
    assert mc.resolve("kvpack_request_peak_bytes_count", fams)[1] == "_count"
    assert mc.resolve("kvpack_queue_depth_count", fams) == (None, None)


def test_problems_are_reported():
    fams = mc.families()
    assert mc.problems('sum by (state) (kvpack_pool_bytes{job="kvpackd"})', fams) == []
    assert mc.problems("rate(kvpack_stage_duration_seconds_bucket{le=\"1\"}[5m])", fams) == []
    assert mc.problems("kvpack_pool_byte", fams) == ["kvpack_pool_byte: not in docs/metrics.md"]
    assert mc.problems('kvpack_pool_bytes{state="active"}', fams) != []
    assert mc.problems('kvpack_pool_bytes{tenant="a"}', fams) != []
    assert mc.problems("sum by (tenant) (kvpack_queue_depth)", fams) != []
    assert mc.problems('kvpack_queue_depth{le="1"}', fams) != []


def test_exposition_parser():
    text = ("# HELP kvpack_queue_depth q\n# TYPE kvpack_queue_depth gauge\nkvpack_queue_depth 0\n"
            '# TYPE kvpack_request_peak_bytes histogram\n'
            'kvpack_request_peak_bytes_bucket{le="+Inf"} 0\nkvpack_request_peak_bytes_sum 0\n')
    types, samples = mc.parse_exposition(text)
    assert types == {"kvpack_queue_depth": "gauge", "kvpack_request_peak_bytes": "histogram"}
    assert samples == {"kvpack_queue_depth", "kvpack_request_peak_bytes_bucket",
                       "kvpack_request_peak_bytes_sum"}
