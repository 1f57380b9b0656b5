"""kvpack.torch.ProjectedAttention and the ComfyUI hook against the real kvpackd: pre-projected
q, k, v match the identity-weight path bit for bit on the CPU backend (inline), and on a GPU host
the CUDA IPC path sends no inline bytes and matches the inline path. Skips without torch or a
kvpackd build; the CUDA test (marker `gpu`) skips without a CUDA device and a CUDA-backed kvpackd."""

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (the adapter's tests need it)")

import kvpack  # noqa: E402
import kvpack.torch as kt  # noqa: E402
from kvpack import testing  # noqa: E402
from kvpack.comfy import AttentionOverride  # noqa: E402

if testing.find_kvpackd() is None:
    pytest.skip("no kvpackd binary (build it; ctest sets KVPACK_BUILD_DIR)", allow_module_level=True)

B, N, H, D = 2, 150, 2, 64


def qkv(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(B, N, 3 * H * D, generator=g) + 2.0 * (torch.arange(3 * H * D) % 23 == 4)
    return fused.to(device=device, dtype=torch.bfloat16)


def split(fused):
    """q, k, v as [B, N, H, d] views of one fused tensor (row stride 3·H·d): no copy."""
    return [t.unflatten(-1, (H, D)) for t in fused.chunk(3, dim=-1)]


@pytest.fixture(scope="module")
def cpu_client():
    with testing.LocalDaemon() as d, kvpack.Client(d.target, timeout=60) as c:
        yield c


def test_projected_matches_the_identity_path_bit_for_bit(cpu_client):
    q, k, v = split(qkv())
    got = kt.ProjectedAttention(cpu_client)(q, k, v)
    want = kt.QkvAttention(cpu_client)(q, k, v)
    assert got.shape == (B, N, H, D) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


@pytest.mark.parametrize("skip_reshape", [False, True])
def test_comfy_hook_sends_both_layouts(cpu_client, skip_reshape):
    q, k, v = split(qkv(seed=1))
    attend = kt.ProjectedAttention(cpu_client)
    hook = AttentionOverride(attend, min_tokens=1)
    if skip_reshape:                                           # [B, H, N, d]
        args = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    else:                                                      # [B, N, H·d]
        args = [t.reshape(B, N, H * D) for t in (q, k, v)]
    out = hook(None, *args, H, skip_reshape=skip_reshape)
    assert hook.calls["kvpack"] == 1 and attend.last_transport == "inline"
    assert out.shape == (B, N, H * D)
    assert torch.equal(out.reshape(B, N, H, D), kt.ProjectedAttention(cpu_client)(q, k, v))


def test_projected_layout_reads_strides():
    q, _, _ = split(qkv())
    assert kt.projected_layout(q) == ("token_major", 3 * H * D, 0)
    heads = q.transpose(1, 2).contiguous().transpose(1, 2)     # [B, N, H, d] view of [B, H, N, d]
    assert kt.projected_layout(heads) == ("head_major", 0, B)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")
def test_cuda_ipc_sends_no_inline_bytes_and_matches_inline():
    try:
        daemon = testing.LocalDaemon(extra_args=("--backend=cuda",))
        daemon.__enter__()
    except Exception as e:  # noqa: BLE001 - the daemon could not start on the GPU
        pytest.skip(f"no CUDA-backed kvpackd: {e}")
    try:
        with kvpack.Client(daemon.target, timeout=120) as c:
            if c.status().backend != "cuda":
                pytest.skip("kvpackd fell back to the CPU backend")
            for head_major in (False, True):
                q, k, v = split(qkv("cuda", seed=2))
                if head_major:
                    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
                ipc = kt.ProjectedAttention(c)
                before = c.status()
                got = ipc(q, k, v)
                after = c.status()
                assert ipc.last_transport == "cuda_ipc"
                assert after.inline_bytes_received == before.inline_bytes_received
                assert after.inline_bytes_sent == before.inline_bytes_sent
                assert got.device == q.device and got.shape == (B, N, H, D)
                want = kt.ProjectedAttention(c, cuda_ipc=False)(q, k, v)
                assert torch.equal(got.cpu(), want.cpu())
                # A second call reuses the registered regions.
                regions = c.status().cuda_ipc_regions
                ipc(q, k, v)
                assert c.status().cuda_ipc_regions == regions
            del ipc, q, k, v, got
    finally:
        daemon.__exit__(None, None, None)
