#!/usr/bin/env python3
"""The attention peers users run today, beside PyTorch SDPA, in one run on torch_baseline's inputs.

For each N: x and W exactly as bench_layer makes them (torch_baseline.make_inputs), qkv = x @ Wqkv.T
once in bf16 and q, k, v from it; then one method at a time: its attention alone (CUDA events, median
of --reps after a warm-up call), its peak memory above the inputs (torch.cuda.max_memory_allocated),
and the relative L2 error of 64 sampled output rows (all heads) against torch_baseline's FP32
reference. Every peer runs in its own try, so one failing API prints its exception and the rest run.

  cudnn, flash  torch SDPA under sdpa_kernel(CUDNN_ATTENTION / FLASH_ATTENTION), q/k/v [1, H, N, D]
  ck_int8       comfy_kitchen.int8_attention(q, k, v): [B, H, N, D], INT8 Q/K/V and P
  sage          sageattention.sageattn(q, k, v, tensor_layout="HND"): 1.0.6 is Triton, INT8 QKᵀ with
                K smoothing (it subtracts K's mean from k in place: it gets its own copy), fp16 PV
  sol           comfy_kitchen.sol_attn(q, k, v, topk_ratio=...): [B, N, H, 128], block-sparse, each
                64-query block attends its top-k fraction of 64-key blocks (plus the diagonal ±1)
                exactly and every other block through one pooled term
  sol_chunked   comfy_kitchen.sol_attn_chunked over [M, 3·H·128] qkv chunks, B = 1: the layer, with
                the projection streamed chunk by chunk into its INT8 workspace (layer ms, layer GiB),
                and over chunks of the stored qkv (attention ms). Its producer applies a per-head
                RMSNorm to q and k and RoPE: unit weights and the identity rotation here, so its error
                is against the FP32 reference with that norm (err_ref "fp32_qknorm"). It is timed in
                steady state: K mean and V scale from a previous call, as a model's later steps pass.

Sparse methods report their time and the dense-equivalent TFLOP/s (4·N²·d·H over it). The last
table also has x @ Wqkv.T alone (the projection every dense method's layer adds).

  PYTHONPATH=.carry/peers/site python3 bench/peers.py --n 32768 152263 --out peers.jsonl
"""
import argparse
import importlib.metadata
import json
import math
import sys
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_baseline import make_inputs, reference_rows, rel_l2, sample_rows, time_ms  # noqa: E402  (bench/)

HIDDEN, HEADS, DIM = 7168, 56, 128     # torch_baseline's layer (H3's attention: N = 152,263)
METHODS = ("cudnn", "flash", "ck_int8", "sage", "sol", "sol_chunked")
SOL_TOPK_RATIO = 0.2                   # issue 13's routed fraction
SOL_BLOCK = 64                         # Sol's query and key block, tokens
QK_NORM_EPS = 1e-6                     # sol_attn_chunked's rope_eps default: its RMSNorm epsilon
CHUNK_ROWS = 8192                      # sol_attn_chunked's qkv chunk (starts must be 64-aligned)
GIB = 2**30


class Shape:
    """One N's inputs: x [N, hidden] and W [3·H·D, hidden] bf16, qkv = x @ W.T [N, 3·H·D] and its
    q, k, v as contiguous [1, H, N, D]; the FP32 references of the sampled rows, made on first use."""

    def __init__(self, n, dev):
        self.n = n
        self.x, self.w = make_inputs(n, HIDDEN, HEADS, DIM, dev)
        self.qkv = self.x @ self.w.T
        self.q, self.k, self.v = (t.view(n, HEADS, DIM).transpose(0, 1).unsqueeze(0).contiguous()
                                  for t in self.qkv.split(HEADS * DIM, dim=1))
        self.rows = sample_rows(n)
        self._refs = {}

    def reference(self, qk_norm):
        if qk_norm not in self._refs:
            eps = QK_NORM_EPS if qk_norm else None
            self._refs[qk_norm] = reference_rows(self.x, self.w, HEADS, DIM, self.rows, qk_norm_eps=eps)
        return self._refs[qk_norm]


def rows_bhnd(o, rows):
    """The sampled rows of a [1, H, N, D] output as [64, H·D], the reference's layout."""
    return o[0, :, rows].transpose(0, 1).reshape(len(rows), -1)


def rows_bnhd(o, rows):
    return o[0, rows].reshape(len(rows), -1)


def dense_tflops(n, ms):
    return 4.0 * n * n * DIM * HEADS / (ms * 1e-3) / 1e12


def first_call(fn):
    """fn's result and its peak memory above what was allocated before it, GiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / GIB


def measure_attention(s, fn, to_rows, reps):
    """Peak and error on the first call, then the median time (time_ms warms up once more)."""
    out, peak = first_call(fn)
    err = rel_l2(to_rows(out, s.rows), s.reference(qk_norm=False))
    del out
    ms = time_ms(fn, reps)
    return {"attention_ms": ms, "attention_tflops": dense_tflops(s.n, ms), "peak_gib": peak,
            "err_vs_fp32": err, "err_ref": "fp32"}


def run_sdpa(backend):
    def run(s, args):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(s.q, s.k, s.v)
        return measure_attention(s, fn, rows_bhnd, args.reps)
    return run


def run_ck_int8(s, args):
    import comfy_kitchen as ck
    return measure_attention(s, lambda: ck.int8_attention(s.q, s.k, s.v), rows_bhnd, args.reps)


def run_sage(s, args):
    from sageattention import sageattn
    k = s.k.clone()  # sageattn subtracts K's mean from k in place (smooth_k)
    rec = measure_attention(s, lambda: sageattn(s.q, k, s.v, tensor_layout="HND", is_causal=False),
                            rows_bhnd, args.reps)
    rec["sage_args"] = "tensor_layout=HND, is_causal=False, smooth_k=True (default), sm_scale=1/sqrt(d)"
    return rec


def sol_routing(n, ratio):
    """What the top-k selects: comfy-kitchen's own count of key blocks per query block. The kernels
    add the diagonal ±1 blocks and keep ties at the threshold, so the computed fraction is a little
    above this; the API does not report it."""
    from comfy_kitchen.backends.eager.sol_attn import _topk_count
    blocks = math.ceil(n / SOL_BLOCK)
    kept = _topk_count(blocks, ratio)
    return {"sol_topk_ratio": ratio, "sol_key_blocks": blocks, "sol_topk_blocks": kept,
            "sol_routed_fraction": kept / blocks, "sol_args": "tau ignored (top-k), tail=True, token_aug=0"}


def run_sol(s, args):
    import comfy_kitchen as ck
    q, k, v = (t.transpose(1, 2).contiguous() for t in (s.q, s.k, s.v))   # its [B, N, H, 128]
    rec = measure_attention(s, lambda: ck.sol_attn(q, k, v, topk_ratio=args.topk_ratio), rows_bnhd, args.reps)
    rec.update(sol_routing(s.n, args.topk_ratio))
    return rec


def identity_rope(n, dev):
    """sol_attn_chunked's rope_freqs [N, 1, D/2, 2, 2] (a 2×2 rotation per channel pair over all D
    channels) as the identity, so that its output is attention over RMSNorm(q), RMSNorm(k)."""
    f = torch.zeros(n, 1, DIM // 2, 2, 2, device=dev)
    f[..., 0, 0] = 1.0
    f[..., 1, 1] = 1.0
    return f


def run_sol_chunked(s, args):
    import comfy_kitchen as ck
    n, dev = s.n, s.x.device
    freqs = identity_rope(n, dev)
    norm = torch.ones(DIM, dtype=torch.bfloat16, device=dev)

    def chunks(make):  # a zero-arg callable, so that each producer pass streams afresh
        return lambda: (make(r0, min(n, r0 + args.chunk)) for r0 in range(0, n, args.chunk))

    projected = chunks(lambda a, b: s.x[a:b] @ s.w.T)
    stored = chunks(lambda a, b: s.qkv[a:b])

    def layer(source, kmean, vscale):
        return ck.sol_attn_chunked(source, n, HEADS, freqs, (norm, norm), kmean=kmean, vscale=vscale,
                                   topk_ratio=args.topk_ratio, rope_eps=QK_NORM_EPS)

    _, kmean, vscale = layer(stored, None, None)  # this step's statistics, for the steady state
    (out, _, _), layer_peak = first_call(lambda: layer(projected, kmean, vscale))
    err = rel_l2(rows_bnhd(out, s.rows), s.reference(qk_norm=True))
    del out
    layer_ms = time_ms(lambda: layer(projected, kmean, vscale), args.reps)
    _, peak = first_call(lambda: layer(stored, kmean, vscale))
    ms = time_ms(lambda: layer(stored, kmean, vscale), args.reps)
    rec = {"attention_ms": ms, "attention_tflops": dense_tflops(n, ms), "peak_gib": peak,
           "layer_ms": layer_ms, "layer_peak_gib": layer_peak, "chunk_rows": args.chunk,
           "err_vs_fp32": err, "err_ref": "fp32_qknorm"}
    rec.update(sol_routing(n, args.topk_ratio))
    return rec


RUNNERS = {"cudnn": run_sdpa(SDPBackend.CUDNN_ATTENTION), "flash": run_sdpa(SDPBackend.FLASH_ATTENTION),
           "ck_int8": run_ck_int8, "sage": run_sage, "sol": run_sol, "sol_chunked": run_sol_chunked}


def environment():
    """Versions and what comfy-kitchen says it can run, once, for the log and the JSON lines."""
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for dist in ("comfy_kitchen", "sageattention", "triton"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    try:
        import comfy_kitchen as ck
        from comfy_kitchen.backends import cuda as ck_cuda
        env["ck_int8_available"] = ck.int8_attention_is_available()
        env["ck_sol_available"] = ck.sol_attn_is_available()
        env["ck_cuda_ext_error"] = ck_cuda._EXT_ERROR
    except Exception as e:  # the methods report it again, each in its own try
        env["ck_import_error"] = f"{type(e).__name__}: {e}"
    return env


def print_table(records):
    print(f"\n{'method':>12} {'N':>7} {'attn ms':>9} {'TFLOP/s':>8} {'layer ms':>9} {'layer GiB':>9} "
          f"{'peak GiB':>9} {'rel L2':>8}  note")
    blank = ""
    for r in records:
        head = f"{r['method']:>12} {r['n']:7d}"
        if "error" in r:
            print(f"{head}  {r['error']}")
        elif "gemm_ms" in r:
            print(f"{head} {r['gemm_ms']:9.1f} {blank:>47}  the projection alone (a dense method's layer adds it)")
        else:
            layer_ms = f"{r['layer_ms']:9.1f}" if "layer_ms" in r else f"{blank:>9}"
            layer_gib = f"{r['layer_peak_gib']:9.3f}" if "layer_peak_gib" in r else f"{blank:>9}"
            note = []
            if "sol_topk_blocks" in r:
                note.append(f"top-k {r['sol_topk_ratio']}: {r['sol_topk_blocks']}/{r['sol_key_blocks']} key blocks "
                            "+ diagonal; dense-equivalent TFLOP/s")
            if r["err_ref"] == "fp32_qknorm":
                note.append("error vs FP32 with the QK RMSNorm; layer: projection streamed")
            print(f"{head} {r['attention_ms']:9.1f} {r['attention_tflops']:8.1f} {layer_ms} {layer_gib} "
                  f"{r['peak_gib']:9.3f} {r['err_vs_fp32']:8.4f}  {'; '.join(note)}")


def run_all(args, dev, env, records):
    with open(args.out, "w") as out:
        def emit(rec):
            records.append(rec)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(json.dumps(rec), file=sys.stderr, flush=True)  # progress; stdout keeps the table

        for n in args.n:
            s = Shape(n, dev)
            base = {"n": n, "hidden": HIDDEN, "heads": HEADS, "dim": DIM, **env}
            gemm_ms = time_ms(lambda: s.x @ s.w.T, args.reps)
            emit({**base, "method": "x@Wqkv.T", "gemm_ms": gemm_ms})
            for method in args.methods:
                rec = {**base, "method": method}
                try:
                    rec.update(RUNNERS[method](s, args))
                except Exception as e:  # a peer may refuse a shape or fail to load; the others still run
                    traceback.print_exc(file=sys.stderr)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                emit(rec)
                torch.cuda.empty_cache()
            del s
            torch.cuda.empty_cache()



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[32768, 152263])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--topk_ratio", type=float, default=SOL_TOPK_RATIO)
    ap.add_argument("--chunk", type=int, default=CHUNK_ROWS)
    ap.add_argument("--out", default="peers.jsonl")
    args = ap.parse_args()
    if args.chunk % SOL_BLOCK:
        ap.error(f"--chunk must be a multiple of {SOL_BLOCK}")
    dev = torch.device("cuda")
    env = environment()
    print(json.dumps(env), flush=True)
    records = []
    try:
        run_all(args, dev, env, records)
    finally:  # what ran, also when a CUDA error ends the run
        print_table(records)


if __name__ == "__main__":
    main()
