"""bench/oom12_ref.py on the CPU: H3's token layout and positions, the cap arithmetic, the parse of
PyTorch's out-of-memory message, and the sampled float64 reference against kvpack.reference (an
independent implementation of the whole layer) — the GPU run uses the same code through TorchOps."""

import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "client" / "python"))

import oom12_ref as r  # noqa: E402
from kvpack import reference  # noqa: E402

SEED = 1234
REF_TOL = 1e-10   # two float64 computations of the same sums


def test_h3_layout_is_text_then_two_videos_of_21_frames():
    assert r.token_layout(r.H3_TOKENS) == [("text", 0, 1063), ("reference", 1063, 76663),
                                           ("generated", 76663, 152263)]
    for n in (3, 17, 8192, 65537):
        layout = r.token_layout(n)
        assert layout[0][1] == 0 and layout[-1][2] == n
        assert all(b < e for _, b, e in layout)
        assert all(layout[i][2] == layout[i + 1][1] for i in range(2))
    with pytest.raises(ValueError):
        r.token_layout(2)


def test_positions_walk_frames_rows_and_columns():
    pos = r.positions(r.H3_TOKENS)
    assert pos.dtype == np.float32 and pos.shape == (r.H3_TOKENS, 3)
    assert not pos[:1063].any()                                    # text: no rotation
    assert pos[1063].tolist() == [0, 0, 0]
    assert pos[1063 + 81].tolist() == [0, 1, 1]                    # row 1, column 1
    assert pos[76662].tolist() == [20, 44, 79]                     # last reference patch
    assert pos[76663].tolist() == [21, 0, 0]                       # the generated video goes on in time
    assert pos[-1].tolist() == [41, 44, 79]


def test_modes_name_every_range():
    for mode in r.MODES:
        got = r.ranges(1000, mode)
        assert [g[0] for g in got] == ["text", "reference", "generated"]
        assert all(len(g[3]) >= 1 for g in got)
    assert r.ranges(1000, "mixed")[2][3] == ("int4",)


def test_cap_and_held_bytes():
    total = 150 * r.GIB
    cap = int(r.USER_CAP_GIB * r.GIB)
    assert r.cap_bytes(total, cap) == total - cap
    with pytest.raises(ValueError):
        r.cap_bytes(cap - 1, cap)
    x, w = 1_637_051_776, 231_211_008
    held = int(r.USER_HELD_GIB * r.GIB)
    assert r.other_bytes(held, x, w) == held - x - w
    assert r.other_bytes(held, x, w, held_includes_inputs=False) == held
    with pytest.raises(ValueError):
        r.other_bytes(x, x, w)


def test_oom_message_bytes():
    msg = ("CUDA out of memory. Tried to allocate 6.10 GiB. GPU 0 has a total capacity of 139.81 GiB of "
           "which 3.52 GiB is free. Of the allocated memory 133.40 GiB is allocated by PyTorch")
    assert r.oom_bytes(msg) == int(6.10 * (1 << 30))
    assert r.oom_bytes("Tried to allocate 20.00 MiB") == 20 << 20
    assert r.oom_bytes("an illegal memory access") is None


def test_samples_are_seeded_and_distinct():
    a, b = r.sample_rows(5000, 1024, SEED), r.sample_rows(5000, 1024, SEED)
    assert (a == b).all() and len(set(a.tolist())) == 1024 and a.max() < 5000
    assert len(r.sample_rows(100, 1024, SEED)) == 100
    h = r.sample_heads(4, SEED)
    assert len(set(h.tolist())) == 4 and h.max() < r.HEADS


def test_reference_rows_match_kvpack_reference():
    rng = np.random.default_rng(SEED)
    n, hidden, heads, d = 301, 40, 3, 128
    x = rng.standard_normal((n, hidden)) + 0.3 * rng.standard_normal(hidden)   # per-channel offsets
    w = rng.standard_normal((3 * heads * d, hidden)) / np.sqrt(hidden)
    q_norm = 1.0 + 0.2 * rng.standard_normal(d)
    k_norm = 1.0 + 0.2 * rng.standard_normal(d)
    pos = r.positions(n).astype(np.float64) * 3.0     # larger angles than 300 tokens alone give
    full = reference.attention_layer(x, w, heads, d, q_norm_weight=q_norm, k_norm_weight=k_norm,
                                     eps=r.EPS, positions=pos, rope_layout=reference.ROPE_SPLIT_HALVES,
                                     axis_dims=r.AXIS_DIMS, theta=r.THETA).reshape(n, heads, d)
    rows = r.sample_rows(n, 37, SEED)
    sel = [2, 0]
    got = r.reference_rows(r.NumpyOps, x, w, q_norm, k_norm, pos, rows, sel, n_heads=heads,
                           head_dim=d, chunk=64)
    for i, h in enumerate(sel):
        np.testing.assert_allclose(got[i], full[rows, h], rtol=REF_TOL, atol=REF_TOL)
    e = r.errors(got, [full[rows, h] for h in sel])
    assert e["rel_l2"] < REF_TOL and e["worst_head_cos"] > 1 - REF_TOL


def test_errors_of_a_known_perturbation():
    rng = np.random.default_rng(SEED)
    ref = [rng.standard_normal((50, 8)) for _ in range(2)]
    got = [ref[0] * 1.1, ref[1]]
    e = r.errors(got, ref)
    n0, n1 = (ref[0] ** 2).sum(), (ref[1] ** 2).sum()
    assert e["rel_l2"] == pytest.approx(np.sqrt(0.01 * n0 / (n0 + n1)))
    assert e["worst_head_cos"] == pytest.approx(1.0)
