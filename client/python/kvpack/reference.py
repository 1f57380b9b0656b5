"""A float64 numpy reference of one kvpack attention layer, unquantized: what the daemon computes
before packing K/V, following kernels/layer_spec.h. Used by the tests (daemon output against it)
and by kvpack.torch as the shape of its local fallback.

Layer: qkv = x·Wᵀ + bias, rows of W are [q | k | v] (nn.Linear layout); optional per-head RMS norm
of q and k, then RoPE, then softmax(q·kᵀ·scale)·v per head, a query seeing only keys of its own
sequence (and, causal, at positions ≤ its own).
"""

import numpy as np

ROPE_NONE, ROPE_INTERLEAVED, ROPE_SPLIT_HALVES = 0, 1, 2


def rms_norm(t, weight, eps):
    """t [N, H, d]; weight [d] or [H·d]: t · rsqrt(mean(t²) + eps) · w per (token, head)."""
    n, h, d = t.shape
    w = np.asarray(weight, dtype=np.float64).reshape(-1)
    w = w.reshape(1, 1, d) if w.size == d else w.reshape(1, h, d)
    return t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + eps) * w


def rope(t, positions, layout, axis_dims, theta=10000.0):
    """Rotates the first R = Σ axis_dims channels of each head of t [N, H, d] in place of a copy.
    Pair j (interleaved: channels 2j, 2j+1; split halves: j, j + R/2) belongs to the axis whose
    section of axis_dims[a]/2 pairs holds it and turns by positions[:, a] · theta^(−2i/axis_dims[a])."""
    if layout == ROPE_NONE:
        return t
    t = np.array(t, dtype=np.float64)
    pos = np.asarray(positions, dtype=np.float64).reshape(t.shape[0], -1)
    r = int(sum(axis_dims))
    angles = []
    for a, dim in enumerate(axis_dims):
        i = np.arange(dim // 2, dtype=np.float64)
        angles.append(pos[:, a:a + 1] * theta ** (-2.0 * i / dim))      # [N, dim/2]
    ang = np.concatenate(angles, axis=1)[:, None, :]                      # [N, 1, R/2]
    if layout == ROPE_INTERLEAVED:
        a_idx, b_idx = np.arange(0, r, 2), np.arange(1, r, 2)
    elif layout == ROPE_SPLIT_HALVES:
        a_idx, b_idx = np.arange(r // 2), np.arange(r // 2, r)
    else:
        raise ValueError(f"unknown RoPE layout {layout}")
    x0, x1 = t[..., a_idx].copy(), t[..., b_idx].copy()
    t[..., a_idx] = x0 * np.cos(ang) - x1 * np.sin(ang)
    t[..., b_idx] = x0 * np.sin(ang) + x1 * np.cos(ang)
    return t


def attention_layer(x, w_qkv, n_heads, head_dim, *, bias=None, q_norm_weight=None,
                    k_norm_weight=None, eps=1e-6, positions=None, rope_layout=ROPE_NONE,
                    axis_dims=(), theta=10000.0, seq_ids=None, causal=False, softmax_scale=0.0):
    """x [N, D] and w_qkv [3·H·d, D] as float arrays; returns the output [N, H·d] (float64)."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w_qkv, dtype=np.float64)
    n, hd = x.shape[0], n_heads * head_dim
    qkv = x @ w.T
    if bias is not None:
        qkv = qkv + np.asarray(bias, dtype=np.float64)
    q, k, v = (qkv[:, i * hd:(i + 1) * hd].reshape(n, n_heads, head_dim) for i in range(3))
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    if rope_layout != ROPE_NONE:
        q = rope(q, positions, rope_layout, axis_dims, theta)
        k = rope(k, positions, rope_layout, axis_dims, theta)
    scale = softmax_scale or 1.0 / np.sqrt(head_dim)
    seq = np.zeros(n, dtype=np.int64) if seq_ids is None else np.asarray(seq_ids)
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= np.arange(n)[None, :] <= np.arange(n)[:, None]
    out = np.empty((n, n_heads, head_dim))
    for h in range(n_heads):
        s = (q[:, h] @ k[:, h].T) * scale
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[:, h] = p @ v[:, h]
    return out.reshape(n, hd)


def seq_ids_from_ranges(ranges, n_tokens):
    """Per-token sequence ids from (begin, end, seq_id) triples that tile [0, n_tokens)."""
    ids = np.zeros(n_tokens, dtype=np.int64)
    for begin, end, seq_id in ranges:
        ids[begin:end] = seq_id
    return ids
