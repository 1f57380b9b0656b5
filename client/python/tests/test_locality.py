"""kvpack.locality: deterministic, shaped like kernels/cpu/locality_data.h, and local where asked
(softmax mass of a query on keys within ±NEAR tokens, its own key left out)."""

import numpy as np

from kvpack.locality import locality_data

NEAR = 96
# Measured with the C++ generator on the same grid (locality_data_test): ≈ 0.50 local, ≈ 0.11 iid.
MIN_LOCAL_NEAR_MASS = 0.25
MAX_IID_NEAR_MASS = 0.15


def near_mass(q, k):
    n, d = q.shape[0], q.shape[2]
    total = []
    for i in range(64, n, 7):
        s = (k[:, 0] @ q[i, 0]) / np.sqrt(d)
        s[i] = -np.inf
        p = np.exp(s - s.max())
        p /= p.sum()
        total.append(p[max(0, i - NEAR):i + NEAR + 1].sum())
    return float(np.mean(total))


def test_shapes_and_determinism():
    a = locality_data(frames=2, height=8, width=8, text_tokens=16, n_heads=3, head_dim=32, seed=5)
    b = locality_data(frames=2, height=8, width=8, text_tokens=16, n_heads=3, head_dim=32, seed=5)
    assert all(x.shape == (16 + 128, 3, 32) and x.dtype == np.float32 for x in a)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert np.all(np.isfinite(a[1]))


def test_local_data_attends_nearby_and_iid_does_not():
    for qk_norm in (False, True):
        kw = dict(frames=4, height=16, width=32, text_tokens=64, n_heads=1, head_dim=64, seed=77,
                  qk_norm=qk_norm)
        q, k, _ = locality_data(**kw)
        qi, ki, _ = locality_data(iid=True, **kw)
        assert near_mass(q, k) > MIN_LOCAL_NEAR_MASS
        assert near_mass(qi, ki) < MAX_IID_NEAR_MASS
