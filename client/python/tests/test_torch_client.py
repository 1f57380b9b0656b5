"""kvpack.torch and kvpack.comfy through a real kvpack.Client: against the in-process fake daemon
always, against a real kvpackd when one is built. Skips without torch."""

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (the adapter's tests need it)")

import kvpack.torch as kt  # noqa: E402
from kvpack.comfy import AttentionOverride  # noqa: E402
from kvpack.shm import SharedArena  # noqa: E402
from kvpack.types import Rope  # noqa: E402

# int8 K/V and a bf16 output on Gaussian data: relative L2 error about 0.01 (see test_daemon.py).
REL_L2 = 0.03


def rel_l2(got, want):
    return (torch.linalg.norm(got.float() - want.float()) / torch.linalg.norm(want.float())).item()


@pytest.fixture
def client(each_daemon_client):
    return each_daemon_client


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_module_matches_local(client, transport):
    g = torch.Generator().manual_seed(8)
    lin = torch.nn.Linear(80, 3 * 2 * 64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / 80 ** 0.5)
    qn, kn = torch.rand(64, generator=g) + 0.5, torch.rand(64, generator=g) + 0.5
    rope = Rope(axis_dims=(32, 32), layout="interleaved")
    arena = SharedArena(client) if transport == "shm" else None
    attn = kt.KvpackSelfAttention.from_linear(client, lin, 2, q_norm=qn, k_norm=kn, rope=rope,
                                              fallback=False, arena=arena)
    x = torch.randn(2, 70, 80, generator=g)
    pos = torch.rand(70, 2, generator=g) * 30
    out = attn(x, pos)
    for b in range(2):
        want = kt.local_layer(x[b], lin.weight, 2, 64, bias=lin.bias, q_norm=qn, k_norm=kn,
                              positions=pos, rope=rope).detach()
        assert rel_l2(out[b].detach(), want) < REL_L2
    assert attn.last_result.peak_bytes > 0
    if arena:
        assert arena.region_id
        arena.close()


def test_comfy_hook_through_the_daemon(client):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 90, 64, generator=g) for _ in range(3))
    hook = AttentionOverride(kt.QkvAttention(client), min_tokens=1)

    def original(*args, **kwargs):
        raise AssertionError("the daemon should have served this call")
    out = hook(original, q, k, v, 3, skip_reshape=True, skip_output_reshape=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.shape == want.shape and rel_l2(out, want) < REL_L2
