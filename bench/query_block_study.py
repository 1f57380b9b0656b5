"""Routing granularity of the block-sparse path (issue 13), emulated in numpy: how much accuracy is
lost when a routed list is shared by 128 queries (two 64-query blocks, the wgmma kernel's CTA: both
consumer groups would then walk the same pages with the dense loop's pipelining) instead of one list
per 64-query block (kvpack and Sol today), at the same computed fraction.

Inputs: `kvpack-eval --locality ... --dump DIR` (float32 q, k, v [N, H, d]). Pages are 64 keys; the
routing is kvpack's (cpu/sparse_attention.h) on unquantized K/V: a block's centroid · each page's
mean key, the top ceil(r · P) pages plus the block's diagonal pages and their ±1 neighbours; with the
tail every other page adds its mean key with weight 64 and its V sum. No causal mask, one sequence,
no sink pages. A 128-query block routes by the centroid of its 128 queries, forces the diagonal
pages of both halves ±1, and keeps the same top ceil(r · P). Error: rel L2 against float64 dense
attention over all queries (kvpack-eval's definition); fraction: exact pages / pages over (query,
head) rows.

    python3 bench/query_block_study.py --data /tmp/loc_locality:locality /tmp/loc_qknorm:qknorm
"""

import argparse
import math
import os

import numpy as np

PAGE = 64


def dense(q, k, v, scale):
    s = q @ k.T * scale
    s -= s.max(1, keepdims=True)
    p = np.exp(s)
    return (p @ v) / p.sum(1, keepdims=True)


def routed(q, k, v, scale, ratio, qblock, tail):
    """Sparse attention of one head; returns (output, exact pages summed over queries)."""
    n, d = q.shape
    pages = (n + PAGE - 1) // PAGE
    mean_k = np.stack([k[p * PAGE:(p + 1) * PAGE].mean(0) for p in range(pages)])
    v_sum = np.stack([v[p * PAGE:(p + 1) * PAGE].sum(0) for p in range(pages)])
    count = np.array([min(PAGE, n - p * PAGE) for p in range(pages)], dtype=np.float64)
    top = max(1, math.ceil(ratio * pages))
    out = np.empty_like(q)
    exact_rows = 0
    for b0 in range(0, n, qblock):
        b1 = min(n, b0 + qblock)
        qb = q[b0:b1]
        score = mean_k @ qb.mean(0)
        exact = np.zeros(pages, bool)
        exact[np.argsort(-score, kind="stable")[:top]] = True
        first, last = b0 // PAGE, (b1 - 1) // PAGE
        exact[max(0, first - 1):min(pages, last + 2)] = True
        keys = np.concatenate([np.arange(p * PAGE, min(n, (p + 1) * PAGE)) for p in np.nonzero(exact)[0]])
        s = qb @ k[keys].T * scale
        terms = [s]
        if tail and (~exact).any():
            pooled = np.nonzero(~exact)[0]
            sp = qb @ mean_k[pooled].T * scale
            terms.append(sp)
        m = np.max([t.max(1) for t in terms], axis=0)[:, None]
        e = np.exp(s - m)
        num, den = e @ v[keys], e.sum(1)
        if len(terms) > 1:
            ep = np.exp(terms[1] - m)
            num += ep @ v_sum[pooled]
            den += ep @ count[pooled]
        out[b0:b1] = num / den[:, None]
        exact_rows += exact.sum() * (b1 - b0)
    return out, exact_rows / (n * pages)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", required=True, help="DIR[:label] from kvpack-eval --dump")
    ap.add_argument("--topk", nargs="+", type=float, default=[0.1, 0.15, 0.2, 0.25, 0.3])
    args = ap.parse_args()
    print("| data | tail | top-k | 64-query blocks: fraction / rel L2 | 128-query blocks: fraction / rel L2 |")
    print("| --- | --- | ---: | ---: | ---: |")
    for item in args.data:
        path, _, label = item.partition(":")
        q, k, v = (np.load(os.path.join(path, f"{x}.npy")).astype(np.float64) for x in "qkv")
        n, heads, d = q.shape
        scale = 1.0 / math.sqrt(d)
        ref = [dense(q[:, h], k[:, h], v[:, h], scale) for h in range(heads)]
        ref_norm = math.sqrt(sum((r * r).sum() for r in ref))
        for tail in (True, False):
            for r in args.topk:
                cells = []
                for qblock in (64, 128):
                    e2, frac = 0.0, 0.0
                    for h in range(heads):
                        o, f = routed(q[:, h], k[:, h], v[:, h], scale, r, qblock, tail)
                        e2 += ((o - ref[h]) ** 2).sum()
                        frac += f / heads
                    cells.append(f"{frac:.3f} / {math.sqrt(e2) / ref_norm:.4f}")
                print(f"| {label or path} | {'on' if tail else 'off'} | {r:.2f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
