"""kvpack.comfy.AttentionOverride with torch tensors, a stand-in `attend` and a stand-in original
(no daemon). Skips without torch."""

import grpc
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (the adapter's tests need it)")

from kvpack.comfy import AttentionOverride  # noqa: E402
from kvpack.errors import KvpackError  # noqa: E402

B, H, N, D = 2, 3, 40, 64


def sdpa_bnhd(q, k, v):
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float())
    return o.transpose(1, 2)


def original(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
             skip_output_reshape=False, **kwargs):
    """ComfyUI's attention contract, in plain torch."""
    if not skip_reshape:
        q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return o if skip_output_reshape else o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


class Recorder:
    def __init__(self, error=None):
        self.error, self.shapes = error, []

    def __call__(self, q, k, v):
        self.shapes.append(tuple(q.shape))
        if self.error:
            raise self.error
        return sdpa_bnhd(q, k, v)


def inputs(layout):
    g = torch.Generator().manual_seed(3)
    shape = (B, H, N, D) if layout == "bhnd" else (B, N, H * D)
    return [torch.randn(shape, generator=g) for _ in range(3)]


@pytest.mark.parametrize("layout", ["bnhd_flat", "bhnd"])
@pytest.mark.parametrize("out_layout", [False, True])
def test_layouts_match_the_original(layout, out_layout):
    attend = Recorder()
    hook = AttentionOverride(attend, min_tokens=1)
    q, k, v = inputs(layout)
    skip = layout == "bhnd"
    got = hook(original, q, k, v, H, skip_reshape=skip, skip_output_reshape=out_layout,
               transformer_options={})
    want = original(q, k, v, H, skip_reshape=skip, skip_output_reshape=out_layout)
    assert attend.shapes == [(B, N, H, D)]
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert hook.calls == {"kvpack": 1, "fallback": 0}


@pytest.mark.parametrize("case", ["mask", "cross", "head_dim", "short"])
def test_unsupported_calls_go_to_the_original(case):
    attend = Recorder()
    hook = AttentionOverride(attend, min_tokens=1 if case != "short" else N + 1)
    q, k, v = inputs("bnhd_flat")
    heads, mask = H, None
    if case == "mask":
        mask = torch.zeros(N, N)
    elif case == "cross":
        k, v = k[:, :N - 5], v[:, :N - 5]
    elif case == "head_dim":
        heads = H * 2                     # head size 32
    out = hook(original, q, k, v, heads, mask=mask)
    assert attend.shapes == [] and hook.calls == {"kvpack": 0, "fallback": 1}
    torch.testing.assert_close(out, original(q, k, v, heads, mask=mask))


def test_unavailable_falls_back_and_pauses_the_daemon():
    now = [100.0]
    attend = Recorder(KvpackError(grpc.StatusCode.UNAVAILABLE, "connect failed"))
    hook = AttentionOverride(attend, min_tokens=1, retry_after_s=30, clock=lambda: now[0])
    q, k, v = inputs("bnhd_flat")
    for _ in range(3):
        torch.testing.assert_close(hook(original, q, k, v, H), original(q, k, v, H))
    assert len(attend.shapes) == 1, "no retries while the daemon is marked down"
    now[0] += 31
    hook(original, q, k, v, H)
    assert len(attend.shapes) == 2 and hook.calls["fallback"] == 4


def test_resource_exhausted_falls_back_each_time_other_errors_raise():
    attend = Recorder(KvpackError(grpc.StatusCode.RESOURCE_EXHAUSTED, "needs 9 GiB"))
    hook = AttentionOverride(attend, min_tokens=1)
    q, k, v = inputs("bhnd")
    hook(original, q, k, v, H, skip_reshape=True)
    hook(original, q, k, v, H, skip_reshape=True)
    assert len(attend.shapes) == 2 and hook.calls["fallback"] == 2
    hook.attend = Recorder(KvpackError(grpc.StatusCode.INVALID_ARGUMENT, "ranges"))
    with pytest.raises(KvpackError, match="INVALID_ARGUMENT"):
        hook(original, q, k, v, H, skip_reshape=True)


def test_extra_kwargs_reach_the_original():
    seen = {}

    def orig(q, k, v, heads, **kwargs):
        seen.update(kwargs)
        return q
    hook = AttentionOverride(Recorder(), min_tokens=10 ** 9)
    q, k, v = inputs("bnhd_flat")
    hook(orig, q, k, v, H, transformer_options={"x": 1}, _inside_attn_wrapper=True)
    assert seen["transformer_options"] == {"x": 1} and seen["_inside_attn_wrapper"] is True


def test_node_patches_a_clone_of_the_model():
    from kvpack.comfy import NODE_CLASS_MAPPINGS

    class Model:
        def __init__(self):
            self.model_options = {"transformer_options": {"other": 1}}

        def clone(self):
            m = Model()
            m.model_options = {k: dict(v) for k, v in self.model_options.items()}
            return m

    node = NODE_CLASS_MAPPINGS["KvpackAttention"]()
    assert "model" in node.INPUT_TYPES()["required"]
    original = Model()
    (patched,) = node.patch(original, "127.0.0.1:1", "int8,int4", 4096)
    hook = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(hook, AttentionOverride) and hook.min_tokens == 4096
    assert hook.attend.formats == ("int8", "int4")
    assert patched.model_options["transformer_options"]["other"] == 1
    assert "optimized_attention_override" not in original.model_options["transformer_options"]


class SparseRecorder(Recorder):
    formats = ("int8",)

    def __init__(self):
        super().__init__()
        self.kwargs = []

    def __call__(self, q, k, v, **kwargs):
        self.kwargs.append(kwargs)
        return super().__call__(q, k, v)


@pytest.mark.parametrize("layout", ["bnhd_flat", "bhnd"])
def test_sparse_reaches_attend_with_the_text_ranges(layout):
    from kvpack.types import Range, Sparse
    attend = SparseRecorder()
    hook = AttentionOverride(attend, min_tokens=1, sparse="topk=0.3,no_tail", text_tokens=8)
    q, k, v = inputs(layout)
    hook(original, q, k, v, H, skip_reshape=layout == "bhnd")
    assert attend.kwargs == [{"sparse": Sparse(topk_ratio=0.3, tail=False),
                              "ranges": [Range(0, 8, 0, ("int8",), always_attend=True),
                                         Range(8, N, 0, ("int8",))]}]
    AttentionOverride(attend, min_tokens=1, sparse={"rel_tau": 1.0})(original, q, k, v, H,
                                                                     skip_reshape=layout == "bhnd")
    assert attend.kwargs[-1] == {"sparse": Sparse(rel_tau=1.0), "ranges": None}
    plain = Recorder()          # dense: attend is called as before, without keywords
    AttentionOverride(plain, min_tokens=1, text_tokens=8)(original, q, k, v, H,
                                                          skip_reshape=layout == "bhnd")
    assert len(plain.shapes) == 1


def test_sparse_settings_are_checked_early():
    with pytest.raises(ValueError, match=r"sparse\.topk_ratio"):
        AttentionOverride(Recorder(), sparse="topk=2")
    with pytest.raises(ValueError, match="text_tokens"):
        AttentionOverride(Recorder(), text_tokens=-3)


def test_node_takes_sparse_from_its_setting_or_the_environment(monkeypatch):
    from kvpack.comfy import NODE_CLASS_MAPPINGS
    from kvpack.types import Sparse

    class Model:
        model_options = {}

        def clone(self):
            m = Model()
            m.model_options = {}
            return m

    node = NODE_CLASS_MAPPINGS["KvpackAttention"]()
    optional = node.INPUT_TYPES()["optional"]
    assert "sparse" in optional and "text_tokens" in optional
    hook_of = (lambda p: p[0].model_options["transformer_options"]["optimized_attention_override"])
    monkeypatch.delenv("KVPACK_SPARSE", raising=False)
    monkeypatch.delenv("KVPACK_TEXT_TOKENS", raising=False)
    hook = hook_of(node.patch(Model(), "127.0.0.1:1", "int8,int4", 64))
    assert hook.sparse is None and hook.text_tokens == 0
    hook = hook_of(node.patch(Model(), "127.0.0.1:1", "int8,int4", 64, sparse="tau=1.5",
                              text_tokens=512))
    assert hook.sparse == Sparse(rel_tau=1.5) and hook.text_tokens == 512
    monkeypatch.setenv("KVPACK_SPARSE", "topk=0.1,sink_pages=1")
    monkeypatch.setenv("KVPACK_TEXT_TOKENS", "256")
    hook = hook_of(node.patch(Model(), "127.0.0.1:1", "int8,int4", 64))
    assert hook.sparse == Sparse(topk_ratio=0.1, sink_pages=1) and hook.text_tokens == 256
    assert hook_of(node.patch(Model(), "127.0.0.1:1", "int8", 64, sparse="off")).sparse is None
    with pytest.raises(ValueError, match=r"sparse\.min_exact_pages"):
        node.patch(Model(), "127.0.0.1:1", "int8", 64, sparse="topk=0.2,min_exact_pages=-2")
    monkeypatch.setenv("KVPACK_TEXT_TOKENS", "many")
    with pytest.raises(ValueError, match="KVPACK_TEXT_TOKENS"):
        node.patch(Model(), "127.0.0.1:1", "int8", 64)
