"""kvpack's torch.library custom ops (kvpack.torch_ops): torch.library.opcheck on each op, and
models compiled with torch.compile(fullgraph=True) — which fails on any graph break — giving the
eager results, through stand-in clients (no daemon) and through the real kvpackd on the CPU
backend when one is built. Skips without torch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (the adapter's tests need it)")

import kvpack  # noqa: E402
import kvpack.torch as kt  # noqa: E402
from fake_client import FakeClient  # noqa: E402
from kvpack import tensors, testing, torch_ops  # noqa: E402
from kvpack.comfy import AttentionOverride, sdpa_attention  # noqa: E402
from kvpack.types import LayerOutput, Range  # noqa: E402

if not torch_ops.AVAILABLE:
    pytest.skip("torch.library.custom_op needs torch >= 2.4", allow_module_level=True)

B, N, H, D = 2, 80, 2, 64
HIDDEN = 96
BACKEND = "aot_eager"      # Dynamo + AOTAutograd on fake tensors (the fake impls), no C++ compile


class SdpaProjectedClient:
    """attention_projected computed with torch SDPA in fp32, output rounded to bf16 bits."""

    def __init__(self):
        self.calls = 0

    def attention_projected(self, q, k, v, *, n_heads, head_dim, ranges, options, priority,
                            timeout):
        self.calls += 1
        qkv = [torch.from_numpy(tensors.from_bf16_bits(t).reshape(-1, n_heads, head_dim))
               for t in (q, k, v)]
        seq = torch.zeros(qkv[0].shape[0], dtype=torch.long)
        for r in ranges:
            seq[r.begin:r.end] = r.seq_id
        o = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(0, 1).float() for t in qkv), attn_mask=seq[:, None] == seq[None, :])
        out = o.transpose(0, 1).reshape(o.shape[1], -1).numpy()
        return LayerOutput(tensors.to_bf16_bits(out), None)


def rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) + 0.3 * (torch.arange(shape[-1]) % 7 == 2)).to(
        torch.bfloat16)


class Block(torch.nn.Module):
    """A DiT block's attention part, written the ComfyUI way: self-attention through the
    override hook, then cross-attention to a shorter context (which the hook hands back to the
    original)."""

    def __init__(self, hook):
        super().__init__()
        g = torch.Generator().manual_seed(9)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * H * D).to(torch.bfloat16)
        self.out = torch.nn.Linear(H * D, HIDDEN).to(torch.bfloat16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 8)
        self.hook = hook

    def forward(self, x, context):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = self.hook(sdpa_attention, q, k, v, H)                     # self-attention
        c = self.hook(sdpa_attention, a, context, context, H)         # cross-attention
        return self.out(a + c)


def test_ranges_round_trip_through_ints():
    ranges = [Range(0, 5, 0, ("int8", "int4")), Range(5, 9, 1, ("bf16",)),
              Range(9, 12, 1, ("int4", "int8", "bf16")),
              Range(12, 20, 2, ("int8",), always_attend=True),
              Range(20, 30, 2, ("int4",), attend_densely=True),
              Range(30, 31, 3, ("bf16",), always_attend=True, attend_densely=True)]
    assert torch_ops.decode_ranges(torch_ops.encode_ranges(ranges)) == ranges
    assert torch_ops.encode_ranges(None) == []


def test_opcheck_projected_attention():
    attend = kt.ProjectedAttention(SdpaProjectedClient(), cuda_ipc=False)
    q, k, v = (rand(B, N, H, D, seed=s) for s in (1, 2, 3))
    torch.library.opcheck(torch.ops.kvpack.projected_attention.default,
                          (q, k, v, attend._op_id, [], []), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("skip_reshape,skip_output_reshape", [(False, False), (True, True)])
def test_opcheck_attention_override(skip_reshape, skip_output_reshape):
    hook = AttentionOverride(kt.ProjectedAttention(SdpaProjectedClient(), cuda_ipc=False),
                             min_tokens=1)
    shape = (B, H, N, D) if skip_reshape else (B, N, H * D)
    q, k, v = (rand(*shape, seed=s) for s in (4, 5, 6))
    torch.library.opcheck(torch.ops.kvpack.attention_override.default,
                          (q, k, v, hook._op_id, H, skip_reshape, skip_output_reshape),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_block_matches_eager_without_graph_breaks():
    client = SdpaProjectedClient()
    hook = AttentionOverride(kt.ProjectedAttention(client, cuda_ipc=False), min_tokens=16)
    block = Block(hook)
    x, context = rand(B, N, HIDDEN, seed=7), rand(B, 11, H * D, seed=8)
    with torch.no_grad():
        want = block(x, context)
        assert client.calls == 1 and hook.calls == {"kvpack": 1, "fallback": 1}
        compiled = torch.compile(block, fullgraph=True, backend=BACKEND)
        for _ in range(2):
            got = compiled(x, context)
            assert torch.equal(got, want)
    assert client.calls == 3 and hook.calls["kvpack"] == 3   # the op ran on each compiled call


def test_compiled_hook_falls_back_when_the_daemon_is_unavailable():
    import grpc
    from kvpack.errors import KvpackError

    class Down:
        def __call__(self, q, k, v):
            raise KvpackError(grpc.StatusCode.UNAVAILABLE, "connect failed")

    hook = AttentionOverride(Down(), min_tokens=16)
    block = Block(hook)
    x, context = rand(B, N, HIDDEN, seed=10), rand(B, 11, H * D, seed=11)
    with torch.no_grad():
        want = Block(lambda original, *a, **kw: original(*a, **kw))(x, context)
        got = torch.compile(block, fullgraph=True, backend=BACKEND)(x, context)
    assert torch.equal(got, want) and hook.calls["fallback"] == 1


def test_compiled_self_attention_module_matches_eager():
    lin = torch.nn.Linear(40, 3 * 3 * 16)
    attn = kt.KvpackSelfAttention.from_linear(FakeClient(), lin, heads=3)
    x = torch.randn(2, 33, 40, generator=torch.Generator().manual_seed(12))
    ranges = [Range(0, 20, 0, ("int8",)), Range(20, 33, 1, ("int8",))]
    with torch.no_grad():
        want = attn(x, ranges=ranges)
        got = torch.compile(lambda t: attn(t, ranges=ranges) * 2, fullgraph=True,
                            backend=BACKEND)(x)
    assert torch.equal(got, 2 * want)


@pytest.mark.skipif(testing.find_kvpackd() is None, reason="no kvpackd binary")
def test_compiled_block_through_kvpackd_cpu_backend():
    with testing.LocalDaemon() as d, kvpack.Client(d.target, timeout=60) as c:
        attend = kt.ProjectedAttention(c, formats=("int8",))
        hook = AttentionOverride(attend, min_tokens=16)
        block = Block(hook)
        x, context = rand(B, N, HIDDEN, seed=13), rand(B, 11, H * D, seed=14)
        with torch.no_grad():
            want = block(x, context)
            got = torch.compile(block, fullgraph=True, backend=BACKEND)(x, context)
        assert attend.last_transport == "inline" and hook.calls["kvpack"] == 2
        assert torch.equal(got, want)
        np.testing.assert_array_equal(got.float().numpy(), want.float().numpy())


def test_sparse_round_trips_through_floats():
    from kvpack.types import Sparse
    for s in (None, Sparse(), Sparse(topk_ratio=0.3, tail=False, sink_pages=2, min_exact_pages=7),
              Sparse(rel_tau=1.25)):
        assert torch_ops.decode_sparse(torch_ops.encode_sparse(s)) == s


def test_compiled_projected_attention_carries_ranges_and_sparse():
    """Under torch.compile the per-call ranges (their sparse flags too) and sparse option reach
    the client through the kvpack::projected_attention op as they do eagerly."""
    from kvpack.types import Sparse

    class Recording(SdpaProjectedClient):
        def __init__(self):
            super().__init__()
            self.seen = []

        def attention_projected(self, q, k, v, *, ranges, options, **kwargs):
            self.seen.append((list(ranges), options.sparse))
            return super().attention_projected(q, k, v, ranges=ranges, options=options, **kwargs)

    client = Recording()
    attend = kt.ProjectedAttention(client, cuda_ipc=False, formats=("int8",))
    element = [Range(0, 16, 0, ("int8",), always_attend=True),
               Range(16, N, 0, ("int8",), attend_densely=True)]
    sparse = Sparse(topk_ratio=0.25, tail=False, sink_pages=1)

    def f(q, k, v):
        return attend(q, k, v, ranges=element, sparse=sparse) * 2

    q, k, v = (rand(B, N, H, D, seed=s) for s in (1, 2, 3))
    with torch.no_grad():
        want = f(q, k, v)
        got = torch.compile(f, fullgraph=True, backend=BACKEND)(q, k, v)
    assert torch.equal(got, want)
    assert len(client.seen) == 2 and client.seen[0] == client.seen[1]
    ranges, seen_sparse = client.seen[1]
    assert seen_sparse == sparse
    assert ranges == kt.pack_batch(element, B, N) and ranges[2].always_attend
