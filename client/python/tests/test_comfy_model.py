"""ComfyUI's own Wan DiT (comfy.ldm.wan.model.WanModel, from a ComfyUI checkout named by
KVPACK_COMFYUI_DIR; nothing of ComfyUI is copied here) with kvpack.comfy.AttentionOverride:
self-attention goes to kvpackd, cross-attention to ComfyUI's attention, the output matches
ComfyUI's own attention, and a stopped daemon gives ComfyUI's output bit for bit.

On the CPU backend always (when the tree, torch and a kvpackd build are there), dense and
block-sparse (the override's sparse option); on the GPU (marker
`gpu`) through a CUDA-backed kvpackd by CUDA IPC, where a second step registers nothing. Prints
"FIGURE comfy ..." lines. Skips, saying why, without KVPACK_COMFYUI_DIR, without ComfyUI's own
dependencies (einops, ...) or without a kvpackd binary.

Model: 2 blocks, random weights (seeded), Wan's head size 128: on the CPU dim 256 = 2 heads, on the
GPU Wan-1.3B's widths (dim 1536 = 12 heads, ffn 8960). Latents 16 x F x H x W with patch
(1, 2, 2), so F·H·W/4 tokens per sequence.
"""

import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (the adapter's tests need it)")

import kvpack  # noqa: E402
import kvpack.torch as kt  # noqa: E402
from kvpack import testing  # noqa: E402
from kvpack.comfy import AttentionOverride  # noqa: E402

COMFY_DIR = os.environ.get("KVPACK_COMFYUI_DIR")
if not COMFY_DIR or not (pathlib.Path(COMFY_DIR) / "comfy" / "ldm" / "wan" / "model.py").is_file():
    pytest.skip("set KVPACK_COMFYUI_DIR to a ComfyUI checkout (comfy/ldm/wan/model.py) to run the "
                "real ComfyUI model", allow_module_level=True)
if testing.find_kvpackd() is None:
    pytest.skip("no kvpackd binary (build it; ctest sets KVPACK_BUILD_DIR)", allow_module_level=True)

TEXT_DIM, TEXT_LEN = 64, 16
SMALL = dict(num_heads=2, dim=256, ffn_dim=512)            # CPU
WAN_1_3B = dict(num_heads=12, dim=1536, ffn_dim=8960)      # GPU
# INT8 K/V against ComfyUI's bf16 attention, at the model's output after 2 blocks of random
# weights (the error goes through the blocks' projections and FFNs; 0.99939 measured with a
# stand-in model of the same shape); one attention alone keeps 0.99999 (test_torch_cuda_gpu.py).
MIN_COSINE = 0.995


def load_comfy(use_cpu):
    """comfy.ldm.wan.model and comfy.ops from the checkout; ComfyUI's argument parsing stays off
    (comfy.options), and without CUDA model_management is told to use the CPU before it loads."""
    if COMFY_DIR not in sys.path:
        sys.path.insert(0, COMFY_DIR)
    try:
        from comfy.cli_args import args
        args.cpu = use_cpu
        import comfy.ops
        from comfy.ldm.wan import model as wan
    except ImportError as e:
        pytest.skip(f"ComfyUI at {COMFY_DIR} does not import here ({e}); install its "
                    "requirements.txt")
    return wan, comfy.ops


def wan_model(device, widths, seed=0):
    wan, ops = load_comfy(device == "cpu")
    model = wan.WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=TEXT_LEN, in_dim=16,
                         freq_dim=256, text_dim=TEXT_DIM, out_dim=16, num_layers=2, device=device,
                         dtype=torch.bfloat16, operations=ops.disable_weight_init, **widths)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            if p.dim() == 1 and name.endswith(("norm_q.weight", "norm_k.weight",
                                               "norm3.weight")):  # norm scales near 1
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif p.dim() == 1:                                  # biases, small
                value = 0.02 * torch.randn(p.shape, generator=g)
            else:
                value = torch.randn(p.shape, generator=g) / fan_in ** 0.5
            p.copy_(value.to(p.dtype))
    return model.eval()


def inputs(device, frames, height, width, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, frames, height, width, generator=g)
    context = torch.randn(1, TEXT_LEN, TEXT_DIM, generator=g)
    timestep = torch.tensor([500.0])
    return (x.to(device, torch.bfloat16), timestep.to(device),
            context.to(device, torch.bfloat16))


def run(model, args, hook=None):
    options = {} if hook is None else {"optimized_attention_override": hook}
    with torch.no_grad():
        return model(*args, transformer_options=options)


def cosine(a, b):
    a, b = a.double().flatten().cpu(), b.double().flatten().cpu()
    return float(a @ b / (a.norm() * b.norm()))


class Recording:
    """attend(q, k, v, ...) that keeps each call's LayerResult."""

    def __init__(self, attend):
        self.attend, self.results = attend, []

    def __call__(self, q, k, v, **kwargs):
        out = self.attend(q, k, v, **kwargs)
        self.results.append(self.attend.last_result)
        return out


def step_timeline(model, args, hook, attend, tokens, steps=3):
    """Issue 17's measure on whole steps (the GPU timeline, kvpack/timeline.py for one block):
    step time with the daemon answering early (stream order) and after its kernels, against the
    step with self-attention left out (its output = v: the model's own kernels alone) plus the
    daemon's own time (LayerResult.seconds project + attend of the step's calls, synchronised).
    Returns the FIGURE line."""
    import time

    def timed():
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            run(model, args, hook)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / steps

    try:
        attend.use_done_events = True
        ordered = timed()
        recording = hook.attend = Recording(attend)
        attend.use_done_events = False
        synced = timed()
        hook.attend = lambda q, k, v, **kwargs: v
        alone = timed()
    finally:
        hook.attend, attend.use_done_events = attend, True
    calls = len(recording.results) / steps
    daemon = 1e3 * sum(r.seconds.project + r.seconds.attend for r in recording.results) / steps
    return (f"FIGURE comfy wan gpu timeline tokens={tokens} calls_per_step={calls:g} "
            f"step_ms stream_ordered={ordered:.3f} synchronised={synced:.3f} "
            f"without_self_attention={alone:.3f} daemon_ms_per_step={daemon:.3f} "
            f"idle_ms_per_call stream_ordered={(ordered - alone - daemon) / calls:.3f} "
            f"synchronised={(synced - alone - daemon) / calls:.3f} "
            f"call_over_daemon stream_ordered={(ordered - alone) / daemon:.4f} "
            f"synchronised={(synced - alone) / daemon:.4f}")


def test_wan_model_on_the_cpu_backend():
    model = wan_model("cpu", SMALL)
    args = inputs("cpu", frames=3, height=32, width=32)          # 768 tokens
    want = run(model, args)
    with testing.LocalDaemon() as d, kvpack.Client(d.target, timeout=120) as c:
        hook = AttentionOverride(kt.ProjectedAttention(c, formats=("int8",)), min_tokens=256)
        got = run(model, args, hook)
    assert hook.calls == {"kvpack": 2, "fallback": 2}   # 2 self-attentions, 2 cross-attentions
    assert got.shape == want.shape and got.dtype == want.dtype
    c = cosine(got, want)
    print(f"\nFIGURE comfy wan cpu tokens=768 cosine_vs_comfy={c:.6f}")
    assert c >= MIN_COSINE


def test_wan_model_sparse_on_the_cpu_backend():
    """The override's sparse option in ComfyUI's model: both self-attentions run block-sparse
    (Wan's text is cross-attention, which stays in ComfyUI, so no text_tokens), the output stays
    close to ComfyUI's (random weights have no locality, yet the pooled tail keeps cosine 0.99998
    measured at top-k 0.2) and equals the constructor path ProjectedAttention(sparse=...) bit for
    bit."""
    model = wan_model("cpu", SMALL)
    args = inputs("cpu", frames=3, height=32, width=32)          # 768 tokens: 12 pages
    want = run(model, args)
    with testing.LocalDaemon() as d, kvpack.Client(d.target, timeout=120) as c:
        attend = kt.ProjectedAttention(c, formats=("int8",))
        hook = AttentionOverride(attend, min_tokens=256, sparse="topk=0.2")
        got = run(model, args, hook)
        routed = attend.last_result.routed_fraction
        same = run(model, args, AttentionOverride(
            kt.ProjectedAttention(c, formats=("int8",), sparse=kvpack.Sparse(topk_ratio=0.2)),
            min_tokens=256))
        dense = run(model, args, AttentionOverride(kt.ProjectedAttention(c, formats=("int8",)),
                                                   min_tokens=256))
    assert hook.calls == {"kvpack": 2, "fallback": 2}
    c = cosine(got, want)
    print(f"\nFIGURE comfy wan cpu sparse topk=0.2 tokens=768 routed={routed:.3f} "
          f"cosine_vs_comfy={c:.6f}")
    assert 0.0 < routed < 1.0
    assert c >= MIN_COSINE
    assert torch.equal(got, same) and not torch.equal(got, dense)


def test_stopped_daemon_gives_comfyui_output_bit_for_bit():
    model = wan_model("cpu", SMALL)
    args = inputs("cpu", frames=2, height=32, width=32, seed=2)
    want = run(model, args)
    with kvpack.Client(f"127.0.0.1:{testing.free_port()}", timeout=5) as c:
        hook = AttentionOverride(kt.ProjectedAttention(c), min_tokens=256)
        got = run(model, args, hook)
    assert hook.calls == {"kvpack": 0, "fallback": 4}
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")
def test_wan_model_on_the_gpu_by_cuda_ipc():
    frames, height, width = (int(v) for v in
                             os.environ.get("KVPACK_COMFY_LATENT", "21x60x104").split("x"))
    tokens = frames * height * width // 4          # 21x60x104: 32,760 (Wan 1.3B at 480p)
    model = wan_model("cuda", WAN_1_3B)
    args = inputs("cuda", frames, height, width)
    want = run(model, args)
    try:
        daemon = testing.LocalDaemon(extra_args=("--backend=cuda",), budget_bytes=16 << 30)
        daemon.__enter__()
    except Exception as e:  # noqa: BLE001 - the daemon could not start on the GPU
        pytest.skip(f"no CUDA-backed kvpackd: {e}")
    try:
        # KVPACK_LANE=1: the calls go through a lane (kvpack.lane), as the node's would.
        lane = os.environ.get("KVPACK_LANE", "") not in ("", "0")
        with kvpack.Client(daemon.target, timeout=120, lane=lane) as c:
            if c.status().backend != "cuda":
                pytest.skip("kvpackd fell back to the CPU backend")
            attend = kt.ProjectedAttention(c, formats=("int8",))
            hook = AttentionOverride(attend, min_tokens=1024)
            run(model, args, hook)                          # step 1 registers the segments
            registered = attend.regions.registrations
            outside, daemon_s, ratio = [], [], []
            for _ in range(3):                              # steps 2-4 (last call of each)
                got = run(model, args, hook)
                torch.cuda.synchronize()
                outside.append(attend.last_outside_s)
                daemon_s.append(attend.last_result.seconds.total)
                ratio.append(attend.last_wall_s / attend.last_result.seconds.total)
            assert attend.last_transport == "cuda_ipc"
            steady = attend.regions.registrations - registered
            c_ = cosine(got, want)
            print(f"\nFIGURE comfy wan gpu tokens={tokens} method={c.last_layer_method} cosine_vs_comfy={c_:.6f} "
                  f"registrations_step1={registered} registrations_after={steady} "
                  f"outside_ms_last_calls={[round(1e3 * o, 3) for o in outside]} "
                  f"daemon_ms={[round(1e3 * s, 3) for s in daemon_s]} "
                  f"call_over_daemon_total={[round(r, 4) for r in ratio]}")
            assert steady == 0
            assert c_ >= MIN_COSINE
            print(step_timeline(model, args, hook, attend, tokens))
            attend.regions.forget_all()
    finally:
        daemon.__exit__(None, None, None)
