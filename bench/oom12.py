#!/usr/bin/env python3
"""The request's 12 GiB out-of-memory case, end to end on a big GPU (bench/h200.sh daemon mode, OOM12=1).

The user's card: "GPU 0 has a total capacity of 11.94 GiB ... 6.09 GiB is allocated by PyTorch",
and H3's fused QKV (x @ W_qkvᵀ, [152,263, 21,504] bf16 = 6.10 GiB) did not fit. Here:

 1. the cap: a ballast of (total − 11.94 GiB) bytes (torch.empty) makes the rest of the device
    unusable, so everything else — this process's CUDA context, kvpackd's context and pool — must
    fit in 11.94 GiB, as on the user's card (whose 11.94 GiB also held its context);
 2. held: 6.09 GiB in all by this process — x, W_qkv and "other model tensors" (a second
    allocation of 6.09 GiB − x − W), the request's "allocated by PyTorch" (--held_on_top: 6.09 GiB
    of other tensors on top of x and W instead);
 3. (a) PyTorch: x @ W_qkvᵀ → RMSNorm(q, k) → split-half RoPE → SDPA (cuDNN): the stage that ran
    out of memory and the bytes it asked for;
 4. (b) kvpackd (--backend=cuda, started now with --vram_budget = a fraction of what is left):
    x, W and the output [N, H·d] (allocated here, as the model would) as CUDA IPC regions —
    H3's hidden (5376) is not H·d (7168), so the output cannot overwrite x; (c) per mode (mixed:
    text BF16/INT8, reference video INT8/INT4, generated video INT4; all INT4; all INT8; all BF16)
    one layer; the device's used memory polled by NVML (a thread here, ~10 ms) gives the peak
    under the cap;
 5. the cap released: PyTorch again without it (its peak above the inputs and time), then the
    float64 attention of a seeded sample of query rows and heads over ALL keys from the same x, W,
    norm weights and positions (bench/oom12_ref.py), and each run's error against it.

Prints "FIGURE oom12 ..." lines and writes JSON lines to --out (default $OUT/oom12.jsonl).
A tiny run first: --n 8192 (h200.sh: OOM12_N="8192 152263") keeps the cap, scales held to N (a flow check: at small
N kvpackd's own context outweighs what it saves, so PyTorch may not run out of memory there).
Spot checks of the fit table (tools/fit_table): --cap_gib=CARD --held_gib=0 --n=ENTRY.
"""

import argparse
import json
import os
import pathlib
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "client" / "python"))

import oom12_ref as ref  # noqa: E402
from nvml_monitor import NvmlMonitor  # noqa: E402
from torch_baseline import make_inputs  # noqa: E402  (bench_layer's seeded x and W)

GIB = ref.GIB
HD = ref.HEADS * ref.HEAD_DIM
NORM_ROPE_CHUNK = 16384  # tokens per step of PyTorch's norm + RoPE (fp32 inside, one bf16 copy out)


def gib(b):
    return b / GIB


# ── PyTorch ─────────────────────────────────────────────────────────────────────────────────────

def norm_rope(t, weight, pos):
    """RMSNorm then split-half RoPE of t [N, H, d] (a view), computed in fp32 a chunk of tokens at a
    time into ONE new bf16 [N, H, d] tensor (no fp32 copy of the whole tensor: the memory-frugal
    way to write it; a plain F.rms_norm + fp32 RoPE adds transients of up to ~4 [N, H·d] bf16)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    half = sum(ref.AXIS_DIMS) // 2
    inv = [ref.THETA ** (-2.0 * torch.arange(d // 2, dtype=torch.float64, device=t.device) / d)
           for d in ref.AXIS_DIMS]
    w = weight.float()
    for c in range(0, t.shape[0], NORM_ROPE_CHUNK):
        x = t[c:c + NORM_ROPE_CHUNK].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ref.EPS) * w
        p = pos[c:c + NORM_ROPE_CHUNK].double()
        ang = torch.cat([p[:, a:a + 1] * inv[a] for a in range(3)], 1).float()[:, None, :]
        cos, sin = ang.cos(), ang.sin()
        a, b = x[..., :half].clone(), x[..., half:2 * half]
        x[..., :half] = a * cos - b * sin
        x[..., half:2 * half] = a * sin + b * cos
        out[c:c + NORM_ROPE_CHUNK] = x.to(t.dtype)
    return out


def torch_layer(x, w, q_norm, k_norm, pos, stage=lambda name: None):
    """x @ W_qkvᵀ → RMSNorm(q, k) → RoPE → SDPA (cuDNN) → [N, H·d]; `stage` names each step first.
    Holds at its end x, W, qkv (3A: v is a view of it), q, k (2A), SDPA's output (A) and the
    [N, H·d] copy (A) — tools/fit_table's PyTorch model (A = N·H·d·2 bytes)."""
    n = x.shape[0]
    stage("qkv = x @ W_qkv^T")
    qkv = x @ w.T
    q, k, v = qkv.view(n, 3, ref.HEADS, ref.HEAD_DIM).unbind(1)
    stage("rms_norm + rope (q)")
    q = norm_rope(q, q_norm, pos)
    stage("rms_norm + rope (k)")
    k = norm_rope(k, k_norm, pos)
    stage("sdpa (cuDNN)")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))
    stage("output [N, H*d]")
    return o.squeeze(0).transpose(0, 1).reshape(n, HD)


def torch_model_bytes(n):
    """fit_table's PyTorch bytes above x and W (no context, no cuDNN workspace)."""
    return 7 * n * HD * 2 + n * ref.HEADS * 4


def run_torch(x, w, qn, kn, pos, rows, heads, timed):
    """One PyTorch layer: the stage it reached, OOM details, peak above its inputs, sampled rows."""
    rec = {"stage": None}

    def stage(name):
        rec["stage"] = name

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        o = torch_layer(x, w, qn, kn, pos, stage)
        torch.cuda.synchronize()
        rec["ms"] = (time.perf_counter() - t0) * 1e3
        rec["completed"] = True
        rec["peak_above_inputs"] = torch.cuda.max_memory_allocated() - base
        rec["model_above_inputs"] = torch_model_bytes(x.shape[0])
        rec["sample"] = sample_output(o, rows, heads)
        del o
        if timed:   # a second call: cuDNN's graph is built by the first
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = torch_layer(x, w, qn, kn, pos)
            torch.cuda.synchronize()
            rec["ms"] = (time.perf_counter() - t0) * 1e3
            del o
    except torch.OutOfMemoryError as e:
        msg = str(e)
        rec.update(completed=False, oom_stage=rec["stage"], oom_asked=ref.oom_bytes(msg),
                   oom_message=msg.split("\n")[0][:400])
        rec["free_at_oom"] = torch.cuda.mem_get_info()[0]
    except RuntimeError as e:   # e.g. cuDNN refusing the shape: recorded, the run goes on
        rec.update(completed=False, error=f"{type(e).__name__} at '{rec['stage']}': {str(e)[:300]}")
    torch.cuda.empty_cache()
    return rec


def sample_output(o, rows, heads):
    """o [N, H·d] → per sampled head, float64 numpy [R, d] of the sampled rows."""
    got = o[torch.as_tensor(rows, device=o.device)].view(len(rows), ref.HEADS, ref.HEAD_DIM)
    return [got[:, int(h)].double().cpu().numpy() for h in heads]


# ── kvpackd ─────────────────────────────────────────────────────────────────────────────────────

def run_kvpack(client, mode, n, x_slice, weights, pos_np, out, out_slice, rows, heads, timeout_s):
    from kvpack.client import format_name
    from kvpack.errors import KvpackError
    ranges, options = ref.kvpack_ranges(n, mode), ref.kvpack_options()
    out.fill_(float("nan"))      # a run that writes nothing shows as NaN, never as an old result
    torch.cuda.synchronize()
    rec = {"mode": mode}
    t0 = time.perf_counter()
    try:
        res = client.attention_layer(x_slice, weights, n_heads=ref.HEADS, head_dim=ref.HEAD_DIM,
                                     ranges=ranges, positions=pos_np, options=options, output=out_slice,
                                     n_tokens=n, hidden=ref.HIDDEN, timeout=timeout_s)
    except KvpackError as e:
        rec.update(completed=False, code=e.code.name, details=str(e.details)[:600])
        return rec
    rec["ms"] = (time.perf_counter() - t0) * 1e3
    r = res.result
    rec.update(completed=True, formats=[format_name(p.format) for p in r.plan.ranges],
               downgraded=[p.downgraded for p in r.plan.ranges], chunk=r.plan.projection_chunk,
               pool_peak=r.peak_bytes, predicted_peak=r.plan.predicted_peak_bytes,
               kv_bytes=r.plan.kv_bytes, workspace_bytes=r.plan.workspace_bytes, io_bytes=r.plan.io_bytes,
               daemon_s=r.seconds.total, project_s=r.seconds.project, attend_s=r.seconds.attend)
    rec["sample"] = sample_output(out, rows, heads)
    rec["nan_rows"] = int(torch.isnan(out[torch.as_tensor(rows, device=out.device)]).any(dim=1).sum())
    return rec


# ── the run ─────────────────────────────────────────────────────────────────────────────────────

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=ref.H3_TOKENS)
    ap.add_argument("--cap_gib", type=float, default=ref.USER_CAP_GIB)
    ap.add_argument("--held_gib", type=float, default=None,
                    help="bytes this process holds before the layer (default 6.09 GiB, scaled to N below H3's)")
    ap.add_argument("--held_on_top", action="store_true", help="held is other tensors on top of x and W")
    ap.add_argument("--modes", default="mixed,int4,int8,bf16")
    ap.add_argument("--kvpackd", default=os.environ.get("KVPACKD"))
    ap.add_argument("--budget", default="0.99",
                    help="kvpackd --vram_budget: a fraction of the free memory it finds at start, or bytes")
    ap.add_argument("--rows", type=int, default=1024, help="sampled query rows for the error")
    ap.add_argument("--heads", type=int, default=4, help="sampled heads for the error")
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--no_torch", action="store_true", help="skip PyTorch (capped and uncapped)")
    ap.add_argument("--no_reference", action="store_true")
    ap.add_argument("--timeout_s", type=float, default=300)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "oom12.jsonl"))
    ap.add_argument("--log", default="/tmp/oom12-kvpackd.log")
    return ap.parse_args()


def figure(text):
    print(f"FIGURE oom12 {text}", flush=True)


def main():
    args = parse_args()
    if not args.kvpackd or not os.access(args.kvpackd, os.X_OK):
        sys.exit("oom12: --kvpackd (or $KVPACKD) must name the kvpackd binary")
    import kvpack                                  # noqa: F401  (fail before the device work)
    from kvpack.torch import CudaIpcRegions
    n = args.n
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    x_bytes, w_bytes = n * ref.HIDDEN * 2, 3 * HD * ref.HIDDEN * 2
    held = args.held_gib * GIB if args.held_gib is not None else \
        ref.USER_HELD_GIB * GIB * min(1.0, n / ref.H3_TOKENS) + (0 if n >= ref.H3_TOKENS else w_bytes)
    held = int(held)
    cap = int(args.cap_gib * GIB)
    records = []
    rows = ref.sample_rows(n, args.rows, args.seed)
    heads = ref.sample_heads(args.heads, args.seed)

    # 1. The cap. This process's CUDA context exists (torch.empty(1)); the ballast leaves `cap`
    # bytes of the device for everything else, that context included.
    torch.empty(1, device=dev)
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    uuid = str(getattr(torch.cuda.get_device_properties(dev), "uuid", ""))
    uuid = uuid if uuid.lower().startswith("gpu-") else "GPU-" + uuid   # NVML's spelling
    monitor = NvmlMonitor(uuid)
    monitor.start()
    ballast = torch.empty(ref.cap_bytes(total, cap), dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    setup = {"phase": "setup", "n": n, "total": total, "context_torch": total - free0, "ballast": ballast.numel(),
             "cap": cap, "cap_effective": total - (free0 - free1), "nvml": monitor.source}

    # 2. Held: x, W, norm weights, positions, then the other model tensors.
    x, w = make_inputs(n, ref.HIDDEN, ref.HEADS, ref.HEAD_DIM, dev)
    g = torch.Generator().manual_seed(args.seed)
    qn, kn = ((1.0 + 0.25 * (2 * torch.rand(ref.HEAD_DIM, generator=g) - 1)).to(torch.bfloat16).to(dev)
              for _ in range(2))
    pos_np = ref.positions(n)
    pos = torch.from_numpy(pos_np).to(dev)
    torch.cuda.empty_cache()
    other_n = 0 if held == 0 else ref.other_bytes(held, x_bytes, w_bytes, not args.held_on_top)
    other = torch.empty(other_n, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    free_mark = torch.cuda.mem_get_info()[0]
    used_mark = monitor.read()[0]
    setup.update(held=torch.cuda.memory_allocated() - ballast.numel(), other=other.numel(), x=x_bytes, w=w_bytes,
                 free_after_held=free_mark)
    records.append(setup)
    figure(f"setup n={n} device_total_gib={gib(total):.2f} cap_gib={gib(cap):.2f} "
           f"cap_effective_gib={gib(setup['cap_effective']):.3f} torch_context_gib={gib(setup['context_torch']):.3f} "
           f"held_gib={gib(setup['held']):.2f} (x {gib(x_bytes):.2f}, W {gib(w_bytes):.2f}, other {gib(other.numel()):.2f}) "
           f"free_under_cap_gib={gib(free_mark):.2f} nvml={monitor.source}")

    cap_eff = setup["cap_effective"]   # the ballast's physical size decides, not the target

    def in_cap(t0, t1):
        """Peak bytes under the cap during [t0, t1]: what was in use at the mark (cap − free) plus
        NVML's growth since (device-wide: kvpackd's context and pool included)."""
        peak_used, least_free, count = monitor.window(t0, t1)
        return (cap_eff - free_mark) + (peak_used - used_mark), least_free, count

    # 3. (a) PyTorch under the cap.
    if not args.no_torch:
        t0 = time.monotonic()
        rec = run_torch(x, w, qn, kn, pos, rows, heads, timed=False)
        rec.pop("sample", None)
        rec["phase"] = "torch_capped"
        rec["peak_in_cap"], _, _ = in_cap(t0, time.monotonic())
        records.append(rec)
        if rec["completed"]:
            figure(f"torch_capped n={n} completed peak_in_cap_gib={gib(rec['peak_in_cap']):.2f} (no OOM at this size)")
        elif "error" in rec:
            figure(f"torch_capped n={n} {rec['error'][:300]}")
        else:
            asked = rec["oom_asked"]
            figure(f"torch_capped n={n} OOM at '{rec['oom_stage']}' asked_gib={gib(asked) if asked else float('nan'):.2f} "
                   f"free_gib={gib(rec['free_at_oom']):.2f}")

    # 4. (b, c) kvpackd under the cap: the output tensor the model would allocate, then the daemon.
    out = torch.empty(n, HD, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    runs = []
    t_start = time.monotonic()
    proc = None
    try:
        free_before_daemon = torch.cuda.mem_get_info()[0]
        proc, target = ref.start_daemon(args.kvpackd, args.budget, args.log)
        import kvpack.client
        client = kvpack.client.Client(target)
        client.wait_ready(30)
        status = client.status()
        daemon = {"phase": "daemon", "budget": status.budget_bytes, "free_before": free_before_daemon,
                  "context_daemon": free_before_daemon - torch.cuda.mem_get_info()[0]}
        regions = CudaIpcRegions(client)
        x_slice = regions.slice(x, x_bytes)
        out_slice = regions.slice(out, out.numel() * 2)
        weights = client.register_weights(regions.slice(w, w_bytes), n_heads=ref.HEADS, head_dim=ref.HEAD_DIM,
                                          hidden=ref.HIDDEN, q_norm_weight=qn.float().cpu().numpy(),
                                          k_norm_weight=kn.float().cpu().numpy(), timeout=args.timeout_s)
        daemon["weights_pool"] = weights.pool_bytes
        records.append(daemon)
        figure(f"kvpackd budget_gib={gib(daemon['budget']):.3f} context_gib={gib(daemon['context_daemon']):.3f} "
               f"weights_pool_gib={gib(weights.pool_bytes):.3f} output_region_gib={gib(out.numel() * 2):.2f}")
        for mode in [m for m in args.modes.split(",") if m]:
            t0 = time.monotonic()
            rec = run_kvpack(client, mode, n, x_slice, weights, pos_np, out, out_slice, rows, heads, args.timeout_s)
            rec["phase"] = "kvpack"
            rec["peak_in_cap"], rec["least_free"], rec["samples"] = in_cap(t0, time.monotonic())
            rec["high_water"] = client.status().high_water_bytes
            runs.append(rec)
            if rec["completed"]:
                figure(f"kvpack mode={mode} n={n} completed formats={'/'.join(rec['formats'])} chunk={rec['chunk']} "
                       f"pool_peak_gib={gib(rec['pool_peak']):.3f} predicted_gib={gib(rec['predicted_peak']):.3f} "
                       f"device_peak_in_cap_gib={gib(rec['peak_in_cap']):.3f} cap_gib={gib(cap_eff):.3f} "
                       f"under_cap={rec['peak_in_cap'] <= cap_eff} least_free_gib={gib(rec['least_free']):.3f} "
                       f"nvml_samples={rec['samples']} ms={rec['ms']:.0f} nan_rows={rec['nan_rows']}")
            else:
                figure(f"kvpack mode={mode} n={n} {rec['code']}: {rec['details'][:200]}")
        client.close()
    except Exception:   # recorded; PyTorch uncapped and the errors of the runs so far still follow
        text = traceback.format_exc()
        records.append({"phase": "kvpack_error", "error": text[-3000:]})
        figure("kvpack ERROR " + text.strip().splitlines()[-1][:300])
        print(text, file=sys.stderr)
    finally:
        rc = ref.stop_daemon(proc) if proc is not None else None
    overall = in_cap(t_start, time.monotonic())[0]
    figure(f"kvpack device_peak_in_cap_gib={gib(overall):.3f} cap_gib={gib(cap_eff):.3f} kvpackd_exit={rc}")
    records.append({"phase": "kvpack_overall", "peak_in_cap": overall, "kvpackd_exit": rc})

    # 5. The cap released: PyTorch without it, the reference, the errors.
    del ballast, other, out
    torch.cuda.empty_cache()
    monitor.stop()
    if not args.no_torch:
        rec = run_torch(x, w, qn, kn, pos, rows, heads, timed=True)
        rec["phase"] = "torch_uncapped"
        runs.append(rec)
        if rec["completed"]:
            figure(f"torch_uncapped n={n} peak_above_inputs_gib={gib(rec['peak_above_inputs']):.3f} "
                   f"model_gib={gib(rec['model_above_inputs']):.3f} ms={rec['ms']:.0f}")
        else:
            figure(f"torch_uncapped n={n} did not complete: {rec.get('error') or rec.get('oom_message')}")
    if not args.no_reference:
        t0 = time.perf_counter()
        want = [t.cpu().numpy() for t in ref.reference_rows(ref.TorchOps(torch, dev), x, w, qn, kn, pos, rows, heads)]
        figure(f"reference rows={len(rows)} heads={','.join(str(int(h)) for h in heads)} float64 "
               f"s={time.perf_counter() - t0:.1f}")
        if n <= 16384:  # the same rows through numpy on the CPU: the torch path of the reference
            few = rows[:16]
            cpu = ref.reference_rows(ref.NumpyOps, x.float().cpu().numpy(), w.float().cpu().numpy(),
                                     qn.float().cpu().numpy(), kn.float().cpu().numpy(), pos_np, few, heads[:1])
            diff = float(np.abs(cpu[0] - want[0][:16]).max() / np.abs(cpu[0]).max())
            figure(f"reference_check numpy_vs_torch_max_rel={diff:.2e}")
        for rec in runs:
            if "sample" in rec:
                e = ref.errors(rec.pop("sample"), want)
                rec.update(e)
                name = rec.get("mode", rec["phase"])
                figure(f"error {name} rel_l2_vs_fp64={e['rel_l2']:.4f} worst_head_cos={e['worst_head_cos']:.5f} "
                       f"mean_cos={e['mean_cos']:.5f}")
    for rec in runs:
        rec.pop("sample", None)
    records += runs
    with open(args.out, "a") as f:
        for r in records:
            r.setdefault("n", n)
            r.setdefault("cap", cap)
            f.write(json.dumps({k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()}) + "\n")
    print(f"oom12: {len(records)} records in {args.out}")


if __name__ == "__main__":
    main()
