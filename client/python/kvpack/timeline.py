"""The GPU timeline of attention calls made between a caller's own kernels (issue 17).

A DiT block runs q, k, v = x·W_qkv, attention, x += o·W_o, x += MLP(x); here the attention goes
through kvpackd on the same GPU (kvpack.torch.ProjectedAttention over CUDA IPC). What matters to a
user is whether the GPU idles around each call, so `measure` times a loop of such blocks (Wan 2.1
widths by default: the MLP is 35/6 × the hidden size, 8960 at 1536) and reports, per block:

  per_call        the loop's wall time / blocks (one torch.cuda.synchronize, at the end)
  caller          the same loop with the attention left out (o = v): the caller's kernels alone
  daemon          the daemon's own time per call, LayerResult.seconds project + attend of calls it
                  answers after its kernels (mode "synchronised"), in the same loop
  idle            per_call − caller − daemon: GPU time per block that neither side's work explains
  call_over_daemon  (per_call − caller) / daemon: what one attention call costs the pipeline against
                  the daemon's own time (issue 17's target: at most 1.05)
  span            from an event on the caller's stream just before the call (q, k, v written) to
                  one just after it (behind the wait on the daemon's done event, or enqueued once
                  the synchronised answer came): the call's footprint on the GPU timeline
  answer_ahead    the share of calls whose answer arrived while the daemon's kernels still ran
                  (ProjectedAttention.last_answer_ahead: its done event still pending), so the
                  caller's next kernels were queued before the GPU needed them; 0 when synchronised
  queue           the daemon's queue time (admission, and its wait for the caller's event)

Modes: "stream_ordered" (header.cuda_done_event: the daemon answers once its last kernel is queued
and the caller's stream waits for its event) and "synchronised" (the daemon answers after its
kernels). Needs torch with CUDA and a CUDA-backed kvpackd."""

import statistics
import time

MODES = ("synchronised", "stream_ordered")


def _median(values):
    return statistics.median(values) if values else float("nan")


def measure(attend, *, tokens, heads, head_dim, blocks=12, warmup=2, rounds=2, ffn=None, seed=0):
    """Times `blocks` DiT blocks per mode and round (modes interleaved, so drift hits both alike).
    `attend`: a kvpack.torch.ProjectedAttention. Returns {"caller_ms", "daemon_ms",
    "daemon_project_ms", "daemon_attend_ms", "tokens", "heads", "head_dim", "blocks", mode:
    {"per_call_ms", "span_ms", "queue_ms", "answered_early", "answer_ahead", "idle_ms",
    "call_over_daemon"}}; every time in ms."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    width = heads * head_dim
    ffn = ffn or 128 * round(width * 35 / 6 / 128)
    g = torch.Generator(device=dev).manual_seed(seed)

    def weight(rows, cols):
        return (torch.randn(rows, cols, generator=g, device=dev) / rows ** 0.5).to(torch.bfloat16)

    w_qkv, w_o = weight(width, 3 * width), weight(width, width)
    w_1, w_2 = weight(width, ffn), weight(ffn, width)
    x0 = torch.randn(1, tokens, width, generator=g, device=dev).to(torch.bfloat16)

    def block(x, attention):
        # q, k, v: [1, N, H, d] views of the fused projection (token-major, row stride 3·H·d),
        # sent as they are, as a DiT's own split hands them over.
        q, k, v = (x @ w_qkv).unflatten(-1, (3, heads, head_dim)).unbind(2)
        x = F.layer_norm(x + attention(q, k, v).flatten(2) @ w_o, (width,))
        return F.layer_norm(x + F.gelu(x @ w_1) @ w_2, (width,))

    def loop(attention, n):
        x = x0
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            x = block(x, attention)
        torch.cuda.synchronize()
        if not bool(torch.isfinite(x).all()):
            raise AssertionError("the DiT loop produced non-finite values")
        return 1e3 * (time.perf_counter() - start) / n

    marks, results = [], []

    def timed(q, k, v):
        # Events on the caller's stream only, in line with work queued there anyway: a marker on
        # another stream would give the caller's context GPU work of its own while the daemon's
        # kernels run (two processes' contexts share the GPU by time slices).
        before = torch.cuda.Event(enable_timing=True)
        before.record()
        out = attend(q, k, v)
        after = torch.cuda.Event(enable_timing=True)
        after.record()                  # behind the wait on the done event, if any
        marks.append((before, after))
        results.append((attend.last_result, attend.last_stream_ordered, attend.last_answer_ahead))
        return out

    out = {"tokens": tokens, "heads": heads, "head_dim": head_dim, "blocks": blocks}
    loop(lambda q, k, v: v, warmup)
    caller = [loop(lambda q, k, v: v, blocks) for _ in range(rounds)]
    per_mode = {m: {"per_call": [], "marks": [], "results": []} for m in MODES}
    saved = attend.use_done_events
    try:
        for _ in range(rounds):
            for mode in MODES:
                attend.use_done_events = mode == "stream_ordered"
                loop(timed, warmup)
                marks.clear()
                results.clear()
                per_mode[mode]["per_call"].append(loop(timed, blocks))
                per_mode[mode]["marks"] += marks
                per_mode[mode]["results"] += results
    finally:
        attend.use_done_events = saved
    torch.cuda.synchronize()
    for m in per_mode.values():
        m["span"] = [b.elapsed_time(a) for b, a in m.pop("marks")]
    out.update(summarise(caller, per_mode))
    return out


def summarise(caller, per_mode):
    """The figures of measure() from its raw times (pure; ms): `caller`, the caller-alone loop's
    per-block times; per_mode[mode] = {"per_call": loop times per block, "span": [...], "results":
    [(LayerResult, answered early, answer ahead of the kernels' end), ...]}."""
    out = {"caller_ms": _median(caller)}
    synced = [r.seconds for r, _, _ in per_mode["synchronised"]["results"]]
    out["daemon_project_ms"] = 1e3 * _median([s.project for s in synced])
    out["daemon_attend_ms"] = 1e3 * _median([s.attend for s in synced])
    out["daemon_ms"] = 1e3 * _median([s.project + s.attend for s in synced])
    for mode, m in per_mode.items():
        per_call = _median(m["per_call"])
        out[mode] = {
            "per_call_ms": per_call,
            "span_ms": _median(m["span"]),
            "queue_ms": 1e3 * _median([r.seconds.queue for r, _, _ in m["results"]]),
            "answered_early": bool(m["results"]) and all(early for _, early, _ in m["results"]),
            "answer_ahead": sum(ahead for _, _, ahead in m["results"]) / max(1, len(m["results"])),
            "idle_ms": per_call - out["caller_ms"] - out["daemon_ms"],
            "call_over_daemon": (per_call - out["caller_ms"]) / out["daemon_ms"],
        }
    return out


def figure_lines(m, label=None):
    """The FIGURE lines of one measure() result, one per mode; `label` (e.g. which kvpackd) goes
    first when given."""
    lines = []
    for mode in MODES:
        r = m[mode]
        lines.append(
            f"FIGURE timeline {f'label={label} ' if label else ''}mode={mode} tokens={m['tokens']} "
            f"heads={m['heads']}x{m['head_dim']} "
            f"blocks={m['blocks']} per_call_ms={r['per_call_ms']:.3f} caller_ms={m['caller_ms']:.3f} "
            f"daemon_ms={m['daemon_ms']:.3f} daemon_project_ms={m['daemon_project_ms']:.3f} "
            f"daemon_attend_ms={m['daemon_attend_ms']:.3f} idle_ms={r['idle_ms']:.3f} "
            f"call_over_daemon={r['call_over_daemon']:.4f} span_ms={r['span_ms']:.3f} "
            f"answer_ahead={r['answer_ahead']:.2f} queue_ms={r['queue_ms']:.3f} "
            f"answered_early={r['answered_early']}")
    return lines
