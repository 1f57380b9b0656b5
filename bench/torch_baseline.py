#!/usr/bin/env python3
"""PyTorch baseline of one attention layer on bench_layer's seeded inputs, and the error check.

For each shape: regenerate x and W exactly as bench/bench_inputs.cu does, time
`qkv = x @ Wqkv.T` + scaled_dot_product_attention (cuDNN and FlashAttention backends, via
torch.nn.attention.sdpa_kernel) + the [N, H*d] output layout, with torch.cuda.max_memory_allocated
above the inputs; compute an FP32 reference of 64 sampled output rows and compare kvpack's rows
(written by bench_layer --rows_out) and the baseline's own rows with it. Prints one table.

  python3 bench/torch_baseline.py --kvpack results.jsonl --rows_dir /tmp --out torch.jsonl
"""
import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_hash import hash24  # noqa: E402  (bench/, on sys.path when run or imported from there)

def uniform(stream, idx):
    return hash24(stream, idx).to(torch.float32) * (1.0 / 16777216.0)


def make_inputs(n, hidden, heads, dim, dev):
    hd = heads * dim
    j = torch.arange(hidden, device=dev, dtype=torch.int64)
    mean = 0.8 * (2.0 * uniform(1, j) - 1.0)
    x = torch.empty(n, hidden, device=dev, dtype=torch.bfloat16)
    step = 4096
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        idx = torch.arange(r0 * hidden, r1 * hidden, device=dev, dtype=torch.int64)
        u = uniform(2, idx)
        v = mean.repeat(r1 - r0) + 1.7 * (2.0 * u - 1.0)
        v = torch.where(u > 0.9990234375, v + 6.0, v)
        x[r0:r1] = v.view(r1 - r0, hidden).to(torch.bfloat16)
    rows = 3 * hd
    base = torch.tensor(1.7320508, dtype=torch.float32) / torch.sqrt(torch.tensor(float(hidden), dtype=torch.float32))
    r = torch.arange(rows, device=dev)
    outlier = (r >= hd) & (r % 29 == 5)
    scale = torch.where(outlier, (base * 20.0).to(dev), base.to(dev))
    w = torch.empty(rows, hidden, device=dev, dtype=torch.bfloat16)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        idx = torch.arange(r0 * hidden, r1 * hidden, device=dev, dtype=torch.int64)
        t = (2.0 * uniform(3, idx) - 1.0).view(r1 - r0, hidden)
        w[r0:r1] = (t * scale[r0:r1, None]).to(torch.bfloat16)
    return x, w


def sample_rows(n):
    return [(i * n) // 64 + (i * 7) % max(1, n // 64) for i in range(64)]


def torch_layer(x, w, heads, dim, backend):
    n = x.shape[0]
    qkv = x @ w.T
    q, k, v = (t.view(n, heads, dim).transpose(0, 1).unsqueeze(0) for t in qkv.split(heads * dim, dim=1))
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(q, k, v)
    return o.squeeze(0).transpose(0, 1).reshape(n, heads * dim)


def rms_norm_(t, eps):
    """Per-head RMSNorm with unit weight over the last dim, in place (no squared copy of t)."""
    ms = torch.linalg.vector_norm(t, dim=-1, keepdim=True).square_().div_(t.shape[-1])
    return t.mul_(torch.rsqrt(ms.add_(eps)))


def reference_rows(x, w, heads, dim, rows, qk_norm_eps=None):
    """FP32 attention (no TF32) of the sampled query rows over all keys. With qk_norm_eps, q and k
    go through a per-head RMSNorm first (models with QK-norm; comfy-kitchen's sol_attn_chunked)."""
    n, hd = x.shape[0], heads * dim
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    wf = w.float()
    q = (x[rows].float() @ wf[:hd].T).view(len(rows), heads, dim).transpose(0, 1)   # [H, 64, d]
    if qk_norm_eps is not None:
        q = rms_norm_(q, qk_norm_eps)
    out = torch.zeros(heads, len(rows), dim, device=x.device)
    hs = max(1, 8 * 1024 * 1024 * 1024 // (n * dim * 4 * 2))
    for h0 in range(0, heads, hs):
        h1 = min(heads, h0 + hs)
        cols = slice(hd + h0 * dim, hd + h1 * dim)
        k = (x.float() @ wf[cols].T).view(n, h1 - h0, dim).transpose(0, 1)
        if qk_norm_eps is not None:
            k = rms_norm_(k, qk_norm_eps)
        vcols = slice(2 * hd + h0 * dim, 2 * hd + h1 * dim)
        v = (x.float() @ wf[vcols].T).view(n, h1 - h0, dim).transpose(0, 1)
        s = (q[h0:h1] @ k.transpose(1, 2)) / math.sqrt(dim)
        out[h0:h1] = torch.softmax(s, dim=-1) @ v
        del k, v, s
    torch.backends.cuda.matmul.allow_tf32 = prev
    return out.transpose(0, 1).reshape(len(rows), hd)


def rel_l2(a, b):
    return (torch.linalg.vector_norm(a.float() - b.float()) / torch.linalg.vector_norm(b.float())).item()


def time_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvpack", required=True, help="bench_layer JSON lines")
    ap.add_argument("--rows_dir", default="/tmp")
    ap.add_argument("--out", default="torch.jsonl")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ours = [json.loads(l) for l in open(args.kvpack) if l.startswith("{")]
    shapes = sorted({(r["n"], r["hidden"], r["heads"], r["dim"]) for r in ours})
    results = []
    for n, hidden, heads, dim in shapes:
        x, w = make_inputs(n, hidden, heads, dim, dev)
        rows = sample_rows(n)
        ref = reference_rows(x, w, heads, dim, rows)
        for r in ours:
            if (r["n"], r["hidden"], r["heads"], r["dim"]) != (n, hidden, heads, dim):
                continue
            path = f"{args.rows_dir}/rows_{n}_{dim}_{r['format']}_{r['in_place']}.bin"
            if r.get("tiling") == "wide":
                path = f"{args.rows_dir}/rows_wide.bin"
            tiled = f"{args.rows_dir}/rows_{n}_{dim}_{r['format']}_{r['in_place']}_{r.get('tiling', '').replace(':', '_')}.bin"
            if os.path.exists(tiled):  # one file per tiling, where a run keeps them apart
                path = tiled
            try:
                got = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.bfloat16).view(64, heads * dim)
                r["err_vs_fp32"] = rel_l2(got.to(dev), ref)
            except OSError:
                r["err_vs_fp32"] = float("nan")
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            rec = {"n": n, "hidden": hidden, "heads": heads, "dim": dim, "backend": name}
            try:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                o = torch_layer(x, w, heads, dim, backend)
                torch.cuda.synchronize()
                rec["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                rec["err_vs_fp32"] = rel_l2(o[rows], ref)
                del o
                rec["layer_ms"] = time_ms(lambda: torch_layer(x, w, heads, dim, backend), args.reps)
                qkv_ms = time_ms(lambda: x @ w.T, args.reps)
                rec["qkv_gemm_ms"] = qkv_ms
                rec["attention_ms"] = rec["layer_ms"] - qkv_ms
                rec["attention_tflops"] = 4.0 * n * n * dim * heads / (rec["attention_ms"] * 1e-3) / 1e12
            except Exception as e:  # a backend may refuse a shape
                rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            results.append(rec)
            torch.cuda.empty_cache()
        del x, w, ref
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        for r in ours + results:
            f.write(json.dumps(r) + "\n")

    print(f"\n{'shape':>22} {'impl':>22} {'layer ms':>9} {'attn ms':>9} {'TFLOP/s':>8} {'peak GiB':>9} "
          f"{'proj ms':>8} {'1xGEMM':>8} {'rel err':>8}")
    for r in sorted(ours, key=lambda r: (r["n"], r["dim"], r["format"], r["in_place"], r.get("tiling", ""))):
        shape = f"N={r['n']} {r['heads']}x{r['dim']}"
        impl = f"kvpack {r['format']}{' inpl' if r['in_place'] else ''} {r.get('tiling', '')}"
        print(f"{shape:>22} {impl:>22} {r['layer_ms']:9.1f} {r['attention_ms']:9.1f} {r['attention_tflops']:8.1f} "
              f"{r['layer_gib']:9.3f} {r['projection_ms']:8.2f} {r['unchunked_gemm_ms']:8.2f} {r.get('err_vs_fp32', float('nan')):8.4f}")
    for r in results:
        shape = f"N={r['n']} {r['heads']}x{r['dim']}"
        if "error" in r:
            print(f"{shape:>22} {'torch ' + r['backend']:>22}  {r['error']}")
            continue
        print(f"{shape:>22} {'torch ' + r['backend']:>22} {r['layer_ms']:9.1f} {r['attention_ms']:9.1f} "
              f"{r['attention_tflops']:8.1f} {r['peak_gib']:9.3f} {'':>8} {r['qkv_gemm_ms']:8.2f} {r['err_vs_fp32']:8.4f}")


if __name__ == "__main__":
    main()
