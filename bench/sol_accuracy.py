#!/usr/bin/env python3
"""comfy-kitchen's Sol attention on kvpack's locality data: error vs dense FP64 attention, per top-k.

Issue 13 asks that kvpack's block-sparse path be no less accurate than `sol_attn` at the same computed
fraction, on the same inputs. The inputs are `kvpack-eval --locality ... --dump DIR` (float32 q, k, v
[N, H, d]; Sol needs d = 128); for each DIR and top-k ratio this runs

  comfy_kitchen.sol_attn(q, k, v, topk_ratio=R, tail=T)   bf16 [1, N, H, 128], scale 1/sqrt(d)

and, as the floor every bf16 method sits on, dense SDPA over the same bf16 inputs, and prints rel_l2
and the mean cosine over (query, head) rows — kvpack-eval's definitions (kernels/cpu/quality.cc
CompareOutputs) — against FP64 attention of the float32 inputs. kvpack's own figures come from
kvpack-eval on the same DIR in the same run (bench/h200.sh peers with SOL_ACCURACY=1).

  PYTHONPATH=.carry/peers/site python3 bench/sol_accuracy.py --data /tmp/loc:locality --topk 0.1 0.2 0.3
"""
import argparse
import json
import os
import traceback

import numpy as np
import torch
import torch.nn.functional as F


def load(path):
    q, k, v = (torch.from_numpy(np.load(os.path.join(path, f"{name}.npy"))) for name in "qkv")
    return q, k, v


def reference(q, k, v):
    """FP64 attention, [N, H, d], one head at a time."""
    out = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    scale = q.shape[-1] ** -0.5
    for h in range(q.shape[1]):
        qh, kh, vh = (t[:, h].to("cuda", torch.float64) for t in (q, k, v))
        out[:, h] = torch.softmax(qh @ kh.T * scale, dim=-1) @ vh
    return out


def compare(ref, out):
    """rel_l2 over everything and the mean cosine of (query, head) rows, as CompareOutputs."""
    out = out.to(torch.float64)
    err = (out - ref).pow(2).sum()
    rel = (err / ref.pow(2).sum()).sqrt().item()
    dot = (out * ref).sum(-1)
    norms = (out.pow(2).sum(-1) * ref.pow(2).sum(-1)).sqrt()
    cos = torch.where(norms > 0, dot / norms, torch.ones_like(dot)).mean().item()
    return rel, cos


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", required=True, help="DIR[:label] from kvpack-eval --dump")
    ap.add_argument("--topk", nargs="+", type=float, default=[0.1, 0.2, 0.3])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import comfy_kitchen as ck
    rows = []
    for spec in args.data:
        path, _, label = spec.partition(":")
        q, k, v = load(path)
        ref = reference(q, k, v)
        qb, kb, vb = (t.to("cuda", torch.bfloat16).unsqueeze(0).contiguous() for t in (q, k, v))  # [1, N, H, d]
        dense = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qb, kb, vb))).transpose(1, 2)
        rel, cos = compare(ref, dense[0])
        rows.append({"data": label or path, "method": "sdpa bf16 dense", "topk": 1.0, "tail": None,
                     "rel_l2": rel, "cosine": cos})
        for r in args.topk:
            for tail in (True, False):
                rec = {"data": label or path, "method": "sol_attn", "topk": r, "tail": tail}
                try:
                    out = ck.sol_attn(qb, kb, vb, topk_ratio=r, tail=tail)
                    torch.cuda.synchronize()
                    rec["rel_l2"], rec["cosine"] = compare(ref, out[0])
                except Exception as e:  # noqa: BLE001  (report and go on)
                    rec["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                rows.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"{'data':10} {'method':16} {'top-k':>5} {'tail':>5} {'rel_l2':>9} {'cosine':>9}")
    for r in rows:
        tail = "-" if r["tail"] is None else ("on" if r["tail"] else "off")
        if "error" in r:
            print(f"{r['data']:10} {r['method']:16} {r['topk']:5.2f} {tail:>5} {r['error']}")
        else:
            print(f"{r['data']:10} {r['method']:16} {r['topk']:5.2f} {tail:>5} {r['rel_l2']:9.4f} {r['cosine']:9.5f}")


if __name__ == "__main__":
    main()
