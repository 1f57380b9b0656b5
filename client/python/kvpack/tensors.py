"""Host tensors for the wire: bf16 bits in numpy, and the byte chunks of inline transfers.

numpy has no bfloat16, so bf16 tensors are numpy uint16 arrays holding the bit patterns (the
layout the daemon reads: little-endian, row-major). Conversions round to nearest even, as the
daemon does.
"""

import numpy as np

CHUNK_BYTES = 1 << 20   # inline chunk size: well under gRPC's 4 MiB default message limit


def to_bf16_bits(a):
    """float array -> uint16 bf16 bits, rounded to nearest even; NaN stays NaN."""
    f = np.ascontiguousarray(a, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded)


def from_bf16_bits(bits):
    """uint16 bf16 bits -> float32 array of the same shape (exact)."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def as_wire(a, dtype):
    """The contiguous little-endian array the daemon expects for a tensor of `dtype` ("bf16" or
    "f32"). Accepts float arrays (converted) or, for bf16, uint16 bit arrays (taken as they are)."""
    a = np.asarray(a)
    if dtype == "bf16":
        return np.ascontiguousarray(a) if a.dtype == np.uint16 else to_bf16_bits(a)
    if dtype == "f32":
        return np.ascontiguousarray(a, dtype="<f4")
    raise ValueError(f"unknown wire dtype {dtype!r}")


def chunks(buf, chunk_bytes=CHUNK_BYTES):
    """(offset, bytes) pieces covering `buf` (anything with the buffer protocol), in order."""
    view = memoryview(buf).cast("B")
    for offset in range(0, len(view), chunk_bytes):
        yield offset, view[offset:offset + chunk_bytes].tobytes()


def identity_qkv_weight(width):
    """bf16 bits of the [width, width] identity: with x = [q | k | v] per token and this weight,
    the daemon's projection hands q, k and v through unchanged (see kvpack.comfy)."""
    eye = np.zeros((width, width), dtype=np.uint16)
    np.fill_diagonal(eye, 0x3F80)   # bf16 1.0
    return eye
