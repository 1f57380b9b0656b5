"""kvpack.tensors: bf16 rounding, wire conversion, chunking."""

import numpy as np
import pytest

from kvpack import tensors


def test_bf16_round_trip_of_representable_values():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 0x7F7F, size=(37, 19), dtype=np.uint16)   # finite positives
    bits[::3] |= 0x8000                                               # and negatives
    assert np.array_equal(tensors.to_bf16_bits(tensors.from_bf16_bits(bits)), bits)


def test_bf16_rounds_to_nearest_even():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -7)          # bf16 spacing at 1.0
    vals = np.array([one + ulp / 2,      # tie, 1.0 is even -> 1.0
                     one + ulp * 1.5,    # tie, 1+ulp is odd -> 1+2ulp
                     one + ulp * 0.51],  # above half -> 1+ulp
                    dtype=np.float32)
    out = tensors.from_bf16_bits(tensors.to_bf16_bits(vals))
    assert out.tolist() == [1.0, float(one + 2 * ulp), float(one + ulp)]
    assert np.isnan(tensors.from_bf16_bits(tensors.to_bf16_bits(np.array([np.nan])))[0])


def test_as_wire():
    x = np.linspace(-3, 3, 12, dtype=np.float64).reshape(3, 4)
    w = tensors.as_wire(x, "bf16")
    assert w.dtype == np.uint16 and w.flags.c_contiguous and w.shape == (3, 4)
    assert tensors.as_wire(w, "bf16") is not None and tensors.as_wire(w, "bf16").dtype == np.uint16
    f = tensors.as_wire(x.T, "f32")
    assert f.dtype == np.float32 and f.flags.c_contiguous
    with pytest.raises(ValueError):
        tensors.as_wire(x, "fp8")


def test_chunks_cover_exactly():
    data = np.arange(1000, dtype=np.uint16)
    pieces = list(tensors.chunks(data, chunk_bytes=300))
    assert [o for o, _ in pieces] == [0, 300, 600, 900, 1200, 1500, 1800]
    assert b"".join(p for _, p in pieces) == data.tobytes()


def test_identity_weight():
    eye = tensors.identity_qkv_weight(5)
    assert np.array_equal(tensors.from_bf16_bits(eye), np.eye(5, dtype=np.float32))
