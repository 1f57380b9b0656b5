"""The INT4 V decode's rounding (kernels/cuda/page_codec.cuh, Int4Bf16Unit) against format.h's exact
decode, in quantization steps, on random rows of 8 channels, centred (smoothing on) and not: the
numbers its comment quotes.

    python3 bench/int4_v_decode_error.py
"""
import numpy as np


def bf16(x):
    """Round to the nearest bf16 (ties to even), as float32."""
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
    s_rest, l_rest = bf16(scale - s_hi), bf16(lo - l_hi)
    fma = lambda a, b, c: bf16(a.astype(np.float64) * b + c)  # one rounding, as HFMA2
    decodes = {
        "fp32 decode, bf16 out": bf16(lo + code * scale),
        "lo split (the kernel)": bf16(fma(code, s_hi, l_hi) + l_rest),
        "scale and lo split": bf16(fma(code, s_hi, l_hi) + fma(code, s_rest, l_rest)),
        "one bf16x2 FMA": fma(code, s_hi, l_hi),
    }
    step = scale.astype(np.float64)
    quant = np.sqrt((((v - exact) / step) ** 2).mean())
    print(f"{'centred' if centred else 'uncentred'} rows (quantization RMS {quant:.3f} step):")
    for name, d in decodes.items():
        err = (d - exact) / step
        print(f"  {name:22s} RMS {np.sqrt((err ** 2).mean()):.4f}  max {np.abs(err).max():.3f} step")
