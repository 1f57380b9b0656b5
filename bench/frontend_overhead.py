"""Where a region-only attention call's time goes outside the attention (issue 17).

Starts kvpackd (the build's, CPU backend unless --backend says otherwise), puts q, k, v and the
output of a small pre-projected layer in one POSIX shared-memory region (the stand-in for CUDA IPC
regions on a machine without a GPU), and times, per call, median over --calls:

  header     building the LayerHeader in Python (Client.projected_header)
  rpc        the gRPC call as the client sees it (send header … result received)
  daemon     LayerResult.seconds.total: header arrival → result ready, as the daemon saw it,
             split into plan, stream upload (header → half-close: the stream's extra read),
             queue, project (K/V packing), attend and the rest (binding, submit, release)
  transport  rpc − daemon: both gRPC stacks, the reply and the thread hand-offs
  outside    wall − daemon: what issue 17's "time outside the daemon" counts
  floor      a unary KeepAlive with no ids: gRPC's own round trip on this machine, calls back to back
  idle floor the same KeepAlive after the client and the daemon sat idle as long as the attention
             takes (the daemon's median total): a layer call's reply wakes threads that slept
             through the attention (gRPC's poller and workers on both sides, the Python caller),
             and on an idle machine each wake-up costs far more than back to back (this 2-core VM:
             0.2 ms floor, ~0.75 ms after 100 ms idle). outside − idle floor is what the layer
             call adds to a bare gRPC round trip after the same idle time: header, parsing, the
             reactor, the executor hand-off, the result.

once over the streamed AttentionLayer, once over the unary AttentionLayerRegions and once through a
lane (kvpack.lane: the same call through shared memory, both sides spinning for a bounded time).
The shapes are small so that the attention is negligible.

--gap_ms=G,G,... then repeats the unary call and the lane call with the client asleep G ms before
each call (its timings exclude the gap): on a GPU both processes sleep through the attention, while
on this CPU backend the attention keeps the cores busy, so the gap is what shows the wake-ups. A
gap under the daemon's --lane_spin_us finds the lane thread spinning; a longer one finds it asleep
on its futex.

--timeline (torch with CUDA, --backend=cuda) instead measures what a user of the same GPU sees: DiT
blocks in a loop with the attention through kvpackd over CUDA IPC, wall time per block against the
caller's kernels alone plus the daemon's own time, with the daemon answering before its kernels end
(stream order) and after them; FIGURE timeline lines, their fields in client/python/kvpack/timeline.py.

--cpu_latency_us=N (needs write access to /dev/cpu_dma_latency, i.e. root) repeats the unary call
while this process holds a PM QoS request of N µs (0: idle cores poll instead of entering sleep
states, machine-wide, for as long as it is held), to show how much of the idle floor is the cores'
wake-up from sleep states. It measures; kvpackd itself changes nothing about the machine.

    python3 bench/frontend_overhead.py [--tokens 256 --heads 2 --head_dim 64 --calls 300]
    python3 bench/frontend_overhead.py --timeline --backend=cuda --tokens 32760 --heads 12 --head_dim 128
"""

import argparse
import contextlib
import os
import statistics
import struct
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))

import kvpack  # noqa: E402
from kvpack import lane as kvpack_lane  # noqa: E402
from kvpack import testing  # noqa: E402
from kvpack.types import Range, RegionSlice  # noqa: E402


def median_ms(values):
    return 1e3 * statistics.median(values)


def run(client, region_id, args, method, gap_s=0.0):
    hd = args.heads * args.head_dim
    nbytes = args.tokens * hd * 2
    slices = [RegionSlice(region_id, i * nbytes, nbytes) for i in range(4)]
    ranges = [Range(0, args.tokens, 0, ("int8",))]
    rows = {k: [] for k in ("header", "rpc", "daemon", "plan", "queue", "project", "attend",
                            "upload", "wall")}
    for i in range(args.warmup + args.calls):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        # The client's own steps (private: this bench times them one by one).
        header, _, _ = client._projected_header(
            *slices[:3], n_heads=args.heads, head_dim=args.head_dim, ranges=ranges,
            layout="token_major", row_stride=0, batch=0, n_tokens=args.tokens,
            options=kvpack.LayerOptions(), keep_kv=False, priority=0, cuda_wait_event=None)
        client._set_output("AttentionLayer", header, slices[3])
        t1 = time.perf_counter()
        if method == "AttentionLayer":
            result = client._streamed(method, header, [], args.tokens, None).result
        elif method == "AttentionLayerLane":
            result = client.lane.call("AttentionLayer", header, client.timeout)
        else:
            result = client._unary(method, header, None)
        t2 = time.perf_counter()
        if i < args.warmup:
            continue
        s = result.seconds
        rows["header"].append(t1 - t0)
        rows["rpc"].append(t2 - t1)
        rows["wall"].append(t2 - t0)
        rows["daemon"].append(s.total)
        rows["plan"].append(s.plan)
        rows["queue"].append(s.queue)
        rows["project"].append(s.project)
        rows["attend"].append(s.attend)
        rows["upload"].append(s.transfer)
    med = {k: median_ms(v) for k, v in rows.items()}
    med["transport"] = median_ms([r - d for r, d in zip(rows["rpc"], rows["daemon"])])
    med["outside"] = median_ms([w - d for w, d in zip(rows["wall"], rows["daemon"])])
    med["daemon_other"] = (med["daemon"] - med["plan"] - med["queue"] - med["project"]
                           - med["attend"] - med["upload"])
    return med


def idle_floor_ms(client, idle_s, calls):
    """Median KeepAlive time after `idle_s` of idleness on both sides (see the module comment)."""
    times = []
    for _ in range(calls):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        client.keep_alive([])
        times.append(time.perf_counter() - t0)
    return median_ms(times)


@contextlib.contextmanager
def cpu_latency_request(us):
    """Holds a PM QoS CPU latency request of `us` µs while inside (Linux /dev/cpu_dma_latency:
    the request lasts while the file stays open). Yields an error text instead when it cannot."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError as e:
        yield f"cannot open /dev/cpu_dma_latency ({e.strerror})"
        return
    try:
        os.write(fd, struct.pack("i", us))
        yield None
    finally:
        os.close(fd)


def timeline_main(args):
    """--timeline: kvpack.timeline.measure against a kvpackd of its own (see the module comment)."""
    import torch

    import kvpack.torch as kt
    from kvpack import timeline

    if not torch.cuda.is_available():
        print("frontend_overhead --timeline: no CUDA device for torch")
        return 1
    with testing.LocalDaemon(extra_args=(f"--backend={args.backend}",), budget_bytes=16 << 30) as d, \
            kvpack.Client(d.target, timeout=120) as c:
        if c.status().backend != "cuda":
            print("frontend_overhead --timeline: kvpackd did not start on the CUDA backend")
            return 1
        attend = kt.ProjectedAttention(c, formats=("int8",))
        m = timeline.measure(attend, tokens=args.tokens, heads=args.heads, head_dim=args.head_dim,
                             blocks=args.blocks)
        for line in timeline.figure_lines(m, label=args.label):
            print(line)
        attend.regions.forget_all()
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--idle_calls", type=int, default=30,
                    help="KeepAlive calls for the idle floor (each after the attention's time)")
    ap.add_argument("--gap_ms", default="",
                    help="comma-separated idle gaps before each unary and lane call (see above)")
    ap.add_argument("--cpu_latency_us", type=int, default=-1,
                    help="also run the unary call holding this PM QoS CPU latency request (root)")
    ap.add_argument("--timeline", action="store_true",
                    help="DiT blocks on the GPU around each call instead (torch, --backend=cuda)")
    ap.add_argument("--blocks", type=int, default=12, help="--timeline: blocks per loop")
    ap.add_argument("--label", default=None,
                    help="--timeline: label=... in the FIGURE lines (e.g. which kvpackd: $KVPACKD)")
    args = ap.parse_args()
    if args.timeline:
        return timeline_main(args)

    rng = np.random.default_rng(17)
    hd = args.heads * args.head_dim
    nbytes = args.tokens * hd * 2
    shm = shared_memory.SharedMemory(create=True, size=4 * nbytes)
    try:
        data = np.ndarray((3, args.tokens, hd), dtype=np.float32,
                          buffer=bytearray(3 * args.tokens * hd * 4))
        data[...] = rng.standard_normal(data.shape) + 0.25
        bits = (data.view(np.uint32) >> 16).astype(np.uint16)      # bf16 by truncation
        np.ndarray((3, args.tokens, hd), dtype=np.uint16, buffer=shm.buf)[...] = bits
        with testing.LocalDaemon(extra_args=(f"--backend={args.backend}",)) as d, \
                kvpack.Client(d.target, timeout=60) as c:
            region = c.register_shm("/" + shm.name, shm.size)
            c.lane = kvpack_lane.Lane(c)
            floor = []
            for _ in range(args.warmup + args.calls):
                t0 = time.perf_counter()
                c.keep_alive([])
                floor.append(time.perf_counter() - t0)
            floor_ms = median_ms(floor[args.warmup:])
            print(f"frontend_overhead: {args.tokens} tokens, {args.heads}x{args.head_dim}, "
                  f"backend {args.backend}, {args.calls} calls, medians in ms")
            print(f"  gRPC unary floor (KeepAlive): {floor_ms:.3f}")
            outputs = {}
            for method in ("AttentionLayer", "AttentionLayerRegions", "AttentionLayerLane"):
                m = run(c, region, args, method)
                outputs[method] = bytes(shm.buf[3 * nbytes:4 * nbytes])
                print(f"  {method:22s} wall {m['wall']:.3f} = header {m['header']:.3f}"
                      f" + rpc {m['rpc']:.3f}; rpc = transport {m['transport']:.3f} + daemon"
                      f" {m['daemon']:.3f} (plan {m['plan']:.3f}, stream upload {m['upload']:.3f},"
                      f" queue {m['queue']:.3f}, project {m['project']:.3f}, attend"
                      f" {m['attend']:.3f}, rest {m['daemon_other']:.3f});"
                      f" outside the daemon {m['outside']:.3f}")
                idle = idle_floor_ms(c, m["daemon"] / 1e3, args.idle_calls)
                print(f"  {'':22s} gRPC unary after {m['daemon']:.1f} ms idle (KeepAlive) {idle:.3f}"
                      f" (wake-up: {idle - floor_ms:+.3f} over the floor); outside the daemon"
                      f" {m['outside']:.3f} = idle floor {idle:.3f} + layer call's own"
                      f" {m['outside'] - idle:.3f}")
            if args.cpu_latency_us >= 0:
                with cpu_latency_request(args.cpu_latency_us) as error:
                    if error:
                        print(f"  with a CPU latency request: not run, {error}")
                    else:
                        m = run(c, region, args, "AttentionLayerRegions")
                        idle = idle_floor_ms(c, m["daemon"] / 1e3, args.idle_calls)
                        print(f"  AttentionLayerRegions holding a {args.cpu_latency_us} us CPU latency"
                              f" request: transport {m['transport']:.3f}, outside the daemon"
                              f" {m['outside']:.3f}; gRPC unary after {m['daemon']:.1f} ms idle"
                              f" {idle:.3f}")
            for gap in [float(g) for g in args.gap_ms.split(",") if g]:
                for method in ("AttentionLayerRegions", "AttentionLayerLane"):
                    m = run(c, region, args, method, gap / 1e3)
                    print(f"  {gap:5.1f} ms gap before each call: {method:22s} transport"
                          f" {m['transport']:.3f}, outside the daemon {m['outside']:.3f}"
                          f" (header {m['header']:.3f}; daemon {m['daemon']:.3f})")
            same = len(set(outputs.values())) == 1
            print(f"  outputs of the three methods bit-identical: {same}")
            c.unregister_region(region)
            return 0 if same else 1
    finally:
        shm.close()
        shm.unlink()


if __name__ == "__main__":
    sys.exit(main())
