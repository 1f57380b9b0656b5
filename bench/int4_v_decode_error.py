"""The INT4 V decode's rounding (kernels/cuda/wgmma_pages.cuh, Int4Bf16Unit) against format.h's exact
decode, in units of the quantization step, on random rows of 8 channels: the numbers its comment quotes.

    python3 bench/int4_v_decode_error.py
"""
import numpy as np


def bf16(x):
    """Round float32 to the nearest bf16 (ties to even), as float32."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def half(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


rng = np.random.default_rng(1)
for centred in (True, False):
    rows = 200_000
    v = rng.standard_normal((rows, 8)).astype(np.float32) * rng.uniform(0.2, 3, (rows, 1)).astype(np.float32)
    if not centred:
        v += rng.uniform(-40, 40, (rows, 1)).astype(np.float32)
    lo = half(v.min(1, keepdims=True))
    scale = half((v.max(1, keepdims=True) - lo) / 15)
    code = np.clip(np.round((v - lo) / scale), 0, 15).astype(np.float32)
    exact = lo.astype(np.float64) + code * scale.astype(np.float64)
    s_hi, l_hi = bf16(scale), bf16(lo)
    decodes = {
        "fp32 decode, bf16 out": bf16(lo + code * scale),
        "two-part scale and lo": bf16(bf16(code * s_hi + l_hi) + bf16(code * bf16(scale - s_hi) + bf16(lo - l_hi))),
        "one bf16x2 FMA (kernel)": bf16(code * s_hi.astype(np.float64) + l_hi),
    }
    step = scale.astype(np.float64)
    print(f"{'centred' if centred else 'uncentred'} rows: quantization RMS {np.sqrt((((v - exact) / step) ** 2).mean()):.3f} step")
    for name, d in decodes.items():
        err = (d - exact) / step
        print(f"  {name:24s} RMS {np.sqrt((err ** 2).mean()):.4f}  max {np.abs(err).max():.3f} step")
