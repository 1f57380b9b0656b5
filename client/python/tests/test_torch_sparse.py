"""Block-sparse attention (LayerOptions.sparse) through kvpack.torch and the ComfyUI override,
against the real kvpackd on the CPU backend, on kvpack.locality data (a leading text range, then a
frames × height × width grid): the option reaches the daemon (0 < routed_fraction < 1) on every
call path — ProjectedAttention inline, KvpackSelfAttention inline and through shared memory (the
unary AttentionLayerRegions call), AttentionOverride — and each gives the client's own call with
the same LayerOptions and ranges bit for bit. Skips without torch or a kvpackd build.

On a GPU host (marker `gpu`) a CUDA-backed kvpackd gets the same call by CUDA IPC: it must route
the same fraction as the CPU backend and give the inline call's output bit for bit. Prints
"FIGURE sparse ..." lines (pytest -s shows them; a failed assertion carries them)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (the adapter's tests need it)")

import kvpack  # noqa: E402
import kvpack.torch as kt  # noqa: E402
from kvpack import locality, tensors, testing  # noqa: E402
from kvpack.comfy import AttentionOverride, sdpa_attention  # noqa: E402
from kvpack.errors import InvalidArgument  # noqa: E402
from kvpack.shm import SharedArena  # noqa: E402
from kvpack.types import LayerOptions, Range, Sparse, leading_text  # noqa: E402

if testing.find_kvpackd() is None:
    pytest.skip("no kvpackd binary (build it; ctest sets KVPACK_BUILD_DIR)", allow_module_level=True)

H, D, TEXT = 2, 64, 64
GRID = dict(frames=4, height=16, width=16)          # 1024 grid tokens: 17 pages with the text
N = TEXT + 4 * 16 * 16
FORMATS = ("int8", "int4")
SPARSE = Sparse(topk_ratio=0.2)
# CUDA against CPU backend output, sparse path: the routes are the same and the outputs differ by
# rounding only (rel L2 <= 0.003 measured in cuda_sparse_test); 3x room.
CUDA_VS_CPU_REL_L2 = 0.01


def qkv(batch=1, seed=5):
    """bf16 [B, N, H, d] q, k, v with locality, one seed per batch element."""
    parts = [locality.locality_data(text_tokens=TEXT, n_heads=H, head_dim=D, seed=seed + b, **GRID)
             for b in range(batch)]
    return [torch.from_numpy(np.stack([p[i] for p in parts])).to(torch.bfloat16)
            for i in range(3)]


def bits(t):
    return kt.to_wire_bf16(t.reshape(-1, H * D))


def direct(client, q, k, v, element_ranges, options):
    """The client's own attention_projected call for the same batch."""
    b, n = q.shape[:2]
    res = client.attention_projected(bits(q), bits(k), bits(v), n_heads=H, head_dim=D,
                                     ranges=kt.pack_batch(element_ranges, b, n), options=options)
    return kt.from_wire_bf16(res.output, q.shape, q), res.result


def assert_routed(result):
    assert 0.0 < result.routed_fraction < 1.0, result.routed_fraction


@pytest.fixture(scope="module")
def client():
    with testing.LocalDaemon(budget_bytes=256 << 20) as d, kvpack.Client(d.target, timeout=60) as c:
        c.wait_ready(10)
        yield c


@pytest.mark.parametrize("batch", [1, 2])
def test_projected_sparse_reaches_the_daemon_and_matches_the_client(client, batch):
    q, k, v = qkv(batch)
    attend = kt.ProjectedAttention(client, sparse=SPARSE)
    got = attend(q, k, v)
    assert attend.last_transport == "inline"
    assert_routed(attend.last_result)
    want, result = direct(client, q, k, v, [Range(0, N, 0, FORMATS)], LayerOptions(sparse=SPARSE))
    assert torch.equal(got, want)
    assert attend.last_result.routed_fraction == result.routed_fraction
    dense = kt.ProjectedAttention(client)(q, k, v)
    assert not torch.equal(got, dense)


def test_topk_one_is_the_dense_output_bit_for_bit(client):
    q, k, v = qkv()
    attend = kt.ProjectedAttention(client, sparse="topk=1")
    assert torch.equal(attend(q, k, v), kt.ProjectedAttention(client)(q, k, v))
    assert attend.last_result.routed_fraction == 1.0


def test_text_tokens_are_always_attended(client):
    q, k, v = qkv(seed=9)
    plain = kt.ProjectedAttention(client, sparse=SPARSE)
    text = kt.ProjectedAttention(client, sparse=SPARSE, text_tokens=TEXT)
    got_plain, got_text = plain(q, k, v), text(q, k, v)
    want, _ = direct(client, q, k, v, leading_text(N, TEXT, FORMATS), LayerOptions(sparse=SPARSE))
    assert torch.equal(got_text, want)
    # The same ranges given per call, and the sparse option given per call, say the same.
    explicit = [Range(0, TEXT, 0, FORMATS, always_attend=True), Range(TEXT, N, 0, FORMATS)]
    assert torch.equal(kt.ProjectedAttention(client)(q, k, v, ranges=explicit, sparse=SPARSE),
                       want)
    # The text page is exact for every query block now: more exact pages, closer to dense.
    assert text.last_result.routed_fraction > plain.last_result.routed_fraction
    dense = kt.ProjectedAttention(client)(q, k, v).float()
    err = [((o.float() - dense).norm() / dense.norm()).item() for o in (got_plain, got_text)]
    print(f"FIGURE sparse topk=0.2 routed {plain.last_result.routed_fraction:.3f} "
          f"rel_l2 {err[0]:.3f}"
          f"; with text_tokens={TEXT}: routed {text.last_result.routed_fraction:.3f} "
          f"rel_l2 {err[1]:.3f}")
    assert err[1] < err[0]


def test_qkv_attention_sparse_matches_projected(client):
    q, k, v = qkv(seed=17)
    qkv_path = kt.QkvAttention(client, sparse=SPARSE, text_tokens=TEXT)
    projected = kt.ProjectedAttention(client, sparse=SPARSE, text_tokens=TEXT)
    assert torch.equal(qkv_path(q, k, v), projected(q, k, v))
    assert_routed(qkv_path.last_result)
    assert qkv_path.last_result.routed_fraction == projected.last_result.routed_fraction


@pytest.mark.parametrize("shared_memory", [False, True])
def test_self_attention_sparse_inline_and_through_shared_memory(client, shared_memory):
    """KvpackSelfAttention over x = [q | k | v] and the identity weight: the projection hands the
    locality data through, so routing sees it."""
    q, k, v = qkv(seed=11)
    x = torch.cat([t.reshape(1, N, H * D) for t in (q, k, v)], dim=-1)
    eye = torch.eye(3 * H * D, dtype=torch.bfloat16)
    arena = SharedArena(client, initial_bytes=1 << 20) if shared_memory else None
    try:
        attn = kt.KvpackSelfAttention(client, eye, H, D, sparse="topk=0.2", text_tokens=TEXT,
                                      arena=arena, fallback=False)
        got = attn(x)
        assert client.last_layer_method == ("AttentionLayerRegions" if shared_memory
                                             else "AttentionLayer")
        assert_routed(attn.last_result)
        res = client.attention_layer(kt.to_wire_bf16(x[0]), attn.weights_handle(), n_heads=H,
                                     head_dim=D, ranges=leading_text(N, TEXT, attn.formats),
                                     options=LayerOptions(sparse=SPARSE))
        assert torch.equal(got[0], kt.from_wire_bf16(res.output, (N, H * D), x))
        assert attn.last_result.routed_fraction == res.result.routed_fraction
    finally:
        if arena is not None:
            arena.close()


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="torch < 2.4: no custom ops")
def test_compiled_self_attention_keeps_the_sparse_flags(client):
    """torch.compile(fullgraph): the kvpack::self_attention op carries the ranges' always_attend
    flags (the sparse option is the module's), so the compiled call routes as the eager one."""
    q, k, v = qkv(seed=23)
    x = torch.cat([t.reshape(N, H * D) for t in (q, k, v)], dim=-1)
    attn = kt.KvpackSelfAttention(client, torch.eye(3 * H * D, dtype=torch.bfloat16), H, D,
                                  sparse=SPARSE, fallback=False)
    text = leading_text(N, TEXT, attn.formats)
    with torch.no_grad():
        plain = attn(x)
        plain_routed = attn.last_result.routed_fraction
        want = attn(x, None, text)
        want_routed = attn.last_result.routed_fraction
        got = torch.compile(lambda t: attn(t, None, text) * 2, fullgraph=True,
                            backend="aot_eager")(x)
    assert torch.equal(got, want * 2)
    assert attn.last_result.routed_fraction == want_routed > plain_routed
    assert not torch.equal(plain, want)


@pytest.mark.parametrize("skip_reshape", [False, True])
def test_comfy_override_sparse_path(client, skip_reshape):
    q, k, v = qkv(batch=2, seed=13)
    attend = kt.ProjectedAttention(client)               # dense by itself: the hook says sparse
    hook = AttentionOverride(attend, min_tokens=1, sparse="topk=0.2", text_tokens=TEXT)
    if skip_reshape:                                           # [B, H, N, d]
        args = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    else:                                                      # [B, N, H·d]
        args = [t.reshape(2, N, H * D) for t in (q, k, v)]
    out = hook(sdpa_attention, *args, H, skip_reshape=skip_reshape)
    assert hook.calls == {"kvpack": 1, "fallback": 0}
    assert_routed(attend.last_result)
    want, _ = direct(client, q, k, v, leading_text(N, TEXT, FORMATS), LayerOptions(sparse=SPARSE))
    assert torch.equal(out.reshape(2, N, H, D), want)


def test_bad_values_name_the_field(client):
    with pytest.raises(ValueError, match=r"sparse\.topk_ratio"):
        kt.ProjectedAttention(client, sparse={"topk_ratio": 0})
    with pytest.raises(ValueError, match=r"sparse\.rel_tau"):
        kt.KvpackSelfAttention(client, torch.eye(3 * H * D), H, D, sparse="tau=-1")
    with pytest.raises(ValueError, match=r"sparse\.sink_pages"):
        AttentionOverride(kt.ProjectedAttention(client), sparse={"sink_pages": 5000})
    with pytest.raises(ValueError, match="text_tokens"):
        kt.ProjectedAttention(client, text_tokens=-1)
    q, k, v = qkv()
    flagged = [Range(0, TEXT, 0, FORMATS, always_attend=True), Range(TEXT, N, 0, FORMATS)]
    with pytest.raises(ValueError, match=r"ranges\[0\]\.always_attend needs sparse"):
        kt.ProjectedAttention(client)(q, k, v, ranges=flagged)
    # What the early check spares: the daemon's own answer, naming the field.
    with pytest.raises(InvalidArgument, match=r"header\.ranges\[0\]\.always_attend"):
        client.attention_projected(bits(q), bits(k), bits(v), n_heads=H, head_dim=D,
                                   ranges=flagged)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")
def test_cuda_ipc_sparse_matches_inline_and_routes_as_the_cpu(client):
    try:
        daemon = testing.LocalDaemon(extra_args=("--backend=cuda",))
        daemon.__enter__()
    except Exception as e:  # noqa: BLE001 - the daemon could not start on the GPU
        pytest.skip(f"no CUDA-backed kvpackd: {e}")
    try:
        with kvpack.Client(daemon.target, timeout=120) as c:
            if c.status().backend != "cuda":
                pytest.skip("kvpackd fell back to the CPU backend")
            q, k, v = qkv(batch=2, seed=19)
            cpu = kt.ProjectedAttention(client, sparse=SPARSE, text_tokens=TEXT)
            want = cpu(q, k, v).float()
            ipc = kt.ProjectedAttention(c, sparse=SPARSE, text_tokens=TEXT)
            got = ipc(*(t.cuda() for t in (q, k, v)))
            inline = kt.ProjectedAttention(c, sparse=SPARSE, text_tokens=TEXT, cuda_ipc=False)
            got_inline = inline(q, k, v)
            err = ((got.float().cpu() - want).norm() / want.norm()).item()
            same = torch.equal(got.cpu(), got_inline)
            figure = (f"FIGURE sparse cuda_ipc transport={ipc.last_transport} routed="
                      f"{ipc.last_result.routed_fraction:.4f} inline_routed="
                      f"{inline.last_result.routed_fraction:.4f} cpu_routed="
                      f"{cpu.last_result.routed_fraction:.4f} rel_l2_vs_cpu={err:.4f} "
                      f"(bound {CUDA_VS_CPU_REL_L2}) ipc_equals_inline={same}")
            print("\n" + figure)
            assert ipc.last_transport == "cuda_ipc", figure
            assert ipc.last_result.routed_fraction == cpu.last_result.routed_fraction, figure
            assert inline.last_result.routed_fraction == cpu.last_result.routed_fraction, figure
            assert same, figure
            assert err < CUDA_VS_CPU_REL_L2, figure
            del ipc, got
    finally:
        daemon.__exit__(None, None, None)
