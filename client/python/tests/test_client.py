"""kvpack.Client over real gRPC against the in-process fake daemon (tests/fake_daemon.py)."""

import socket
from multiprocessing import shared_memory

import numpy as np
import pytest

import kvpack
from fake_daemon import FakeDaemon
from kvpack import reference, tensors
from kvpack.types import LayerOptions, Range, RegionSlice, Rope, Sparse

H, D_HEAD, HIDDEN = 2, 16, 24


def layer_inputs(n=37, seed=4, hidden=HIDDEN):
    r = np.random.default_rng(seed)
    x = tensors.to_bf16_bits(r.standard_normal((n, hidden)))
    w = tensors.to_bf16_bits(r.standard_normal((3 * H * D_HEAD, hidden)) / hidden ** 0.5)
    return x, w, r


def expected(x, w, **kw):
    out = reference.attention_layer(tensors.from_bf16_bits(x), tensors.from_bf16_bits(w), H,
                                    D_HEAD, **kw)
    return tensors.to_bf16_bits(out)


@pytest.fixture
def daemon():
    with FakeDaemon() as d:
        yield d


@pytest.fixture
def client(daemon):
    with kvpack.Client(daemon.target, tenant="team-a", timeout=10, chunk_bytes=1000) as c:
        yield c


def test_health_and_status(client, daemon):
    assert client.health() == "SERVING"
    s = client.status()
    assert s.backend == "cpu" and s.serving
    assert daemon.service.tenants[-1] == "team-a"


def test_layer_inline_in_many_chunks(client):
    x, w, _ = layer_inputs()
    weights = client.register_weights(w, n_heads=H, head_dim=D_HEAD)
    assert weights.handle and weights.pool_bytes == w.nbytes
    ranges = [Range(0, 20, 0, ("int8", "int4")), Range(20, 37, 1)]
    out = client.attention_layer(x, weights, n_heads=H, head_dim=D_HEAD, ranges=ranges)
    assert out.output.dtype == np.uint16 and out.output.shape == (37, H * D_HEAD)
    want = expected(x, w, seq_ids=reference.seq_ids_from_ranges([(0, 20, 0), (20, 37, 1)], 37))
    np.testing.assert_array_equal(out.output, want)
    assert [kvpack.client.format_name(r.format) for r in out.result.plan.ranges] == ["int8", "int4"]


def test_bias_norm_rope_causal_options_reach_the_daemon(client):
    x, w, r = layer_inputs(n=23)
    bias = r.standard_normal(3 * H * D_HEAD).astype(np.float32)
    qn, kn = (r.uniform(0.5, 1.5, D_HEAD).astype(np.float32) for _ in range(2))
    pos = (r.uniform(0, 30, (23, 2))).astype(np.float32)
    rope = Rope(axis_dims=(8, 6), layout="interleaved", theta=500.0)
    weights = client.register_weights(w, n_heads=H, head_dim=D_HEAD, bias=bias,
                                      q_norm_weight=qn, k_norm_weight=kn)
    opts = LayerOptions(rope=rope, qk_norm_eps=1e-5, causal=True, softmax_scale=0.2)
    out = client.attention_layer(x, weights, n_heads=H, head_dim=D_HEAD,
                                 ranges=[Range(0, 23)], positions=pos, options=opts)
    want = expected(x, w, bias=bias, q_norm_weight=qn, k_norm_weight=kn, eps=1e-5,
                    positions=pos, rope_layout=reference.ROPE_INTERLEAVED, axis_dims=(8, 6),
                    theta=500.0, causal=True, softmax_scale=0.2)
    np.testing.assert_array_equal(out.output, want)


def test_sparse_options_and_range_flags_reach_the_header(client):
    ranges = [Range(0, 64, always_attend=True), Range(64, 200, attend_densely=True)]
    opts = LayerOptions(causal=True, sparse=Sparse(topk_ratio=0.3, tail=False, sink_pages=1,
                                                   min_exact_pages=4))
    h = client.layer_header(n_tokens=200, hidden=HIDDEN, n_heads=H, head_dim=D_HEAD,
                            ranges=ranges, options=opts)
    s = h.options.attention.sparse
    assert h.options.attention.HasField("sparse") and s.WhichOneof("routing") == "topk_ratio"
    assert abs(s.topk_ratio - 0.3) < 1e-7 and s.HasField("tail") and not s.tail
    assert (s.sink_pages, s.min_exact_pages) == (1, 4)
    assert h.ranges[0].always_attend and not h.ranges[0].attend_densely
    assert h.ranges[1].attend_densely
    tau = client.layer_header(n_tokens=200, hidden=HIDDEN, n_heads=H, head_dim=D_HEAD,
                              ranges=ranges, options=LayerOptions(sparse=Sparse(rel_tau=1.5)))
    assert tau.options.attention.sparse.WhichOneof("routing") == "rel_tau"
    assert tau.options.attention.sparse.tail
    default = client.layer_header(n_tokens=200, hidden=HIDDEN, n_heads=H, head_dim=D_HEAD,
                                  ranges=ranges, options=LayerOptions(sparse=Sparse()))
    assert abs(default.options.attention.sparse.topk_ratio - 0.2) < 1e-7
    dense = client.layer_header(n_tokens=200, hidden=HIDDEN, n_heads=H, head_dim=D_HEAD,
                                ranges=[Range(0, 200)])
    assert not dense.options.attention.HasField("sparse")
    for bad in (dict(topk_ratio=0.0), dict(topk_ratio=1.5), dict(rel_tau=-1.0),
                dict(rel_tau=float("nan")), dict(topk_ratio=0.2, rel_tau=1.0),
                dict(sink_pages=2000), dict(min_exact_pages=-1)):
        with pytest.raises(ValueError):
            Sparse(**bad)


def test_project_attend_release(client):
    x, w, _ = layer_inputs(n=19)
    weights = client.register_weights(w, n_heads=H, head_dim=D_HEAD)
    proj = client.project(x, weights, n_heads=H, head_dim=D_HEAD, ranges=[Range(0, 19)])
    assert proj.output is None and proj.result.kv_handle
    att = client.attend(x, weights, proj.result.kv_handle, n_heads=H, head_dim=D_HEAD,
                        ranges=[Range(0, 19)])
    np.testing.assert_array_equal(att.output, expected(x, w))
    assert client.keep_alive([weights.handle, proj.result.kv_handle, "nope"]) == 2
    client.release_kv(proj.result.kv_handle)
    client.release_weights(weights)
    with pytest.raises(kvpack.NotFound, match="ReleaseKv: NOT_FOUND"):
        client.release_kv(proj.result.kv_handle)


def test_shared_memory_region_in_and_out(client):
    x, w, _ = layer_inputs(n=29)
    out_bytes = 29 * H * D_HEAD * 2
    shm = shared_memory.SharedMemory(create=True, size=x.nbytes + 64 + out_bytes)
    try:
        shm.buf[64:64 + x.nbytes] = x.tobytes()
        region = client.register_shm("/" + shm.name, shm.size)
        assert [r.region_id for r in client.region_status()] == [region]
        weights = client.register_weights(w, n_heads=H, head_dim=D_HEAD)
        res = client.attention_layer(
            RegionSlice(region, 64, x.nbytes), weights, n_heads=H, head_dim=D_HEAD,
            ranges=[Range(0, 29)], n_tokens=29, hidden=HIDDEN,
            output=RegionSlice(region, 64 + x.nbytes, out_bytes))
        assert res.output is None
        got = np.frombuffer(bytes(shm.buf[64 + x.nbytes:]), dtype=np.uint16).reshape(29, -1)
        np.testing.assert_array_equal(got, expected(x, w))
        client.unregister_region(region)
        assert client.region_status() == []
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.parametrize("unary", [True, False], ids=["unary", "daemon-without-unary"])
def test_calls_with_every_tensor_in_a_region_go_unary(client, daemon, unary):
    daemon.service.unary_regions = unary
    x, w, _ = layer_inputs(n=23)
    out_bytes = 23 * H * D_HEAD * 2
    shm = shared_memory.SharedMemory(create=True, size=x.nbytes + 64 + out_bytes)
    try:
        shm.buf[64:64 + x.nbytes] = x.tobytes()
        region = client.register_shm("/" + shm.name, shm.size)
        weights = client.register_weights(w, n_heads=H, head_dim=D_HEAD)
        x_ref = RegionSlice(region, 64, x.nbytes)
        kw = dict(n_heads=H, head_dim=D_HEAD, ranges=[Range(0, 23)], n_tokens=23, hidden=HIDDEN)
        # Inline x: the stream, whatever the daemon has.
        inline = client.attention_layer(x, weights, n_heads=H, head_dim=D_HEAD,
                                        ranges=[Range(0, 23)])
        assert daemon.service.unary_calls == [] and client.unary_layers
        kv = client.project(x_ref, weights, **kw)
        res = client.attend(x_ref, weights, kv.result.kv_handle,
                            output=RegionSlice(region, 64 + x.nbytes, out_bytes), **kw)
        assert res.output is None
        got = np.frombuffer(bytes(shm.buf[64 + x.nbytes:]), dtype=np.uint16).reshape(23, -1)
        np.testing.assert_array_equal(got, inline.output)
        # x in a region but the output inline: the stream.
        again = client.attention_layer(x_ref, weights, **kw)
        np.testing.assert_array_equal(again.output, inline.output)
        assert client.last_layer_method == "AttentionLayer"
        if unary:
            assert daemon.service.unary_calls == ["ProjectRegions", "AttendRegions"]
            assert client.unary_layers
        else:   # asked once, then remembered
            assert daemon.service.unary_calls == [] and not client.unary_layers
        client.unregister_region(region)
    finally:
        shm.close()
        shm.unlink()


def test_errors_carry_code_and_message(client, daemon):
    x, w, _ = layer_inputs(n=11)
    with pytest.raises(kvpack.NotFound) as e:
        client.attention_layer(x, "w-nope", n_heads=H, head_dim=D_HEAD, ranges=[Range(0, 11)])
    assert e.value.method == "AttentionLayer" and "weights_handle" in e.value.details
    weights = client.register_weights(w, n_heads=H, head_dim=D_HEAD)
    daemon.service.budget_bytes = 100
    with pytest.raises(kvpack.ResourceExhausted, match="budget 100"):
        client.attention_layer(x, weights, n_heads=H, head_dim=D_HEAD, ranges=[Range(0, 11)])
    plan = client.plan(n_tokens=11, hidden=HIDDEN, n_heads=H, head_dim=D_HEAD,
                       ranges=[Range(0, 11)])
    assert not plan.fits and "budget 100" in plan.reason
    daemon.service.budget_bytes = 1 << 30
    daemon.service.delay_s = 1.0
    with pytest.raises(kvpack.DeadlineExceeded):
        client.attention_layer(x, weights, n_heads=H, head_dim=D_HEAD, ranges=[Range(0, 11)],
                               timeout=0.2)


def test_token_is_sent():
    with FakeDaemon(token="s3cret") as d:
        with kvpack.Client(d.target, timeout=5) as anonymous:
            with pytest.raises(kvpack.Unauthenticated):
                anonymous.status()
        with kvpack.Client(d.target, token="s3cret", timeout=5) as c:
            assert c.status().serving


def test_no_daemon_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # bound, never listening: connections are refused
        with kvpack.Client(f"127.0.0.1:{port}", timeout=2) as c:
            with pytest.raises(kvpack.Unavailable):
                c.status()
            with pytest.raises(kvpack.Unavailable):
                c.wait_ready(timeout=0.3)


def test_inputs_are_validated_before_sending(client):
    with pytest.raises(ValueError):
        Range(5, 5)
    with pytest.raises(ValueError):
        Range(0, 5, formats=("fp8",))
    x, w, _ = layer_inputs(n=7)
    with pytest.raises(ValueError, match="n_tokens and hidden"):
        client.attention_layer(RegionSlice("r", 0, 10), "w", n_heads=H, head_dim=D_HEAD,
                               ranges=[Range(0, 7)])
    with pytest.raises(ValueError, match="output"):
        client.attention_layer(x, "w", n_heads=H, head_dim=D_HEAD, ranges=[Range(0, 7)],
                               output="somewhere")


def test_from_env(monkeypatch, tmp_path):
    with FakeDaemon(token="0123456789abcdef-token") as d:
        token_file = tmp_path / "token"
        token_file.write_text("0123456789abcdef-token team-b\n")
        monkeypatch.setenv("KVPACK_TARGET", d.target)
        monkeypatch.setenv("KVPACK_TOKEN_FILE", str(token_file))
        monkeypatch.setenv("KVPACK_TENANT", "team-b")
        monkeypatch.delenv("KVPACK_TOKEN", raising=False)
        with kvpack.Client.from_env(timeout=5) as c:
            assert c.status().serving
        assert d.service.tenants[-1] == "team-b"
        monkeypatch.setenv("KVPACK_TOKEN", "wrong-token-wrong-token")
        with kvpack.Client.from_env(timeout=5) as c:
            with pytest.raises(kvpack.Unauthenticated):
                c.status()


def test_region_headers_come_from_a_template_equal_to_a_fresh_build(client):
    kw = dict(n_heads=H, head_dim=D_HEAD, layout="token_major", row_stride=3 * H * D_HEAD,
              batch=0, n_tokens=41, options=LayerOptions(causal=True), keep_kv=False, priority=3)
    span = 2 * (40 * 3 * H * D_HEAD + H * D_HEAD)
    for call, base in enumerate((0, 4096)):
        slices = [RegionSlice("r-1", base + i * 2 * H * D_HEAD, span) for i in range(3)]
        event = bytes(range(64)) if call else None
        got, inline, n = client._projected_header(
            *slices, ranges=[Range(0, 41, 0, ("int8", "int4"))], cuda_wait_event=event, **kw)
        # A list of formats cannot key the cache: the header is built from scratch.
        want, _, _ = client._projected_header(
            *slices, ranges=[Range(0, 41, 0, ["int8", "int4"])], cuda_wait_event=event, **kw)
        assert inline == [] and n == 41
        assert got == want and got.projected.k.region.offset == base + 2 * H * D_HEAD
    assert len(client._templates) == 1
