"""Candidates for a better 4-bit K/V format (issue 15), emulated in numpy on the CPU: which quantizer
of the stored rows would halve format v1 INT4's attention error at <= 4.5 bits per value.

Inputs: the benchmark's (bench/bench_inputs.h, the same hash as bench/torch_baseline.py: x with
per-channel offsets and rare +6 spikes, W_k/W_v with every 29th row x20), a few heads of H3's
56 x 128 projection, N tokens; and the synthetic sets of kvpack-eval (outlier channels, sink tokens,
QK-normalised). Every candidate sees the same stored rows: K and V smoothed (channel mean of the
sample removed) and rotated by a random-sign Walsh-Hadamard matrix, as format v1 stores them; only
the row quantizer differs. The error is the attention output's rel L2 against float64 attention over
the unquantized K/V (queries exact), over a strided sample of queries, summed over heads; "K only"
and "V only" quantize one side. Bits per value count the codes and every scale/offset stored.

--balance applies kvpack's K/V balancing (λ from the K ranges and V RMS of the head, cpu/stats.cc)
before every quantizer, as format v1's full set stores rows; without it the v1 rows are about twice
kvpack's own error. The last candidates keep the head's widest channels (or principal directions)
apart, quantized on their own per row or per channel, and store the rest as v1 INT4 rows ("dense and
sparse"); --apart runs only those, v1 and INT5.

    python3 bench/int4_format_study.py [--n 4096 --heads 4 --queries 256] [--balance] [--apart]
"""

import argparse
import math

import numpy as np

from bench_hash import hash24  # bench_layer's seeded inputs (bench/bench_inputs.h)


def uniform(stream, idx):
    return hash24(stream, idx).astype(np.float64) * (1.0 / 16777216.0)


def bf16(a):
    b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def half(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float64)


def bench_heads(n, hidden, heads_total, dim, heads):
    """q, k, v [heads, n, dim] of the benchmark's layer (the first `heads` heads), float64."""
    j = np.arange(hidden, dtype=np.uint64)
    mean = 0.8 * (2.0 * uniform(1, j) - 1.0)
    idx = np.arange(n * hidden, dtype=np.uint64)
    u = uniform(2, idx)
    x = np.tile(mean, n) + 1.7 * (2.0 * u - 1.0)
    x = np.where(u > 0.9990234375, x + 6.0, x)
    x = bf16(x.reshape(n, hidden)).astype(np.float64)
    hd = heads_total * dim
    base = np.float32(1.7320508) / np.sqrt(np.float32(hidden))
    out = []
    for part in range(3):
        rows = part * hd + np.arange(heads * dim, dtype=np.uint64)
        widx = (rows[:, None] * np.uint64(hidden) + np.arange(hidden, dtype=np.uint64)[None, :]).ravel()
        t = (2.0 * uniform(3, widx) - 1.0).reshape(len(rows), hidden)
        outlier = (rows >= hd) & (rows % 29 == 5)
        scale = np.where(outlier, base * 20.0, base)
        w = bf16(t * scale[:, None]).astype(np.float64)
        out.append((x @ w.T).reshape(n, heads, dim).transpose(1, 0, 2))
    return out


def synthetic(n, heads, dim, kind, rng):
    """Structured sets in the spirit of kvpack-eval --data: outlier channels, sink tokens, QK-norm."""
    q = rng.standard_normal((heads, n, dim))
    k = rng.standard_normal((heads, n, dim))
    v = rng.standard_normal((heads, n, dim))
    off = rng.uniform(-2, 2, (heads, 1, dim))
    k += off
    if kind == "outliers":  # a few channels 20x, in K and V
        ch = rng.choice(dim, 6, replace=False)
        k[:, :, ch] *= 20.0
        v[:, :, ch[:3]] *= 20.0
        q *= 0.35
    elif kind == "sinks":  # a few tokens that every query attends, with near-zero V
        sinks = rng.choice(n, 4, replace=False)
        k[:, sinks] = 6.0 * q.mean(1, keepdims=True) / np.linalg.norm(q.mean(1, keepdims=True), axis=-1, keepdims=True) * math.sqrt(dim) ** 0.5
        v[:, sinks] *= 0.03
        v += rng.uniform(-1.5, 1.5, (heads, 1, dim))
        q *= 0.4
    elif kind == "qknorm":  # RMS-normalised q and k, as H3's RMSNorm
        q /= np.sqrt((q * q).mean(-1, keepdims=True))
        k /= np.sqrt((k * k).mean(-1, keepdims=True))
        q *= 2.0
    return q, k, v


def hadamard(d, seed):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], d)
    return (h * signs[None, :]) / math.sqrt(d)  # orthogonal: rows · R, back with · Rᵀ


# ── row quantizers: rows [m, d] -> (dequantized rows, bits per value) ─────────────────────────────
def v1_int4(r):
    """Format v1: asymmetric per row, 16 levels, fp16 scale and offset."""
    lo = half(r.min(1, keepdims=True))
    scale = half((r.max(1, keepdims=True) - lo) / 15)
    scale = np.where(scale > 0, scale, 1.0)
    c = np.clip(np.round((r - lo) / scale), 0, 15)
    return lo + c * scale, 4 + 32 / r.shape[1]


def grouped(quant, g):
    def q(r):
        m, d = r.shape
        y, bits = quant(r.reshape(m * d // g, g))
        return y.reshape(m, d), bits
    return q


def asym_int(levels, scale_bits=16):
    def q(r):
        lo = half(r.min(1, keepdims=True))
        scale = half((r.max(1, keepdims=True) - lo) / (levels - 1))
        scale = np.where(scale > 0, scale, 1.0)
        c = np.clip(np.round((r - lo) / scale), 0, levels - 1)
        return lo + c * scale, math.log2(levels) + 2 * scale_bits / r.shape[1]
    return q


def e8m0(a):
    """Power-of-two scale at or above a (OCP MX's e8m0)."""
    return np.exp2(np.ceil(np.log2(np.maximum(a, 1e-30))))


def sym_mx(r):
    """Symmetric 4-bit (-7..7) with an e8m0 scale per row (MXINT4-like when rows are groups of 32)."""
    s = e8m0(np.abs(r).max(1, keepdims=True) / 7)
    return np.clip(np.round(r / s), -7, 7) * s, 4 + 8 / r.shape[1]


NF4 = np.array([-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1848440, -0.0910500, 0.0,
                0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0])


def codebook_absmax(book):
    def q(r):
        s = half(np.abs(r).max(1, keepdims=True))
        s = np.where(s > 0, s, 1.0)
        z = r / s
        c = np.abs(z[..., None] - book).argmin(-1)
        return book[c] * s, 4 + 16 / r.shape[1]
    return q


def lloyd_max_gaussian(levels=16, iters=200):
    """Lloyd-Max levels for a unit Gaussian (MSE-optimal scalar quantizer)."""
    z = np.random.default_rng(0).standard_normal(400_000)
    book = np.quantile(z, (np.arange(levels) + 0.5) / levels)
    for _ in range(iters):
        edges = (book[1:] + book[:-1]) / 2
        c = np.searchsorted(edges, z)
        book = np.array([z[c == i].mean() for i in range(levels)])
    return book


def codebook_rms(book):
    def q(r):
        s = half(np.sqrt((r * r).mean(1, keepdims=True)))
        s = np.where(s > 0, s, 1.0)
        z = r / s
        edges = (book[1:] + book[:-1]) / 2
        return book[np.searchsorted(edges, z)] * s, 4 + 16 / r.shape[1]
    return q


def lloyd_max_rows(levels=16, iters=12):
    """Lloyd-Max per row (the row's own 16 levels, stored as fp16 each: a codebook per row)."""
    def q(r):
        out = np.empty_like(r)
        for i in range(r.shape[0]):
            x = np.sort(r[i])
            book = np.quantile(x, (np.arange(levels) + 0.5) / levels)
            for _ in range(iters):
                edges = (book[1:] + book[:-1]) / 2
                c = np.searchsorted(edges, x)
                book = np.array([x[c == j].mean() if np.any(c == j) else book[j] for j in range(levels)])
            book = half(book)
            edges = (book[1:] + book[:-1]) / 2
            out[i] = book[np.searchsorted(edges, r[i])]
        return out, 4 + 16 * levels / r.shape[1]
    return q


# ── attention error ─────────────────────────────────────────────────────────────────────────────
def attention(q, k, v):
    s = q @ k.T / math.sqrt(q.shape[1])
    s -= s.max(1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(1, keepdims=True)
    return p @ v


def int8_sym_rows(r):
    """INT8 symmetric per row, fp16 scale (the channels kept apart below)."""
    s = half(np.abs(r).max(1, keepdims=True) / 127)
    s = np.where(s > 0, s, 1.0)
    return np.clip(np.round(r / s), -127, 127) * s


def rotated(quant):
    """A row quantizer of the rotated rows, as format v1 stores them: rows [m, d] unrotated in, out."""
    def q(r, rot):
        y, bits = quant(r @ rot)
        return y @ rot.T, bits
    return q


def channels_apart(c, apart="int8"):
    """Dense and sparse: the c widest channels of the head (by range over its rows) kept apart per
    row (INT8 symmetric + fp16 scale, or bf16), the rest rotated and stored as v1 INT4 rows (the
    apart channels zeroed before the rotation). Costs 8 or 16 bits per apart channel and value."""
    def q(r, rot):
        m, d = r.shape
        wide = np.argsort(-(r.max(0) - r.min(0)))[:c]
        rest = r.copy()
        rest[:, wide] = 0.0
        y, _ = v1_int4(rest @ rot)
        y = y @ rot.T
        if apart == "int8":      # per row: an fp16 scale per row for its c values
            y[:, wide], extra = int8_sym_rows(r[:, wide]), c * 8 + 16
        elif apart == "int8c":   # per channel: the head's scale table (max |value| / 127), no row bytes
            s = half(np.abs(r[:, wide]).max(0, keepdims=True) / 127)
            y[:, wide], extra = np.clip(np.round(r[:, wide] / s), -127, 127) * s, c * 8
        else:
            y[:, wide], extra = bf16(r[:, wide]), c * 16
        return y, 4 + 32 / d + extra / d
    return q


def principal_apart(c):
    """The c principal directions of the head's rows (their covariance's top eigenvectors, a d x c
    basis stored per head) kept apart per row as INT8 coefficients, the remainder rotated as v1 INT4."""
    def q(r, rot):
        m, d = r.shape
        w, u = np.linalg.eigh(r.T @ r / m)
        basis = u[:, np.argsort(-w)[:c]]
        coef = r @ basis
        rest = r - coef @ basis.T
        y, _ = v1_int4(rest @ rot)
        return y @ rot.T + int8_sym_rows(coef) @ basis.T, 4 + 32 / d + (c * 8 + 16) / d
    return q


def balance_lambda(x, spread):
    """kvpack's λ of one head (cpu/stats.cc BalanceFromSpreads): sqrt of the channel's spread over
    the geometric mean of those roots (spreads floored at kLambdaFloor of the widest)."""
    s = np.sqrt(np.maximum(spread, 1e-4 * spread.max()))
    return s / np.exp(np.log(s).mean())


def study(q, k, v, quantizers, queries, seed=7, balance=False):
    heads, n, d = k.shape
    rows = (np.arange(queries) * n) // queries
    rot = hadamard(d, seed)
    ref = [attention(q[h][rows], k[h], v[h]) for h in range(heads)]
    ref_norm = math.sqrt(sum((r * r).sum() for r in ref))
    table = {}
    for name, quant in quantizers:
        errs = {}
        bits = None
        stored = []
        for h in range(heads):
            mu_k, mu_v = k[h].mean(0), v[h].mean(0)
            lam = np.ones(d)
            lam_v = np.ones(d)
            if balance:   # K range and V RMS, as kvpackd's stats pre-pass
                lam = balance_lambda(k[h], np.abs(k[h] - mu_k).max(0))
                lam_v = balance_lambda(v[h], np.sqrt(((v[h] - mu_v) ** 2).mean(0)))
            kq, bits = quant((k[h] - mu_k) / lam, rot)
            vq, _ = quant((v[h] - mu_v) / lam_v, rot)
            stored.append((kq * lam + mu_k, vq * lam_v + mu_v))
        for side in ("both", "K only", "V only"):
            e2 = 0.0
            for h in range(heads):
                kk = stored[h][0] if side != "V only" else k[h]
                vv = stored[h][1] if side != "K only" else v[h]
                o = attention(q[h][rows], kk, vv)
                e2 += ((o - ref[h]) ** 2).sum()
            errs[side] = math.sqrt(e2) / ref_norm
        table[name] = (bits, errs)
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--sets", default="bench,outliers,sinks,qknorm")
    ap.add_argument("--balance", action="store_true",
                    help="K and V balanced by kvpack's λ before every quantizer (format v1's full set)")
    ap.add_argument("--apart", action="store_true",
                    help="only v1, INT5 and the candidates that keep channels or directions apart")
    args = ap.parse_args()
    lm = lloyd_max_gaussian()
    # Every candidate maps (rows, R) to dequantized rows and bits per value; the row quantizers of the
    # rotated rows through rotated().
    quantizers = [(name, rotated(q)) for name, q in [
        ("v1 INT4 (row asym, fp16 lo+scale)", v1_int4),
        ("INT4 asym, groups of 64 (fp16)", grouped(asym_int(16), 64)),
        ("INT4 asym, groups of 32 (fp16)", grouped(asym_int(16), 32)),
        ("MXINT4: sym, groups of 32, e8m0", grouped(sym_mx, 32)),
        ("NF4 codebook, row absmax", codebook_absmax(NF4)),
        ("NF4 codebook, groups of 64", grouped(codebook_absmax(NF4), 64)),
        ("Lloyd-Max Gaussian, row RMS", codebook_rms(lm)),
        ("Lloyd-Max Gaussian, groups of 64 RMS", grouped(codebook_rms(lm), 64)),
        ("INT5 asym row (reference: 5 bits)", asym_int(32)),
    ]]
    apart = [
        ("4 widest channels apart (INT8), rest v1 INT4", channels_apart(4)),
        ("2 widest channels apart (bf16), rest v1 INT4", channels_apart(2, "bf16")),
        ("4 widest channels apart (INT8, per-channel scale), rest v1 INT4", channels_apart(4, "int8c")),
        ("6 widest channels apart (INT8, per-channel scale), rest v1 INT4", channels_apart(6, "int8c")),
        ("8 widest channels apart (INT8, per-channel scale), rest v1 INT4", channels_apart(8, "int8c")),
        ("4 principal directions apart (INT8), rest v1 INT4", principal_apart(4)),
    ]
    if args.apart:
        quantizers = [quantizers[0], quantizers[-1]] + apart
    else:
        quantizers += apart
    rng = np.random.default_rng(11)
    for name in args.sets.split(","):
        if name == "bench":
            q, k, v = bench_heads(args.n, 7168, 56, 128, args.heads)
        else:
            q, k, v = synthetic(args.n, args.heads, 128, name, rng)
        table = study(q, k, v, quantizers, args.queries, balance=args.balance)
        base = table[quantizers[0][0]][1]["both"]
        print(f"\n{name}: N={args.n}, {args.heads} heads x 128, {args.queries} queries"
              f"{', balanced (λ)' if args.balance else ''}")
        print(f"| quantizer | bits/value | rel L2 | x v1 | K only | V only |")
        print(f"| --- | ---: | ---: | ---: | ---: | ---: |")
        for qn, (bits, e) in table.items():
            print(f"| {qn} | {bits:.3f} | {e['both']:.4f} | {e['both'] / base:.2f} | {e['K only']:.4f} | {e['V only']:.4f} |")


if __name__ == "__main__":
    main()
