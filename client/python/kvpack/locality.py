"""Synthetic Q/K/V with spatial-temporal locality: the generator of kernels/cpu/locality_data.h in
numpy (same formulas and constants; numpy's own random stream, so not the same numbers). Data to
try block-sparse attention (LayerOptions.sparse) on, and its counterpart without locality.

Tokens: `text_tokens` leading text tokens, then a frames × height × width grid in raster order. Per
head: a smooth field F(u) = Σ_m a_m cos(2π ω_m·u + φ_m) / √M over the grid position u ∈ [0, 1)³
(M = MODES low-frequency modes, integer frequencies 0..MAX_FREQUENCY per axis), and
    K = off + σ ⊙ (F_K(u) + NOISE · z),   V likewise with its own field,
    Q = g · (F_K(u) + NOISE · z')          (the field at its own place: near keys share it)
with per-channel offsets off ~ N(0, 1.5²), scales σ = exp(N(0, 0.3²)), a few outlier channels
(× outlier_scale), and g setting the std of the logits scale·q·k to LOGIT_STD. Text tokens (and
every token with iid=True) take i.i.d. N(0, I) rows instead of the field; with iid=True Q takes the
row of a random other token. qk_norm=True RMS-normalises q and k rows and multiplies them by a
per-channel gain exp(N(0, 0.2²)), as RMSNorm does, before the temperature is set.
"""

import numpy as np

MODES = 12
MAX_FREQUENCY = 2
NOISE = 0.35
LOGIT_STD = 3.0
OUTLIER_CHANNELS_K = 4
OUTLIER_CHANNELS_V = 2


def _channels(rng, d, n_outliers, outlier_scale):
    off = 1.5 * rng.standard_normal(d)
    sigma = np.exp(0.3 * rng.standard_normal(d))
    for c in rng.integers(0, d, n_outliers):
        off[c] *= outlier_scale
        sigma[c] *= outlier_scale
    return off, sigma


def _field(rng, d, u):
    amp = rng.standard_normal((MODES, d))
    omega = rng.integers(0, MAX_FREQUENCY + 1, (MODES, 3)).astype(np.float64)
    phase = rng.uniform(0.0, 2 * np.pi, MODES)
    w = np.cos(2 * np.pi * u @ omega.T + phase) / np.sqrt(MODES)   # [n, MODES]
    return w @ amp


def locality_data(frames=4, height=16, width=16, text_tokens=0, n_heads=1, head_dim=64,
                  outlier_scale=5.0, qk_norm=False, iid=False, softmax_scale=0.0, seed=1):
    """(q, k, v), each float32 [text_tokens + frames·height·width, n_heads, head_dim]."""
    rng = np.random.default_rng(seed)
    grid = frames * height * width
    n, d = text_tokens + grid, head_dim
    g = np.arange(grid)
    plane = height * width
    u = np.stack([(g // plane) / frames, ((g % plane) // width) / height, (g % width) / width], 1)
    scale = softmax_scale if softmax_scale > 0 else 1.0 / np.sqrt(d)
    q = np.empty((n, n_heads, d))
    k = np.empty_like(q)
    v = np.empty_like(q)
    for h in range(n_heads):
        fk = rng.standard_normal((n, d))
        fv = rng.standard_normal((n, d))
        if not iid:
            fk[text_tokens:] = _field(rng, d, u)
            fv[text_tokens:] = _field(rng, d, u)
        off_k, sig_k = _channels(rng, d, OUTLIER_CHANNELS_K, outlier_scale)
        off_v, sig_v = _channels(rng, d, OUTLIER_CHANNELS_V, outlier_scale)
        k[:, h] = off_k + sig_k * (fk + NOISE * rng.standard_normal((n, d)))
        v[:, h] = off_v + sig_v * (fv + NOISE * rng.standard_normal((n, d)))
        src = rng.integers(0, n, n) if iid else np.arange(n)
        q[:, h] = fk[src] + NOISE * rng.standard_normal((n, d))
        if qk_norm:
            for x in (q, k):
                rows = x[:, h]
                rms = np.sqrt((rows ** 2).mean(1, keepdims=True) + 1e-6)
                x[:, h] = rows / rms * np.exp(0.2 * rng.standard_normal(d))
        qs = q[np.linspace(0, n - 1, min(n, 64)).astype(int), h]
        ks = k[np.linspace(0, n - 1, min(n, 1024)).astype(int), h]
        spread = (scale * qs @ ks.T).std(axis=1).mean()
        q[:, h] *= LOGIT_STD / spread if spread > 0 else 1.0
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)
