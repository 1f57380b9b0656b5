"""kvpack.Client against a real kvpackd (CPU backend) started by kvpack.testing.LocalDaemon.
Skips, saying why, when no kvpackd binary is built."""

from multiprocessing import shared_memory

import numpy as np
import pytest

import kvpack
from kvpack import reference, testing, tensors
from kvpack.client import format_name
from kvpack.types import LayerOptions, Range, RegionSlice, Rope

pytestmark = pytest.mark.skipif(
    testing.find_kvpackd() is None,
    reason="no kvpackd binary: build the daemon (scripts/build.sh) or set KVPACK_BUILD_DIR")

# Relative L2 error of the output against the float64 unquantized reference, on Gaussian data
# (measured 0.004, 0.007, 0.09 at N=300, d=64); the bounds leave about 2× room.
REL_L2 = {"bf16": 0.01, "int8": 0.015, "int4": 0.2}
N, D, H, HD = 300, 96, 2, 64


@pytest.fixture(scope="module")
def daemon():
    with testing.LocalDaemon(budget_bytes=256 << 20) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with kvpack.Client(daemon.target, timeout=60) as c:
        c.wait_ready(10)
        yield c


@pytest.fixture(scope="module")
def layer(client):
    r = np.random.default_rng(21)
    x = tensors.to_bf16_bits(r.standard_normal((N, D)))
    w = tensors.to_bf16_bits(r.standard_normal((3 * H * HD, D)) / D ** 0.5)
    return x, w, client.register_weights(w, n_heads=H, head_dim=HD)


def rel_l2(bits, want):
    got = tensors.from_bf16_bits(bits)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def test_health_and_status(client):
    assert client.health() == "SERVING"
    s = client.status()
    assert s.backend == "cpu" and s.serving and s.budget_bytes == 256 << 20
    # Which attention kernel serves (fields 32-35): "cpu", and no GPU arch, on the CPU backend.
    assert s.attention_kernel == "cpu" and s.compute_capability == "" and s.sm_count == 0


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_layer_accuracy_and_predicted_peak(client, layer, fmt):
    x, w, weights = layer
    out = client.attention_layer(x, weights, n_heads=H, head_dim=HD,
                                 ranges=[Range(0, N, 0, (fmt,))])
    want = reference.attention_layer(tensors.from_bf16_bits(x), tensors.from_bf16_bits(w), H, HD)
    assert rel_l2(out.output, want) < REL_L2[fmt]
    assert [format_name(r.format) for r in out.result.plan.ranges] == [fmt]
    assert out.result.peak_bytes == out.result.plan.predicted_peak_bytes > 0
    plan = client.plan(n_tokens=N, hidden=D, n_heads=H, head_dim=HD,
                       ranges=[Range(0, N, 0, (fmt,))], weights=weights)
    assert plan.fits and plan.plan.predicted_peak_bytes == out.result.peak_bytes


def test_sequences_rope_and_causal(client, layer):
    x, w, weights = layer
    pos = np.random.default_rng(3).uniform(0, 40, (N, 2)).astype(np.float32)
    rope = Rope(axis_dims=(32, 16), layout="split_halves")
    ranges = [Range(0, 100, 0, ("bf16",)), Range(100, N, 1, ("bf16",))]
    out = client.attention_layer(x, weights, n_heads=H, head_dim=HD, ranges=ranges,
                                 positions=pos, options=LayerOptions(rope=rope, causal=True))
    want = reference.attention_layer(
        tensors.from_bf16_bits(x), tensors.from_bf16_bits(w), H, HD, positions=pos,
        rope_layout=reference.ROPE_SPLIT_HALVES, axis_dims=(32, 16), causal=True,
        seq_ids=reference.seq_ids_from_ranges([(0, 100, 0), (100, N, 1)], N))
    assert rel_l2(out.output, want) < REL_L2["bf16"]


def test_project_attend_and_shared_memory(client, layer):
    x, w, weights = layer
    want = reference.attention_layer(tensors.from_bf16_bits(x), tensors.from_bf16_bits(w), H, HD)
    out_bytes = N * H * HD * 2
    shm = shared_memory.SharedMemory(create=True, size=256 + x.nbytes + out_bytes)
    try:
        shm.buf[256:256 + x.nbytes] = x.tobytes()
        region = client.register_shm("/" + shm.name, shm.size)
        x_ref = RegionSlice(region, 256, x.nbytes)
        kv = client.project(x_ref, weights, n_heads=H, head_dim=HD, n_tokens=N, hidden=D,
                            ranges=[Range(0, N, 0, ("int8",))])
        res = client.attend(x_ref, weights, kv.result.kv_handle, n_heads=H, head_dim=HD,
                            n_tokens=N, hidden=D, ranges=[Range(0, N, 0, ("int8",))],
                            output=RegionSlice(region, 256 + x.nbytes, out_bytes))
        assert res.output is None
        got = np.frombuffer(bytes(shm.buf[256 + x.nbytes:]), dtype=np.uint16)
        assert rel_l2(got.reshape(N, -1), want) < REL_L2["int8"]
        client.release_kv(kv.result.kv_handle)
        client.unregister_region(region)
    finally:
        shm.close()
        shm.unlink()


def test_region_only_calls_go_unary_with_the_streams_bytes(client, daemon, layer):
    x, _, weights = layer
    out_bytes = N * H * HD * 2
    shm = shared_memory.SharedMemory(create=True, size=256 + x.nbytes + 2 * out_bytes)
    try:
        shm.buf[256:256 + x.nbytes] = x.tobytes()
        region = client.register_shm("/" + shm.name, shm.size)
        outs = [RegionSlice(region, 256 + x.nbytes + i * out_bytes, out_bytes) for i in (0, 1)]
        kw = dict(n_heads=H, head_dim=HD, n_tokens=N, hidden=D, ranges=[Range(0, N, 0, ("int8",))])
        x_ref = RegionSlice(region, 256, x.nbytes)

        def calls(method):
            return sum(float(l.split()[-1]) for l in daemon.scrape().splitlines()
                       if l.startswith("kvpack_requests_total") and f'method="{method}"' in l
                       and 'code="OK"' in l)

        before = calls("AttentionLayerRegions"), calls("AttentionLayer")
        client.unary_layers = False
        streamed = client.attention_layer(x_ref, weights, output=outs[0], **kw)
        client.unary_layers = True
        unary = client.attention_layer(x_ref, weights, output=outs[1], **kw)
        assert (calls("AttentionLayerRegions"), calls("AttentionLayer")) == \
            (before[0] + 1, before[1] + 1)
        assert unary.output is None and unary.result.output_bytes == 0
        assert unary.result.plan == streamed.result.plan
        a, b = (bytes(shm.buf[o.offset:o.offset + out_bytes]) for o in outs)
        assert a == b
        # Straight to the unary method (the client never sends it an inline tensor).
        h = client.layer_header(n_tokens=N, hidden=D, n_heads=H, head_dim=HD,
                                ranges=[Range(0, N)], weights=weights)
        h.x.inline_bytes = x.nbytes
        client._set_output("AttentionLayer", h, outs[0])
        with pytest.raises(kvpack.InvalidArgument, match="header.x.inline_bytes: Attention"):
            client._unary("AttentionLayerRegions", h, None)
        client.unregister_region(region)
    finally:
        shm.close()
        shm.unlink()


def test_errors_name_the_field(client, layer):
    x, _, weights = layer
    with pytest.raises(kvpack.NotFound, match="weights_handle"):
        client.attention_layer(x, "w-0", n_heads=H, head_dim=HD, ranges=[Range(0, N)])
    with pytest.raises(kvpack.InvalidArgument, match="ranges"):
        client.attention_layer(x, weights, n_heads=H, head_dim=HD, ranges=[Range(0, N - 1)])
    big = client.plan(n_tokens=1 << 22, hidden=D, n_heads=H, head_dim=HD,
                      ranges=[Range(0, 1 << 22)], weights=weights)
    assert not big.fits and big.reason


def test_metrics_count_the_calls(client, daemon, layer):
    x, _, weights = layer
    client.attention_layer(x, weights, n_heads=H, head_dim=HD, ranges=[Range(0, N)])
    text = daemon.scrape()
    ok = [l for l in text.splitlines()
          if l.startswith("kvpack_requests_total") and 'method="AttentionLayer"' in l
          and 'code="OK"' in l]
    assert ok and float(ok[0].split()[-1]) >= 1
