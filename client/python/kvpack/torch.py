"""PyTorch adapter: run a DiT block's QKV projection and attention through kvpackd.

    import kvpack, kvpack.torch
    client = kvpack.Client("unix:///run/kvpackd/kvpackd.sock")
    attn = kvpack.torch.KvpackSelfAttention.from_linear(client, block.qkv, heads=24,
               q_norm=block.norm_q.weight, k_norm=block.norm_k.weight,
               rope=kvpack.Rope(axis_dims=(16, 56, 56)))
    out = attn(x, positions)        # [B, N, H·d], what `attn(rope(norm(split(qkv(x)))))` gave

Tensors travel inline (bf16 bits, 1 MiB chunks), or through shared memory with
`arena=kvpack.shm.SharedArena(client)` (same host; share one arena between modules); sending CUDA
tensors by CUDA IPC when they sit on the daemon's GPU is a later step. A batch of B is packed as B sequences of one request
(block-diagonal attention), so no padding is sent.

`QkvAttention` is the other entry point: attention over q, k, v already projected (what the
ComfyUI hook receives), sent as x = [q | k | v] against an identity weight. It moves 3× the
activations and runs an identity GEMM, so prefer KvpackSelfAttention where the block can be
wrapped.
"""

import threading

import grpc
import numpy as np
import torch

from kvpack import tensors
from kvpack.errors import KvpackError
from kvpack.types import LayerOptions, Range

FALLBACK_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


# ── wire conversion ─────────────────────────────────────────────────────────────────────────────

def to_wire_bf16(t):
    """A tensor as contiguous uint16 bf16 bits on the host (numpy shares the tensor's memory)."""
    t = t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return t.view(torch.int16).numpy().view(np.uint16)


def to_wire_f32(t):
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()


def from_wire_bf16(bits, shape, like):
    """uint16 bf16 bits -> a tensor of `shape` with like's device and dtype."""
    bits = np.require(bits, dtype=np.uint16, requirements=["C", "W"])   # copies read-only buffers
    t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    return t.reshape(shape).to(device=like.device, dtype=like.dtype)


# ── local computation (fallback and tests) ──────────────────────────────────────────────────────

def rms_norm(t, weight, eps):
    """t [..., H, d]; weight [d] or [H·d]."""
    h, d = t.shape[-2:]
    w = weight.reshape(-1).float()
    w = w.reshape(d) if w.numel() == d else w.reshape(h, d)
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w


def apply_rope(t, positions, rope):
    """t [N, H, d] float32; positions [N, axes]. Same pairing as kvpack.reference.rope."""
    r = sum(rope.axis_dims)
    angles = []
    for a, dim in enumerate(rope.axis_dims):
        i = torch.arange(dim // 2, dtype=torch.float64, device=t.device)
        freq = rope.theta ** (-2.0 * i / dim)
        angles.append(positions[:, a:a + 1].double() * freq)
    ang = torch.cat(angles, dim=1)[:, None, :].float()              # [N, 1, R/2]
    if rope.layout == "interleaved":
        ia = torch.arange(0, r, 2, device=t.device)
        ib = ia + 1
    else:
        ia = torch.arange(r // 2, device=t.device)
        ib = ia + r // 2
    x0, x1 = t[..., ia], t[..., ib]
    out = t.clone()
    out[..., ia] = x0 * ang.cos() - x1 * ang.sin()
    out[..., ib] = x0 * ang.sin() + x1 * ang.cos()
    return out


def local_layer(x, w_qkv, heads, head_dim, *, bias=None, q_norm=None, k_norm=None, eps=1e-6,
                positions=None, rope=None, ranges=None, causal=False, softmax_scale=0.0):
    """What the daemon computes (unquantized), in torch float32: x [N, D] -> [N, H·d]."""
    n, hd = x.shape[0], heads * head_dim
    qkv = torch.nn.functional.linear(x.float(), w_qkv.float(),
                                     None if bias is None else bias.float())
    q, k, v = (qkv[:, i * hd:(i + 1) * hd].reshape(n, heads, head_dim) for i in range(3))
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    if rope is not None:
        q, k = apply_rope(q, positions, rope), apply_rope(k, positions, rope)
    seq = torch.zeros(n, dtype=torch.long, device=x.device)
    for r in ranges or ():
        seq[r.begin:r.end] = r.seq_id
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed,
        scale=softmax_scale or None)
    return o.transpose(0, 1).reshape(n, hd)


# ── through the daemon ──────────────────────────────────────────────────────────────────────────

def pack_batch(ranges, batch, n_tokens):
    """Ranges of one sequence-set of n_tokens, repeated for each batch element with disjoint
    sequence ids (block-diagonal attention across the batch)."""
    seqs = max(r.seq_id for r in ranges) + 1
    return [r.shifted(b * n_tokens, b * seqs) for b in range(batch) for r in ranges]


class KvpackSelfAttention(torch.nn.Module):
    """qkv Linear + (QK-norm) + (RoPE) + attention of a DiT block, run by kvpackd.

    forward(x [B, N, D] or [N, D], positions [B, N, A] / [N, A] or None, ranges=None) returns
    [B, N, H·d] (or [N, H·d]) in x's dtype and device, before the block's output projection.
    `ranges` (kvpack.Range over one batch element's N tokens) set sequences and allowed formats;
    by default one sequence in `formats`. With fallback=True, UNAVAILABLE and RESOURCE_EXHAUSTED
    compute the layer locally in torch instead of raising.
    """

    def __init__(self, client, w_qkv, heads, head_dim, *, bias=None, q_norm=None, k_norm=None,
                 eps=1e-6, rope=None, causal=False, softmax_scale=0.0,
                 formats=("int8", "int4"), priority=0, timeout=None, fallback=True,
                 arena=None):
        super().__init__()
        if w_qkv.shape[0] != 3 * heads * head_dim:
            raise ValueError(f"w_qkv has {w_qkv.shape[0]} rows, want 3·{heads}·{head_dim}")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        self.client = client
        self.w_qkv, self.bias, self.q_norm, self.k_norm = w_qkv, bias, q_norm, k_norm
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.rope, self.causal, self.softmax_scale = rope, causal, softmax_scale
        self.formats, self.priority, self.timeout = tuple(formats), priority, timeout
        self.fallback = fallback
        self.arena = arena
        self.last_result = None
        self._handle = None
        self._handle_key = None
        self._lock = threading.Lock()

    @classmethod
    def from_linear(cls, client, linear, heads, **kwargs):
        head_dim = linear.out_features // (3 * heads)
        return cls(client, linear.weight, heads, head_dim, bias=linear.bias, **kwargs)

    def _weights_key(self):
        # A new tensor or an in-place update (LoRA patching) changes the key: register again.
        return tuple((t.data_ptr(), t._version) if t is not None else None
                     for t in (self.w_qkv, self.bias, self.q_norm, self.k_norm))

    def weights_handle(self, refresh=False):
        with self._lock:
            key = self._weights_key()
            if refresh or self._handle is None or key != self._handle_key:
                opt = (lambda t: None if t is None else to_wire_f32(t))
                w = self.client.register_weights(
                    to_wire_bf16(self.w_qkv), n_heads=self.heads, head_dim=self.head_dim,
                    bias=opt(self.bias), q_norm_weight=opt(self.q_norm),
                    k_norm_weight=opt(self.k_norm), timeout=self.timeout)
                self._handle, self._handle_key = w.handle, key
            return self._handle

    def _remote(self, x2, positions2, ranges):
        kwargs = dict(n_heads=self.heads, head_dim=self.head_dim, ranges=ranges,
                      positions=None if positions2 is None else to_wire_f32(positions2),
                      options=LayerOptions(rope=self.rope, causal=self.causal,
                                           softmax_scale=self.softmax_scale,
                                           qk_norm_eps=self.eps if self.q_norm is not None else None),
                      priority=self.priority, timeout=self.timeout)
        xw = to_wire_bf16(x2)
        run = self.arena.attention_layer if self.arena else self.client.attention_layer
        try:
            res = run(xw, self.weights_handle(), **kwargs)
        except KvpackError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise
            # The weights' lease ran out (or the daemon restarted): register once more.
            res = run(xw, self.weights_handle(refresh=True), **kwargs)
        self.last_result = res.result
        return from_wire_bf16(res.output, (x2.shape[0], self.heads * self.head_dim), x2)

    def forward(self, x, positions=None, ranges=None):
        batched = x.dim() == 3
        xb = x if batched else x[None]
        b, n, _ = xb.shape
        ranges = list(ranges) if ranges else [Range(0, n, 0, self.formats)]
        packed = pack_batch(ranges, b, n)
        x2 = xb.reshape(b * n, -1)
        p2 = None
        if positions is not None:
            pb = positions if batched else positions[None]
            p2 = pb.expand(b, -1, -1).reshape(b * n, -1)
        try:
            out = self._remote(x2, p2, packed)
        except KvpackError as e:
            if not self.fallback or e.code not in FALLBACK_CODES:
                raise
            out = local_layer(x2, self.w_qkv, self.heads, self.head_dim, bias=self.bias,
                              q_norm=self.q_norm, k_norm=self.k_norm, eps=self.eps,
                              positions=p2, rope=self.rope, ranges=packed, causal=self.causal,
                              softmax_scale=self.softmax_scale).to(x.dtype)
        out = out.reshape(b, n, -1)
        return out if batched else out[0]


class QkvAttention:
    """attend(q, k, v) over [B, N, H, d] tensors through kvpackd (for kvpack.comfy): x is
    [q | k | v] per token and the registered weight the identity, so the daemon's projection hands
    q, k, v through. One identity weight per width is registered and kept."""

    def __init__(self, client, *, formats=("int8", "int4"), priority=0, timeout=None,
                 arena=None):
        self.client = client
        self.arena = arena
        self.formats, self.priority, self.timeout = tuple(formats), priority, timeout
        self._handles = {}
        self._lock = threading.Lock()
        self.last_result = None

    def _identity(self, heads, head_dim, refresh=False):
        width = 3 * heads * head_dim
        with self._lock:
            if refresh or (heads, head_dim) not in self._handles:
                w = self.client.register_weights(tensors.identity_qkv_weight(width),
                                                 n_heads=heads, head_dim=head_dim,
                                                 timeout=self.timeout)
                self._handles[(heads, head_dim)] = w.handle
            return self._handles[(heads, head_dim)]

    def __call__(self, q, k, v):
        b, n, h, d = q.shape
        x = torch.cat([t.reshape(b * n, h * d) for t in (q, k, v)], dim=1)
        xw = to_wire_bf16(x)
        ranges = pack_batch([Range(0, n, 0, self.formats)], b, n)
        kwargs = dict(n_heads=h, head_dim=d, ranges=ranges, priority=self.priority,
                      timeout=self.timeout)
        run = self.arena.attention_layer if self.arena else self.client.attention_layer
        try:
            res = run(xw, self._identity(h, d), **kwargs)
        except KvpackError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise
            res = run(xw, self._identity(h, d, refresh=True), **kwargs)
        self.last_result = res.result
        return from_wire_bf16(res.output, (b, n, h, d), q)
