#!/usr/bin/env python3
"""Soak (bench, not CI): mixed load against a CPU-backend kvpackd for a bounded time, with cancels,
clients killed mid-call and injected faults; samples the daemon's resources and says whether
each stayed flat.

    PYTHONPATH=client/python python3 bench/soak.py [--seconds 600] [--kvpackd build/server/service/kvpackd]

Load, each in its own process (so a kill is a real client death: its socket closes mid-stream):
  layers   register weights, run layers inline and through a shared-memory arena, keep K/V and
           attend over it, release everything (a frontend's cycle)
  cancel   layers with a deadline shorter than the layer (the client cancels mid-call)
  killed   a layers worker on a larger layer, SIGKILLed after a random 0.5-3 s, restarted
  regions  register / unregister a shared-memory region (the shm_map fault site)
Faults: the daemon runs with --fault_every (host allocations of the pool and shm maps fail
periodically: RESOURCE_EXHAUSTED for that call). Expected codes are counted; any other code
(INTERNAL, UNKNOWN, UNAVAILABLE, ...) is a failure.

Every SAMPLE_SECONDS: the daemon's RSS, open fds, threads (/proc), and from /metrics the pool
bytes, inline host bytes, handles and regions. Flat: the mean of the last minute is within
FLAT_RELATIVE (or FLAT_ABSOLUTE of the quantity's unit) of the mean of the first minute after
WARMUP_SECONDS. After the load stops and leases run out, pool, inline bytes, handles and regions
must be back to 0.
"""

import argparse
import atexit
import collections
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

SAMPLE_SECONDS = 5.0
WARMUP_SECONDS = 60.0
WINDOW_SECONDS = 60.0
FLAT_RELATIVE = 0.10          # last-minute mean within 10 % of the first minute's
FLAT_ABSOLUTE = {"rss_mib": 8.0, "fds": 4, "threads": 4, "pool_mib": 8.0, "inline_mib": 8.0, "handles": 4,
                 "regions": 4}
LEASE_SECONDS = 3             # a killed client's handles and regions go this long after last use
FAULT_EVERY = "host_alloc:29,shm_map:7"
EXPECTED_CODES = {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "NOT_FOUND"}
# A layer call whose client dies (or whose deadline passes) mid-upload can end INVALID_ARGUMENT
# ("x: received N of M bytes before the stream closed"): gRPC's OnReadDone(false) arrives before
# IsCancelled() turns true (layer_call.cc OnUploadComplete). Only the metric's label is wrong — the
# client is gone — so it is counted and shown, not failed (1 in 109k calls in the 2026-12-03 run).
KNOWN_MISLABELS = {"AttentionLayer:INVALID_ARGUMENT", "Attend:INVALID_ARGUMENT"}

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ── workers (run as `soak.py --worker ROLE --target ADDR`) ─────────────────────────────────────

def worker(role, target, seed):
    import grpc
    import numpy as np

    import kvpack
    from kvpack import shm
    from kvpack.types import Range

    rng = np.random.default_rng(seed)
    tokens, hidden, heads, d = (1500, 512, 4, 64) if role == "killed" else (300, 256, 2, 64)
    codes = collections.Counter()  # (the daemon's kvpack_requests_total is what the verdict reads)

    def layer_inputs():
        x = (rng.standard_normal((tokens, hidden)) * 0.5).astype(np.float32)
        w = (rng.standard_normal((3 * heads * d, hidden)) / np.sqrt(hidden)).astype(np.float32)
        ranges = [Range(0, tokens // 2, 0, ("int8", "int4")), Range(tokens // 2, tokens, 1, ("int4",))]
        return x, w, ranges

    def run(fn):
        try:
            fn()
            codes["OK"] += 1
        except kvpack.KvpackError as e:
            codes[e.code_name] += 1
        except grpc.RpcError as e:
            codes[e.code().name] += 1

    client = kvpack.Client(target, timeout=60)
    client.wait_ready(30)
    arena = shm.SharedArena(client, initial_bytes=8 << 20) if role in ("layers", "killed") else None
    if role == "regions":
        from multiprocessing import shared_memory
        region_obj = shared_memory.SharedMemory(create=True, size=1 << 20)
        atexit.register(region_obj.unlink)
    while True:
        if role == "regions":
            def cycle():
                rid = client.register_shm("/" + region_obj.name, region_obj.size)
                client.unregister_region(rid)
            run(cycle)
            time.sleep(0.01)
        else:
            x, w, ranges = layer_inputs()
            state = {}

            def register():
                state["w"] = client.register_weights(w, n_heads=heads, head_dim=d)
            run(register)
            if "w" in state:
                wt = state["w"]
                if role == "cancel":
                    run(lambda: client.attention_layer(x, wt, n_heads=heads, head_dim=d, ranges=ranges,
                                                       timeout=float(rng.uniform(0.005, 0.08))))
                else:
                    run(lambda: client.attention_layer(x, wt, n_heads=heads, head_dim=d, ranges=ranges))
                    run(lambda: arena.attention_layer(x, wt, n_heads=heads, head_dim=d, ranges=ranges))

                    def keep_and_attend():
                        kept = client.attention_layer(x, wt, n_heads=heads, head_dim=d, ranges=ranges,
                                                      keep_kv=True)
                        try:
                            client.attend(x, wt, kept.result.kv_handle, n_heads=heads, head_dim=d,
                                          ranges=ranges)
                        finally:
                            client.release_kv(kept.result.kv_handle)
                    run(keep_and_attend)
                run(lambda: client.release_weights(wt))


# ── the daemon and its samples ──────────────────────────────────────────────────────────────

def proc_sample(pid):
    rss_kib = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"rss_mib": rss_kib / 1024.0, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


def metrics_sample(metrics_port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    sums = collections.Counter()
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = line.split("{")[0].split(" ")[0]
        value = float(line.rsplit(" ", 1)[1])
        if name in ("kvpack_pool_bytes", "kvpack_inline_bytes", "kvpack_handles", "kvpack_regions"):
            sums[name] += value
        elif name == "kvpack_requests_total":
            code = line.split('code="')[1].split('"')[0]
            method = line.split('method="')[1].split('"')[0]
            sums["requests_" + code] += value
            sums["by_method_" + method + ":" + code] += value
    return {"pool_mib": sums["kvpack_pool_bytes"] / 2**20, "inline_mib": sums["kvpack_inline_bytes"] / 2**20,
            "handles": sums["kvpack_handles"], "regions": sums["kvpack_regions"],
            "requests": {k[9:]: int(v) for k, v in sums.items() if k.startswith("requests_")},
            "by_method": {k[10:]: int(v) for k, v in sums.items() if k.startswith("by_method_")}}


COLUMNS = ["rss_mib", "fds", "threads", "pool_mib", "inline_mib", "handles", "regions"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--kvpackd", default=os.path.join(ROOT, "build/server/service/kvpackd"))
    ap.add_argument("--workers", default="layers,layers,cancel,killed,regions")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.target, args.seed)
        return 0

    port, metrics_port = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    daemon = subprocess.Popen([args.kvpackd, f"--listen={target}", f"--metrics_address=127.0.0.1:{metrics_port}",
                               "--backend=cpu", "--cpu_threads=1", "--threads=2", "--vram_budget=512Mi",
                               f"--lease_seconds={LEASE_SECONDS}", f"--fault_every={FAULT_EVERY}"],
                              stderr=subprocess.PIPE, text=True)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client/python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    workers = {}
    rng = random.Random(7)
    kills = 0

    def spawn(i, role):
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", role, "--target", target,
                                 "--seed", str(100 * i + kills)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, text=True)

    roles = args.workers.split(",")
    print(f"soak: kvpackd pid {daemon.pid} on {target}, {args.seconds:.0f} s, workers {roles}, "
          f"--fault_every={FAULT_EVERY}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    time.sleep(1.0)
    for i, role in enumerate(roles):
        workers[i] = [role, spawn(i, role), time.monotonic() + rng.uniform(0.5, 3.0)]
    samples = []
    start = time.monotonic()
    next_sample = start
    print("  t_s  " + "  ".join(f"{c:>10}" for c in COLUMNS))
    try:
        while time.monotonic() - start < args.seconds:
            now = time.monotonic()
            for i, (role, p, kill_at) in workers.items():
                if role == "killed" and now >= kill_at:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                    kills += 1
                    workers[i] = [role, spawn(i, role), now + rng.uniform(0.5, 3.0)]
                elif p.poll() is not None:
                    print(f"soak: worker {role} exited with {p.returncode}; restarted")
                    workers[i] = [role, spawn(i, role), now + rng.uniform(0.5, 3.0)]
            if now >= next_sample:
                if daemon.poll() is not None:
                    print(f"soak: FAIL: kvpackd exited with {daemon.returncode}")
                    return 1
                s = dict(t=now - start, **proc_sample(daemon.pid), **metrics_sample(metrics_port))
                samples.append(s)
                print(f"{s['t']:5.0f}  " + "  ".join(f"{s[c]:10.1f}" for c in COLUMNS), flush=True)
                next_sample += SAMPLE_SECONDS
            time.sleep(0.05)
    finally:
        for role, p, _ in workers.values():
            p.send_signal(signal.SIGKILL)
            p.wait()

    # Idle: leases of the killed clients run out, everything must return.
    time.sleep(LEASE_SECONDS + 3)
    idle = dict(**proc_sample(daemon.pid), **metrics_sample(metrics_port))
    health = subprocess.run([sys.executable, "-c", f"import kvpack; print(kvpack.Client('{target}').health())"],
                            env=env, capture_output=True, text=True).stdout.strip() == "SERVING"
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=60)
    except subprocess.TimeoutExpired:
        daemon.kill()
    err = daemon.stderr.read()

    requests = idle["requests"]
    known = {k: v for k, v in idle["by_method"].items() if k in KNOWN_MISLABELS}
    unexpected = {k: v for k, v in idle["by_method"].items()
                  if k.split(":")[1] not in EXPECTED_CODES and k not in KNOWN_MISLABELS}
    print(f"soak: requests by code {dict(sorted(requests.items()))}; clients killed {kills}")
    first = [s for s in samples if WARMUP_SECONDS <= s["t"] < WARMUP_SECONDS + WINDOW_SECONDS]
    last = [s for s in samples if s["t"] >= samples[-1]["t"] - WINDOW_SECONDS + 1e-9]
    ok = bool(first) and bool(last) and samples[-1]["t"] >= WARMUP_SECONDS + 2 * WINDOW_SECONDS - SAMPLE_SECONDS
    if not ok:
        print(f"soak: too short for the verdict (needs {WARMUP_SECONDS + 2 * WINDOW_SECONDS:.0f} s)")
    print("  quantity      first-min mean  last-min mean   drift   flat")
    for c in COLUMNS:
        if not first or not last:
            break
        a = sum(s[c] for s in first) / len(first)
        b = sum(s[c] for s in last) / len(last)
        flat = abs(b - a) <= max(FLAT_RELATIVE * abs(a), FLAT_ABSOLUTE[c])
        ok &= flat
        print(f"  {c:<12} {a:14.1f} {b:14.1f} {b - a:+8.1f}   {'yes' if flat else 'NO'}")
    back = idle["pool_mib"] == 0 and idle["inline_mib"] == 0 and idle["handles"] == 0 and idle["regions"] == 0
    ok &= back and not unexpected and health
    print(f"soak: idle after {LEASE_SECONDS + 3} s: pool {idle['pool_mib']:.1f} MiB, inline {idle['inline_mib']:.1f} MiB, "
          f"handles {idle['handles']:.0f}, regions {idle['regions']:.0f}, rss {idle['rss_mib']:.1f} MiB, fds {idle['fds']}, "
          f"threads {idle['threads']}; health SERVING: {'yes' if health else 'NO'}")
    if known:
        print(f"soak: known mislabels (a dying client's upload end seen before its cancel): {known}")
    if unexpected:
        print(f"soak: unexpected codes {unexpected}; daemon stderr tail:\n{err[-2000:]}")
    print(f"soak: {'PASS' if ok else 'FAIL'} (flat = last-minute mean within {FLAT_RELATIVE:.0%} or "
          f"the absolute slack of the first minute after {WARMUP_SECONDS:.0f} s warm-up)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
