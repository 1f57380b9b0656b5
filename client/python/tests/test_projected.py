"""Client.attention_projected against the real kvpackd (CPU backend): pre-projected q, k, v give
the same bits as x = [q | k | v] with an identity weight, in both layouts. Skips without a kvpackd
build (KVPACK_BUILD_DIR)."""

import numpy as np
import pytest

import kvpack
from kvpack import errors, tensors, testing

if testing.find_kvpackd() is None:
    pytest.skip("no kvpackd binary (build it; ctest sets KVPACK_BUILD_DIR)", allow_module_level=True)

B, M, H, D = 2, 97, 2, 64          # two sequences of 97 tokens (odd: partial pages)
N, HD = B * M, H * D


@pytest.fixture(scope="module")
def client():
    with testing.LocalDaemon() as d, kvpack.Client(d.target, timeout=60) as c:
        yield c


def rows(seed):
    rng = np.random.default_rng(seed)
    offsets = rng.standard_t(4, size=HD).astype(np.float32) + 6.0 * (np.arange(HD) % 19 == 5)
    return tensors.to_bf16_bits(offsets + rng.standard_t(4, size=(N, HD)).astype(np.float32))


def ranges():
    return [kvpack.Range(b * M, (b + 1) * M, b, ("int8",)) for b in range(B)]


def test_token_and_head_major_match_the_identity_weight_path(client):
    q, k, v = rows(1), rows(2), rows(3)
    opts = kvpack.LayerOptions(causal=True)
    projected = client.attention_projected(q, k, v, n_heads=H, head_dim=D, ranges=ranges(),
                                           options=opts)
    assert projected.output.shape == (N, HD)
    assert projected.result.peak_bytes == projected.result.plan.predicted_peak_bytes

    to_head_major = (lambda a: np.ascontiguousarray(a.reshape(B, M, H, D).transpose(0, 2, 1, 3)))
    head_major = client.attention_projected(*(to_head_major(a) for a in (q, k, v)), n_heads=H,
                                            head_dim=D, ranges=ranges(), layout="head_major",
                                            options=opts)
    np.testing.assert_array_equal(head_major.output, projected.output)

    w = client.register_weights(tensors.identity_qkv_weight(3 * HD), n_heads=H, head_dim=D)
    x = np.concatenate([q, k, v], axis=1)
    identity = client.attention_layer(x, w, n_heads=H, head_dim=D, ranges=ranges(), options=opts)
    np.testing.assert_array_equal(identity.output, projected.output)
    client.release_weights(w)


def test_inline_bytes_are_counted(client):
    before = client.status()
    client.attention_projected(rows(4), rows(5), rows(6), n_heads=H, head_dim=D, ranges=ranges())
    after = client.status()
    assert after.inline_bytes_received - before.inline_bytes_received == 3 * N * HD * 2
    assert after.inline_bytes_sent - before.inline_bytes_sent == N * HD * 2
    assert after.device_ordinal == -1 and after.device_uuid == ""      # CPU backend


def test_options_that_need_weights_are_rejected(client):
    opts = kvpack.LayerOptions(qk_norm_eps=1e-6)
    with pytest.raises(errors.InvalidArgument, match="header.options.qk_norm.enabled"):
        client.attention_projected(rows(1), rows(2), rows(3), n_heads=H, head_dim=D,
                                   ranges=ranges(), options=opts)
    with pytest.raises(errors.InvalidArgument, match="header.options.rope"):
        client.attention_projected(rows(1), rows(2), rows(3), n_heads=H, head_dim=D,
                                   ranges=ranges(),
                                   options=kvpack.LayerOptions(rope=kvpack.Rope(axis_dims=(D,))))


def test_cuda_wait_event_is_checked_and_refused_on_the_cpu_backend(client):
    assert client.status().cuda_wait_event is False
    args = (rows(7), rows(8), rows(9))
    with pytest.raises(errors.InvalidArgument, match="header.cuda_wait_event: 10 bytes"):
        client.attention_projected(*args, n_heads=H, head_dim=D, ranges=ranges(),
                                   cuda_wait_event=b"\x01" * 10)
    with pytest.raises(errors.FailedPrecondition, match="header.cuda_wait_event.*cpu backend"):
        client.attention_projected(*args, n_heads=H, head_dim=D, ranges=ranges(),
                                   cuda_wait_event=b"\x01" * 64)
    # The refused calls left nothing behind: the same call without an event runs.
    out = client.attention_projected(*args, n_heads=H, head_dim=D, ranges=ranges())
    assert out.output.shape == (N, HD)
