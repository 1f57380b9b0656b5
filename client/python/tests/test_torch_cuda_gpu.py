"""kvpack.torch on the GPU (marker `gpu`): CUDA IPC by segment — steady-state calls register
nothing and spend little time outside the daemon; tensors freed and reallocated between calls
(torch.cuda.empty_cache() included) never make the daemon read freed memory, every output checked
against an fp32 CPU reference and against the inline path — a ComfyUI-style block under
torch.compile (Inductor, fullgraph) through the daemon, and the GPU timeline of DiT blocks around
the calls (kvpack/timeline.py: idle GPU per block, call/daemon). Prints the figures of issue 17 as
"FIGURE ..." lines (run pytest with -s to see them). Skips without CUDA torch and a CUDA-backed
kvpackd.

KVPACK_SEGMENTS_TOKENS (default 32760) and KVPACK_SEGMENTS_CALLS (default 12) set the timing
test's size; the Wan 2.1 1.3B attention is 12 heads x 128 at 32,760 tokens per sequence."""

import os
import statistics
import time

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (the adapter's tests need it)")

import kvpack  # noqa: E402
import kvpack.torch as kt  # noqa: E402
from kvpack import testing  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")]

if testing.find_kvpackd() is None:
    pytest.skip("no kvpackd binary (build it; ctest sets KVPACK_BUILD_DIR)", allow_module_level=True)

H, D = 12, 128
MIN_COSINE = 0.999        # INT8 K/V vs fp32 attention; CPU backend, these inputs: 0.999993-0.999995
WARMUP_CALLS = 1          # the first call registers the segments it meets


@pytest.fixture(scope="module")
def cuda_client():
    try:
        daemon = testing.LocalDaemon(extra_args=("--backend=cuda",), budget_bytes=16 << 30)
        daemon.__enter__()
    except Exception as e:  # noqa: BLE001 - the daemon could not start on the GPU
        pytest.skip(f"no CUDA-backed kvpackd: {e}")
    try:
        with kvpack.Client(daemon.target, timeout=120) as c:
            if c.status().backend != "cuda":
                pytest.skip("kvpackd fell back to the CPU backend")
            yield c
    finally:
        daemon.__exit__(None, None, None)


def fused_qkv(b, n, seed):
    """[B, N, 3·H·d] bf16 on the GPU with per-channel offsets and a few outlier channels, made on
    the GPU as a DiT block makes its qkv (so the caching allocator places it)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, n, 3 * H * D, generator=g, device="cuda")
    x += 0.5 * torch.randn(3 * H * D, generator=g, device="cuda")
    x[..., ::97] *= 8.0
    return x.to(torch.bfloat16)


def split(fused):
    return [t.unflatten(-1, (H, D)) for t in fused.chunk(3, dim=-1)]


def reference(q, k, v):
    """fp32 attention on the CPU, [B, N, H, d]."""
    qf, kf, vf = (t.float().cpu().transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf).transpose(1, 2)


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def test_steady_state_registers_nothing(cuda_client):
    n = int(os.environ.get("KVPACK_SEGMENTS_TOKENS", "32760"))
    calls = int(os.environ.get("KVPACK_SEGMENTS_CALLS", "12"))
    attend = kt.ProjectedAttention(cuda_client, formats=("int8",))
    regs, outside, daemon_s, wall, splits = [], [], [], [], []
    for i in range(calls):
        q, k, v = split(fused_qkv(1, n, seed=i))   # new tensors each call, as in a DiT's blocks
        out = attend(q, k, v)
        torch.cuda.synchronize()
        assert attend.last_transport == "cuda_ipc"
        splits.append(attend.last_split)
        regs.append(attend.last_registrations)
        outside.append(attend.last_outside_s)
        daemon_s.append(attend.last_result.seconds.total)
        wall.append(attend.last_wall_s)
        del q, k, v, out
    steady = slice(WARMUP_CALLS, None)
    print(f"\nFIGURE segments tokens={n} heads={H}x{D} calls={calls} registrations_per_call={regs} "
          f"stream_order={'event' if attend.regions.daemon_waits_on_events else 'synchronize'} "
          f"answer_before_kernels_end={attend.last_stream_ordered}")
    print(f"FIGURE segments steady outside_ms median="
          f"{1e3 * statistics.median(outside[steady]):.3f} "
          f"max={1e3 * max(outside[steady]):.3f} daemon_ms median="
          f"{1e3 * statistics.median(daemon_s[steady]):.3f} wall/daemon="
          f"{statistics.median(wall[steady]) / statistics.median(daemon_s[steady]):.4f}")
    # Where the time outside goes: the client's steps around the RPC, the RPC less the daemon's
    # total (header, both gRPC stacks, the threads' wake-ups), and a bare unary call after the
    # same idle time as the attention (the wake-ups alone: bench/frontend_overhead.py).
    steps = {key: 1e3 * statistics.median(s[key] for s in splits[steady]) for key in splits[-1]}
    transport = statistics.median(1e3 * (s["rpc"] - d) for s, d in zip(splits[steady], daemon_s[steady]))
    idle = []
    for _ in range(10):
        time.sleep(statistics.median(daemon_s[steady]))
        t0 = time.perf_counter()
        cuda_client.keep_alive([])
        idle.append(1e3 * (time.perf_counter() - t0))
    print(f"FIGURE segments steady split_ms before={steps['before']:.3f} rpc={steps['rpc']:.3f} "
          f"after={steps['after']:.3f} rpc_minus_daemon={transport:.3f} "
          f"idle_unary_floor={statistics.median(idle):.3f}")
    attend.regions.forget_all()
    assert sum(regs[steady]) == 0, regs


def alternate(client, attr, methods, seed):
    """The same steady-state calls with client.<attr> True and False in turn (interleaved, so that
    drift hits both alike); `methods` = the client's last_layer_method with it (True, False). Returns
    {method: first output} and {method: (outside, wall, daemon) seconds after the warm-up calls}."""
    n = int(os.environ.get("KVPACK_SEGMENTS_TOKENS", "32760"))
    calls = int(os.environ.get("KVPACK_SEGMENTS_CALLS", "12"))
    attend = kt.ProjectedAttention(client, formats=("int8",))
    q, k, v = split(fused_qkv(1, n, seed=seed))
    figures, outputs = {}, {}
    for on in (True, False, True, False):
        setattr(client, attr, on)
        outside, wall, daemon_s = [], [], []
        for _ in range(calls):
            out = attend(q, k, v)
            torch.cuda.synchronize()
            outside.append(attend.last_outside_s)
            wall.append(attend.last_wall_s)
            daemon_s.append(attend.last_result.seconds.total)
        method = client.last_layer_method
        assert method == methods[0 if on else 1], (method, client.lane_error)
        outputs.setdefault(method, out.cpu())
        figures.setdefault(method, ([], [], []))
        for acc, values in zip(figures[method], (outside, wall, daemon_s)):
            acc.extend(values[WARMUP_CALLS:])
    attend.regions.forget_all()
    return n, outputs, figures


def print_figures(label, n, figures, same):
    for method, (outside, wall, daemon_s) in figures.items():
        print(f"\nFIGURE {label} method={method} tokens={n} heads={H}x{D} outside_ms median="
              f"{1e3 * statistics.median(outside):.3f} max={1e3 * max(outside):.3f} daemon_ms "
              f"median={1e3 * statistics.median(daemon_s):.3f} wall/daemon="
              f"{statistics.median(wall) / statistics.median(daemon_s):.4f} "
              f"outputs_bit_identical={same}")


def test_unary_call_against_the_stream(cuda_client):
    """The same steady-state calls over the unary AttentionLayerRegions and over the streamed
    AttentionLayer (the client's unary_layers off): bit-identical outputs, and the time outside
    the daemon of each (issue 17: the stream's extra messages and thread hand-offs)."""
    n, outputs, figures = alternate(cuda_client, "unary_layers",
                                    ("AttentionLayerRegions", "AttentionLayer"), seed=50)
    cuda_client.unary_layers = True
    same = torch.equal(outputs["AttentionLayer"], outputs["AttentionLayerRegions"])
    print_figures("unary", n, figures, same)
    assert same, "the unary call's output differs from the stream's"


def test_lane_against_the_unary_call(cuda_client):
    """The same steady-state calls through a lane (kvpack.lane: shared memory, both sides
    spinning for a bounded time) and over the unary AttentionLayerRegions: bit-identical
    outputs, and the time outside the daemon of each (issue 17: gRPC's wake-ups after the
    attention's idle time)."""
    n, outputs, figures = alternate(cuda_client, "lane_wanted",
                                    ("AttentionLayerLane", "AttentionLayerRegions"), seed=51)
    cuda_client.lane_wanted = False
    same = torch.equal(outputs["AttentionLayerLane"], outputs["AttentionLayerRegions"])
    print_figures("lane", n, figures, same)
    assert same, "the lane call's output differs from the unary call's"


def test_freed_and_reallocated_tensors_are_never_read_stale(cuda_client):
    before = cuda_client.status().tenant.regions
    attend = kt.ProjectedAttention(cuda_client, formats=("int8",))
    inline = kt.ProjectedAttention(cuda_client, formats=("int8",), cuda_ipc=False)
    worst, checked = 1.0, 0
    # Sizes change so that segments are freed, split and new ones made at old addresses.
    for i, (b, n) in enumerate([(1, 1536), (2, 1100), (1, 4100), (1, 1536), (3, 777), (1, 2900)]):
        for empty in (False, True):
            q, k, v = split(fused_qkv(b, n, seed=100 + 2 * i + empty))
            got = attend(q, k, v)
            assert attend.last_transport == "cuda_ipc"
            want = inline(q, k, v)
            assert torch.equal(got.cpu(), want.cpu()), f"call {i}: IPC output != inline output"
            c = cosine(got.cpu(), reference(q, k, v))
            assert c >= MIN_COSINE, f"call {i} (b={b}, n={n}): cosine {c:.5f}"
            worst, checked = min(worst, c), checked + 1
            del q, k, v, got, want
            if empty:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()        # the segments go back to the driver
                # Reuse the freed addresses with other data; a stale region would now read it.
                junk = torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.bfloat16)
                del junk
    segments = attend.regions.segments
    regions = cuda_client.status().tenant.regions - before
    print(f"\nFIGURE realloc calls={checked} worst_cosine={worst:.6f} "
          f"registrations={segments.registrations} released={segments.releases} "
          f"live_segments={len(segments)} daemon_regions={regions}")
    attend.regions.sweep()
    assert cuda_client.status().tenant.regions - before == len(attend.regions.segments)
    assert segments.releases > 0        # empty_cache freed segments and the sweep let them go


def test_compiled_block_on_the_gpu(cuda_client):
    from kvpack.comfy import AttentionOverride, sdpa_attention

    class Block(torch.nn.Module):
        def __init__(self, hook):
            super().__init__()
            self.qkv = torch.nn.Linear(H * D, 3 * H * D)
            self.hook = hook

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return torch.nn.functional.gelu(self.hook(sdpa_attention, q, k, v, H))

    torch.manual_seed(21)
    attend = kt.ProjectedAttention(cuda_client, formats=("int8",))
    hook = AttentionOverride(attend, min_tokens=16)
    block = Block(hook).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4100, H * D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = block(x)
        compiled = torch.compile(block, fullgraph=True)
        compiled(x)
        got = compiled(x)
    torch.cuda.synchronize()
    assert attend.last_transport == "cuda_ipc" and attend.last_registrations == 0
    assert hook.calls["kvpack"] == 3
    c = cosine(got.cpu(), want.cpu())
    print(f"\nFIGURE compile inductor fullgraph cosine_vs_eager={c:.6f} "
          f"outside_ms={1e3 * attend.last_outside_s:.3f}")
    assert c >= MIN_COSINE
    attend.regions.forget_all()


def test_the_daemon_waits_for_work_still_queued_on_the_callers_stream(cuda_client):
    """q, k, v are written by the last kernels of a long queue and the call is made without
    synchronising: the daemon must wait for the caller's event (header.cuda_wait_event)."""
    attend = kt.ProjectedAttention(cuda_client, formats=("int8",))
    inline = kt.ProjectedAttention(cuda_client, formats=("int8",), cuda_ipc=False)
    attend(*split(fused_qkv(1, 2048, seed=30)))           # registers; learns the daemon's events
    assert attend.regions.daemon_waits_on_events, "the CUDA backend takes cuda_wait_event"
    src = fused_qkv(1, 2048, seed=31)
    fused = torch.full_like(src, float("nan"))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(40):                                   # ~tens of ms of queued GPU work
        a = torch.tanh(a @ a) * 0.5
    fused.copy_(src + (a[0, 0] * 0).to(src.dtype))       # written only after that work
    got = attend(*split(fused))                           # no synchronise before this call
    assert attend.last_transport == "cuda_ipc"
    want = inline(*split(src))
    assert torch.equal(got.cpu(), want.cpu())
    print(f"\nFIGURE events queued_work_then_call equal_to_inline=True "
          f"daemon_queue_ms={1e3 * attend.last_result.seconds.queue:.3f}")
    attend.regions.forget_all()


def test_the_callers_stream_waits_for_the_daemons_kernels(cuda_client):
    """header.cuda_done_event: kvpackd answers once its last kernel is queued behind the caller's
    event, and the caller's stream waits for that event instead of the daemon synchronising first.
    A copy of the output made on the caller's stream right after the call (no synchronise) must
    equal the inline path's output: were the wait missing, it would copy a half-written buffer
    (the output block was filled with NaN just before). Then back-to-back calls with a DiT-like
    kernel between them, with and without the early answer: the GPU time saved per call."""
    n = int(os.environ.get("KVPACK_SEGMENTS_TOKENS", "32760"))
    attend = kt.ProjectedAttention(cuda_client, formats=("int8",))
    inline = kt.ProjectedAttention(cuda_client, formats=("int8",), cuda_ipc=False)
    q, k, v = split(fused_qkv(1, n, seed=60))
    attend(q, k, v)                                       # registers; learns what the daemon takes
    assert attend.regions.daemon_signals_events, "the CUDA backend takes cuda_done_event"
    assert attend.last_stream_ordered
    want = inline(q, k, v).cpu()
    for trial in range(3):
        junk = torch.full((1, n, H * D), float("nan"), device="cuda", dtype=torch.bfloat16)
        del junk                                          # the output's block, NaN-filled
        got = attend(q, k, v)
        snapshot = got.clone()                            # on the caller's stream, no synchronise
        assert attend.last_stream_ordered
        torch.cuda.synchronize()
        assert torch.equal(snapshot.cpu(), want), f"trial {trial}: read before the daemon's kernels ended"
        del got, snapshot

    def run(calls, stream_ordered):
        attend.use_done_events = stream_ordered
        x = torch.randn(2048, 2048, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            out = attend(q, k, v)
            x = torch.tanh(x @ x) * 0.5 + out.flatten()[0].float()   # the block's next kernels
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls, attend.last_stream_ordered

    calls = int(os.environ.get("KVPACK_SEGMENTS_CALLS", "12"))
    run(2, True)
    ordered, was_ordered = run(calls, True)
    synced, was_synced = run(calls, False)
    attend.use_done_events = True
    assert was_ordered and not was_synced
    print(f"\nFIGURE done_event tokens={n} heads={H}x{D} snapshot_equal_to_inline=True "
          f"per_call_ms stream_ordered={1e3 * ordered:.3f} daemon_synchronised={1e3 * synced:.3f} "
          f"saved_ms={1e3 * (synced - ordered):.3f}")
    attend.regions.forget_all()


def test_gpu_timeline_of_calls_between_the_callers_kernels(cuda_client):
    """Issue 17's measure that matters: DiT blocks (x·W_qkv, attention through the daemon, x·W_o,
    MLP) in a loop, wall time per block against the caller's kernels alone plus the daemon's own
    time, with the daemon answering early (stream order) and after its kernels. Prints one FIGURE
    timeline line per mode (kvpack/timeline.py says what each field means).
    KVPACK_TIMELINE_TOKENS (default: KVPACK_SEGMENTS_TOKENS, 32760) sets the size."""
    from kvpack import timeline

    n = int(os.environ.get("KVPACK_TIMELINE_TOKENS", os.environ.get("KVPACK_SEGMENTS_TOKENS", "32760")))
    blocks = int(os.environ.get("KVPACK_SEGMENTS_CALLS", "12"))
    attend = kt.ProjectedAttention(cuda_client, formats=("int8",))
    m = timeline.measure(attend, tokens=n, heads=H, head_dim=D, blocks=blocks)
    for line in timeline.figure_lines(m):
        print(("\n" if "synchronised" in line else "") + line)
    attend.regions.forget_all()
    assert m["stream_ordered"]["answered_early"], "the CUDA backend answers before its kernels end"
    assert not m["synchronised"]["answered_early"]
    # Stream order must not cost GPU time against answering after the kernels (it saves the
    # answer's round trip); 0.5 ms of slack for the spread between loops.
    assert m["stream_ordered"]["per_call_ms"] <= m["synchronised"]["per_call_ms"] + 0.5, m
