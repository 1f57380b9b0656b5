"""kvpack.reference against independent formulations (never on zeros; seeded, odd sizes)."""

import numpy as np
import pytest

from kvpack import reference as ref

RTOL = 1e-10   # float64 against float64: only summation order differs


def rng():
    return np.random.default_rng(11)


def test_rope_single_axis_matches_complex_rotation():
    r = rng()
    t = r.standard_normal((7, 3, 16))
    pos = r.uniform(0, 50, size=(7, 1))
    out = ref.rope(t, pos, ref.ROPE_INTERLEAVED, [12], theta=500.0)
    z = t[..., 0:12:2] + 1j * t[..., 1:12:2]
    freq = 500.0 ** (-np.arange(6) * 2 / 12)
    z = z * np.exp(1j * pos[:, :, None] * freq)
    np.testing.assert_allclose(out[..., 0:12:2], z.real, rtol=RTOL, atol=1e-12)
    np.testing.assert_allclose(out[..., 1:12:2], z.imag, rtol=RTOL, atol=1e-12)
    np.testing.assert_array_equal(out[..., 12:], t[..., 12:])     # non-rotary channels untouched


def test_rope_split_halves_is_a_permuted_interleaved():
    r = rng()
    t = r.standard_normal((5, 2, 32))
    pos = r.uniform(0, 9, size=(5, 3))
    dims = [8, 12, 8]
    perm = np.empty(28, dtype=int)                 # split-halves channel of each interleaved one
    perm[0::2], perm[1::2] = np.arange(14), np.arange(14, 28)
    inter = t.copy()
    inter[..., :28] = t[..., perm]
    a = ref.rope(inter, pos, ref.ROPE_INTERLEAVED, dims)
    b = ref.rope(t, pos, ref.ROPE_SPLIT_HALVES, dims)
    np.testing.assert_allclose(a[..., :28], b[..., perm], rtol=RTOL, atol=1e-12)


def test_rope_preserves_norms_and_relative_angle():
    r = rng()
    q, k = r.standard_normal((2, 1, 1, 8))
    p = np.array([[3.0]])
    rq = ref.rope(q, p, ref.ROPE_SPLIT_HALVES, [8])
    rk = ref.rope(k, p + 2, ref.ROPE_SPLIT_HALVES, [8])
    np.testing.assert_allclose(np.linalg.norm(rq), np.linalg.norm(q), rtol=RTOL)
    shifted = ref.rope(q, p + 10, ref.ROPE_SPLIT_HALVES, [8]) * 1.0
    rk2 = ref.rope(k, p + 12, ref.ROPE_SPLIT_HALVES, [8])
    assert np.sum(rq * rk) == pytest.approx(np.sum(shifted * rk2), rel=1e-9)


def test_layer_matches_per_sequence_softmax():
    r = rng()
    n, d_model, h, d = 13, 24, 3, 8
    x = r.standard_normal((n, d_model))
    w = r.standard_normal((3 * h * d, d_model)) / 5
    bias = r.standard_normal(3 * h * d) / 10
    seq = ref.seq_ids_from_ranges([(0, 5, 0), (5, 13, 1)], n)
    out = ref.attention_layer(x, w, h, d, bias=bias, seq_ids=seq)
    qkv = x @ w.T + bias
    for s_begin, s_end in [(0, 5), (5, 13)]:
        for head in range(h):
            sl = slice(head * d, (head + 1) * d)
            q = qkv[s_begin:s_end, sl]
            k = qkv[s_begin:s_end, h * d + head * d:h * d + (head + 1) * d]
            v = qkv[s_begin:s_end, 2 * h * d + head * d:2 * h * d + (head + 1) * d]
            s = q @ k.T / np.sqrt(d)
            p = np.exp(s - s.max(1, keepdims=True))
            want = (p / p.sum(1, keepdims=True)) @ v
            np.testing.assert_allclose(out[s_begin:s_end, sl], want, rtol=1e-9)


def test_causal_first_token_sees_only_itself_and_norm_is_applied():
    r = rng()
    n, h, d = 6, 2, 4
    x = r.standard_normal((n, 10))
    w = r.standard_normal((3 * h * d, 10))
    qn, kn = r.uniform(0.5, 2, size=d), r.uniform(0.5, 2, size=d)
    out = ref.attention_layer(x, w, h, d, q_norm_weight=qn, k_norm_weight=kn, causal=True)
    v0 = (x @ w.T)[0, 2 * h * d:].reshape(h, d)
    np.testing.assert_allclose(out[0].reshape(h, d), v0, rtol=1e-9)
    t = r.standard_normal((3, h, d))
    normed = ref.rms_norm(t, np.ones(h * d), 1e-6)
    np.testing.assert_allclose(np.mean(normed ** 2, axis=-1), 1.0, rtol=1e-5)
