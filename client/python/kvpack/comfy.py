"""A ComfyUI attention override that runs self-attention through kvpackd.

ComfyUI calls `transformer_options["optimized_attention_override"](original, q, k, v, heads,
mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)` for
every attention it runs. q, k, v come as [B, N, H·d] (skip_reshape=False) or [B, H, N, d]
(skip_reshape=True); the output goes back as [B, N, H·d] or, with skip_output_reshape=True,
[B, H, N, d].

    from kvpack.comfy import AttentionOverride
    from kvpack.torch import ProjectedAttention
    hook = AttentionOverride(ProjectedAttention(kvpack.Client("unix:///run/kvpackd/kvpackd.sock")))
    model.model_options["transformer_options"]["optimized_attention_override"] = hook

The original function runs instead when kvpackd cannot help: a mask, cross-attention (k and v
of another length than q), a head size the daemon does not take, fewer than `min_tokens` tokens,
or the daemon answering UNAVAILABLE (not running, draining; then it is left alone for
`retry_after_s`) or RESOURCE_EXHAUSTED (the layer does not fit its budget). Other errors raise.

q, k and v reach `attend` as [B, N, H, d] views of ComfyUI's own memory (no copy here);
kvpack.torch.ProjectedAttention sends them as pre-projected input, by CUDA IPC when they sit on the
daemon's GPU.

Block-sparse attention: `AttentionOverride(attend, sparse=kvpack.Sparse(topk_ratio=0.2),
text_tokens=T)` hands `sparse` to attend with each call, and with T > 0 ranges whose first T tokens
(the text of an H3-style packed sequence; Wan's text goes through cross-attention, which stays with
the original) are marked always_attend: their key pages are never pooled. The node takes the same
as `sparse` ("topk=0.2", "tau=1.5,no_tail", "" for dense: kvpack.as_sparse) and `text_tokens`.
The fallback (the original attention) is dense.
"""

import logging
import os
import threading
import time

import grpc

from kvpack.errors import KvpackError
from kvpack.types import as_sparse, leading_text

try:
    import torch
    from kvpack import torch_ops
except ImportError:     # the node module loads without torch (ComfyUI always has it)
    torch = torch_ops = None

log = logging.getLogger("kvpack.comfy")

FALLBACK_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def to_tokens_major(t, heads, skip_reshape):
    """[B, N, H·d] or [B, H, N, d] -> a [B, N, H, d] view (or copy for the transposed layout)."""
    if skip_reshape:
        return t.transpose(1, 2)
    b, n, hd = t.shape
    return t.reshape(b, n, heads, hd // heads)


def from_tokens_major(o, skip_output_reshape):
    """[B, N, H, d] -> [B, H, N, d] (skip_output_reshape) or [B, N, H·d]."""
    if skip_output_reshape:
        return o.transpose(1, 2)
    b, n, h, d = o.shape
    return o.reshape(b, n, h * d)


class AttentionOverride:
    """Callable for ComfyUI's optimized_attention_override. `attend(q, k, v)` takes and returns
    [B, N, H, d] tensors (kvpack.torch.ProjectedAttention, or anything with that contract).
    With `sparse` set it is called as attend(q, k, v, ranges=..., sparse=...): ranges over one
    batch element with the first `text_tokens` always attended (None when text_tokens is 0).
    Thread-safe: ComfyUI may run it from several threads."""

    def __init__(self, attend, *, min_tokens=1024, head_dims=(64, 128), retry_after_s=30.0,
                 fallback_codes=FALLBACK_CODES, clock=time.monotonic, sparse=None,
                 text_tokens=0):
        if not isinstance(text_tokens, int) or text_tokens < 0:
            raise ValueError(f"text_tokens = {text_tokens!r} must be an int >= 0")
        self.sparse = as_sparse(sparse)
        self.text_tokens = text_tokens
        self.attend = attend
        self.min_tokens = min_tokens
        self.head_dims = tuple(head_dims)
        self.retry_after_s = retry_after_s
        self.fallback_codes = tuple(fallback_codes)
        self.clock = clock
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.calls = {"kvpack": 0, "fallback": 0}
        self._original = None
        self._op_id = torch_ops.register(self) if torch_ops is not None else None

    def reason_to_skip(self, q, k, v, heads, mask, skip_reshape):
        reason = self.static_reason_to_skip(q, k, v, heads, mask, skip_reshape)
        if reason is None and self.clock() < self._down_until:
            return "daemon unavailable"
        return reason

    def static_reason_to_skip(self, q, k, v, heads, mask, skip_reshape):
        """What the call's arguments alone rule out (shapes and mask: traceable by Dynamo)."""
        if mask is not None:
            return "mask"
        if q.shape != k.shape or k.shape != v.shape:
            return "cross-attention"
        n = q.shape[2] if skip_reshape else q.shape[1]
        d = q.shape[-1] if skip_reshape else q.shape[-1] // heads
        if d not in self.head_dims:
            return f"head_dim {d}"
        if n < self.min_tokens:
            return "short sequence"
        return None

    def __call__(self, original, q, k, v, heads, mask=None, attn_precision=None,
                 skip_reshape=False, skip_output_reshape=False, **kwargs):
        if torch_ops is not None and torch_ops.compiling():
            return self._traced(original, q, k, v, heads, mask, attn_precision, skip_reshape,
                                skip_output_reshape, kwargs)

        def fallback():
            with self._lock:
                self.calls["fallback"] += 1
            return original(q, k, v, heads, mask=mask, attn_precision=attn_precision,
                            skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                            **kwargs)

        self._original = original
        if self.reason_to_skip(q, k, v, heads, mask, skip_reshape):
            return fallback()
        return self._attend_or(fallback, q, k, v, heads, skip_reshape, skip_output_reshape)

    def _traced(self, original, q, k, v, heads, mask, attn_precision, skip_reshape,
                skip_output_reshape, kwargs):
        """Under torch.compile: calls that the arguments rule out go to the original, traced with
        the model (no counting: a lock would break the graph); the rest is one
        kvpack::attention_override op, which decides at run time between the daemon and the
        fallback. That fallback runs the original recorded by the latest call (Dynamo stores it
        after the graph runs, so the very first compiled call falls back to torch's SDPA) without
        the call's extra keyword arguments."""
        self._original = original
        if self.static_reason_to_skip(q, k, v, heads, mask, skip_reshape):
            return original(q, k, v, heads, mask=mask, attn_precision=attn_precision,
                            skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                            **kwargs)
        return torch.ops.kvpack.attention_override(q, k, v, self._op_id, heads, skip_reshape,
                                                   skip_output_reshape)

    def run_eager(self, q, k, v, heads, skip_reshape, skip_output_reshape):
        """The body of kvpack::attention_override: the daemon, else the recorded original."""
        original = self._original or sdpa_attention

        def fallback():
            with self._lock:
                self.calls["fallback"] += 1
            return original(q, k, v, heads, skip_reshape=skip_reshape,
                            skip_output_reshape=skip_output_reshape)

        if self.clock() < self._down_until:
            return fallback()
        return self._attend_or(fallback, q, k, v, heads, skip_reshape, skip_output_reshape)

    def _sparse_kwargs(self, n_tokens):
        """attend's extra arguments for a sequence of n_tokens: none for dense attention."""
        if self.sparse is None:
            return {}
        ranges = None
        if self.text_tokens:
            formats = getattr(self.attend, "formats", ("int8", "int4"))
            ranges = leading_text(n_tokens, self.text_tokens, formats)
        return {"ranges": ranges, "sparse": self.sparse}

    def _attend_or(self, fallback, q, k, v, heads, skip_reshape, skip_output_reshape):
        try:
            q, k, v = (to_tokens_major(t, heads, skip_reshape) for t in (q, k, v))
            out = self.attend(q, k, v, **self._sparse_kwargs(q.shape[1]))
        except KvpackError as e:
            if e.code not in self.fallback_codes:
                raise
            if e.code == grpc.StatusCode.UNAVAILABLE:
                with self._lock:
                    first = self.clock() >= self._down_until
                    self._down_until = self.clock() + self.retry_after_s
                if first:
                    log.warning("kvpackd unavailable (%s); local attention for %.0f s",
                                e.details, self.retry_after_s)
            else:
                log.info("kvpackd: %s; local attention for this call", e)
            return fallback()
        with self._lock:
            self.calls["kvpack"] += 1
        return from_tokens_major(out, skip_output_reshape).to(q.dtype)


def sdpa_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                   skip_output_reshape=False, **kwargs):
    """ComfyUI's attention contract in plain torch SDPA (ComfyUI's attention_pytorch)."""
    if not skip_reshape:
        q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return o if skip_output_reshape else o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


# ── ComfyUI node ────────────────────────────────────────────────────────────────────────────────
# To install, put a folder in ComfyUI/custom_nodes/ whose __init__.py says
#     from kvpack.comfy import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
# with the kvpack package installed in ComfyUI's Python.

class KvpackAttentionNode:
    """MODEL -> MODEL whose self-attention runs through kvpackd (original attention as fallback)."""

    CATEGORY = "advanced/attention"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "target": ("STRING", {"default": "unix:///run/kvpackd/kvpackd.sock"}),
            "formats": (["int8,int4", "int4", "int8", "bf16,int8,int4"],),
            "min_tokens": ("INT", {"default": 1024, "min": 1, "max": 1 << 24}),
        }, "optional": {
            "token": ("STRING", {"default": ""}),
            # Block-sparse attention: "topk=0.2", "tau=1.5", then ",no_tail", ",sink_pages=K",
            # ",min_exact_pages=K" (kvpack.as_sparse); "off" dense; "" KVPACK_SPARSE, else dense.
            "sparse": ("STRING", {"default": ""}),
            # Leading tokens of each sequence kept exact under sparse attention (packed text);
            # 0: KVPACK_TEXT_TOKENS, else 0.
            "text_tokens": ("INT", {"default": 0, "min": 0, "max": 1 << 24}),
        }}

    def patch(self, model, target, formats, min_tokens, token="", sparse="", text_tokens=0):
        from kvpack.client import Client
        from kvpack.torch import ProjectedAttention

        # KVPACK_TOKEN / KVPACK_TOKEN_FILE / KVPACK_TENANT / KVPACK_LANE / KVPACK_SPARSE / KVPACK_TEXT_TOKENS
        # from ComfyUI's environment apply unless the node sets them.
        overrides = {"target": target} if target else {}
        if token:
            overrides["token"] = token
        # A bad setting fails here, naming the field.
        sparse = as_sparse(sparse or os.environ.get("KVPACK_SPARSE", ""))
        if not text_tokens:
            text = os.environ.get("KVPACK_TEXT_TOKENS", "0").strip() or "0"
            if not text.isdigit():
                raise ValueError(f"KVPACK_TEXT_TOKENS = {text!r} is not an int >= 0")
            text_tokens = int(text)
        client = Client.from_env(**overrides)
        hook = AttentionOverride(ProjectedAttention(client, formats=tuple(formats.split(","))),
                                 min_tokens=min_tokens, sparse=sparse, text_tokens=text_tokens)
        patched = model.clone()
        options = patched.model_options.setdefault("transformer_options", {})
        options["optimized_attention_override"] = hook
        return (patched,)


NODE_CLASS_MAPPINGS = {"KvpackAttention": KvpackAttentionNode}
NODE_DISPLAY_NAME_MAPPINGS = {"KvpackAttention": "kvpack attention (kvpackd)"}
