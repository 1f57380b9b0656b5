"""kvpack.torch against a stand-in client (tests/fake_client.py) and its own local path.
Skips without torch."""

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (the adapter's tests need it)")

import kvpack.torch as kt  # noqa: E402
from fake_client import FakeClient  # noqa: E402
from kvpack import reference  # noqa: E402
from kvpack.errors import KvpackError  # noqa: E402
from kvpack.types import Range, Rope  # noqa: E402

BF16_TOL = dict(rtol=2e-2, atol=2e-2)    # output rounded to bf16 on the wire (8 mantissa bits)


def block(heads=3, head_dim=16, hidden=40, seed=5, norm=True):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(hidden, 3 * heads * head_dim, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / hidden ** 0.5)
        lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) / 10)
    qn = torch.rand(head_dim, generator=g) + 0.5 if norm else None
    kn = torch.rand(head_dim, generator=g) + 0.5 if norm else None
    return lin, qn, kn


def test_wire_round_trip():
    t = torch.randn(5, 7).to(torch.bfloat16)
    bits = kt.to_wire_bf16(t)
    assert bits.dtype == np.uint16 and bits.shape == (5, 7)
    assert torch.equal(kt.from_wire_bf16(bits, (5, 7), t), t)
    f = torch.randn(3, 2, dtype=torch.float64)
    assert kt.to_wire_f32(f).dtype == np.float32


def test_local_layer_matches_numpy_reference():
    lin, qn, kn = block()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(29, 40, generator=g)
    pos = torch.rand(29, 2, generator=g) * 20
    rope = Rope(axis_dims=(6, 8), layout="interleaved", theta=300.0)
    ranges = [Range(0, 11, 0), Range(11, 29, 1)]
    got = kt.local_layer(x, lin.weight, 3, 16, bias=lin.bias, q_norm=qn, k_norm=kn,
                         positions=pos, rope=rope, ranges=ranges, causal=True)
    want = reference.attention_layer(
        x.double().numpy(), lin.weight.detach().double().numpy(), 3, 16,
        bias=lin.bias.detach().double().numpy(), q_norm_weight=qn.double().numpy(),
        k_norm_weight=kn.double().numpy(), positions=pos.double().numpy(),
        rope_layout=reference.ROPE_INTERLEAVED, axis_dims=(6, 8), theta=300.0,
        seq_ids=reference.seq_ids_from_ranges([(0, 11, 0), (11, 29, 1)], 29), causal=True)
    np.testing.assert_allclose(got.detach().double().numpy(), want, rtol=1e-4, atol=1e-5)


def test_module_through_client_matches_local_and_packs_the_batch():
    client = FakeClient()
    lin, qn, kn = block()
    rope = Rope(axis_dims=(8, 8))
    attn = kt.KvpackSelfAttention.from_linear(client, lin, 3, q_norm=qn, k_norm=kn, rope=rope)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 21, 40, generator=g)
    pos = torch.rand(21, 2, generator=g) * 8
    out = attn(x, pos)
    assert out.shape == (2, 21, 48) and out.dtype == x.dtype
    call = client.layer_calls[0]
    assert call["x_shape"] == (42, 40)
    assert [(r.begin, r.end, r.seq_id) for r in call["ranges"]] == [(0, 21, 0), (21, 42, 1)]
    for b in range(2):
        want = kt.local_layer(x[b], lin.weight, 3, 16, bias=lin.bias, q_norm=qn, k_norm=kn,
                              positions=pos, rope=rope)
        torch.testing.assert_close(out[b], want.detach(), **BF16_TOL)
    attn(x, pos)
    assert len(client.weights) == 1, "weights registered once"
    with torch.no_grad():
        lin.weight.mul_(0.5)            # an in-place update (e.g. a LoRA patch)
    attn(x, pos)
    assert len(client.weights) == 2, "an updated weight is registered again"


def test_module_fallback_and_reregistration():
    client = FakeClient()
    lin, _, _ = block(norm=False)
    attn = kt.KvpackSelfAttention.from_linear(client, lin, 3)
    x = torch.randn(17, 40)
    want = kt.local_layer(x, lin.weight, 3, 16, bias=lin.bias).detach()
    client.errors = [KvpackError(grpc.StatusCode.UNAVAILABLE, "down")]
    torch.testing.assert_close(attn(x).detach(), want, rtol=1e-5, atol=1e-5)   # local path
    client.errors = [KvpackError(grpc.StatusCode.NOT_FOUND, "lease expired")]
    torch.testing.assert_close(attn(x).detach(), want, **BF16_TOL)
    assert len(client.weights) == 2
    client.errors = [KvpackError(grpc.StatusCode.INVALID_ARGUMENT, "ranges")]
    with pytest.raises(KvpackError):
        attn(x)
    strict = kt.KvpackSelfAttention.from_linear(client, lin, 3, fallback=False)
    client.errors = [KvpackError(grpc.StatusCode.RESOURCE_EXHAUSTED, "9 GiB")]
    with pytest.raises(KvpackError):
        strict(x)


def test_qkv_attention_identity_path_matches_sdpa():
    client = FakeClient()
    attend = kt.QkvAttention(client)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 19, 3, 16, generator=g) for _ in range(3))
    out = attend(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, want, **BF16_TOL)
    attend(q, k, v)
    assert len(client.weights) == 1 and client.layer_calls[0]["x_shape"] == (38, 144)
