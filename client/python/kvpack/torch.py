"""PyTorch adapter: run a DiT block's QKV projection and attention through kvpackd.

    import kvpack, kvpack.torch
    client = kvpack.Client("unix:///run/kvpackd/kvpackd.sock")
    attn = kvpack.torch.KvpackSelfAttention.from_linear(client, block.qkv, heads=24,
               q_norm=block.norm_q.weight, k_norm=block.norm_k.weight,
               rope=kvpack.Rope(axis_dims=(16, 56, 56)))
    out = attn(x, positions)        # [B, N, H·d], what `attn(rope(norm(split(qkv(x)))))` gave

Tensors travel inline (bf16 bits, 1 MiB chunks), or through shared memory with
`arena=kvpack.shm.SharedArena(client)` (same host; share one arena between modules). A batch of B
is packed as B sequences of one request (block-diagonal attention), so no padding is sent.

`ProjectedAttention` is the other entry point: attention over q, k, v already projected (what the
ComfyUI hook receives), sent as they are (header.projected: no weights, no GEMM). CUDA tensors on
the daemon's GPU travel as CUDA IPC regions — nothing is copied, the output is written into a
tensor allocated here — and everything else inline. `QkvAttention` (x = [q | k | v] against an
identity weight: 3× the data and an identity GEMM) is kept for daemons older than header.projected.

All three take `sparse=` (a kvpack.Sparse, its fields as a mapping, its text form "topk=0.2,no_tail"
or None: kvpack.as_sparse) for block-sparse attention, and `text_tokens=`: the leading tokens of
each sequence (H3-style packed text or conditioning) marked always_attend under sparse attention, so
their key pages are never pooled. Explicit `ranges` (kvpack.Range with always_attend /
attend_densely) say more. The local fallback of KvpackSelfAttention computes dense attention.
"""

import dataclasses
import logging
import threading
import time

import grpc
import numpy as np
import torch

from kvpack import tensors, torch_ops
from kvpack.errors import KvpackError
from kvpack.types import LayerOptions, RegionSlice, as_sparse, check_range_flags, leading_text

log = logging.getLogger("kvpack.torch")

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

def element_ranges(n_tokens, formats, sparse, text_tokens):
    """The default ranges of one batch element: one sequence, its first text_tokens always
    attended when sparse attention is on (the flag means nothing, and is refused, without it)."""
    return leading_text(n_tokens, text_tokens if sparse is not None else 0, formats)


def check_text_tokens(text_tokens):
    if not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens = {text_tokens!r} must be an int >= 0")
    return text_tokens


def pack_batch(ranges, batch, n_tokens):
    """Ranges of one sequence-set of n_tokens, repeated for each batch element with disjoint
    sequence ids (block-diagonal attention across the batch)."""
    seqs = max(r.seq_id for r in ranges) + 1
    return [r.shifted(b * n_tokens, b * seqs) for b in range(batch) for r in ranges]


class KvpackSelfAttention(torch.nn.Module):
    """qkv Linear + (QK-norm) + (RoPE) + attention of a DiT block, run by kvpackd.

    forward(x [B, N, D] or [N, D], positions [B, N, A] / [N, A] or None, ranges=None) returns
    [B, N, H·d] (or [N, H·d]) in x's dtype and device, before the block's output projection.
    `ranges` (kvpack.Range over one batch element's N tokens) set sequences, allowed formats and
    sparse flags; by default one sequence in `formats` (its first `text_tokens` always attended
    under `sparse`). With fallback=True, UNAVAILABLE and RESOURCE_EXHAUSTED
    compute the layer locally in torch instead of raising.
    """

    def __init__(self, client, w_qkv, heads, head_dim, *, bias=None, q_norm=None, k_norm=None,
                 eps=1e-6, rope=None, causal=False, softmax_scale=0.0,
                 formats=("int8", "int4"), priority=0, timeout=None, fallback=True,
                 arena=None, sparse=None, text_tokens=0):
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
        self.sparse = as_sparse(sparse)
        self.text_tokens = check_text_tokens(text_tokens)
        self.last_result = None
        self._handle = None
        self._handle_key = None
        self._lock = threading.Lock()
        self._op_id = torch_ops.register(self)

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
        eps = self.eps if self.q_norm is not None else None
        kwargs = dict(n_heads=self.heads, head_dim=self.head_dim, ranges=ranges,
                      positions=None if positions2 is None else to_wire_f32(positions2),
                      options=LayerOptions(rope=self.rope, causal=self.causal,
                                           softmax_scale=self.softmax_scale, qk_norm_eps=eps,
                                           sparse=self.sparse),
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
        if torch_ops.compiling():     # one opaque op in the graph (kvpack::self_attention)
            return torch.ops.kvpack.self_attention(x, positions, self._op_id,
                                                   torch_ops.encode_ranges(ranges))
        return self.forward_eager(x, positions, ranges)

    def forward_eager(self, x, positions=None, ranges=None):
        batched = x.dim() == 3
        xb = x if batched else x[None]
        b, n, _ = xb.shape
        if ranges:
            ranges = list(ranges)
            check_range_flags(ranges, self.sparse)
        else:
            ranges = element_ranges(n, self.formats, self.sparse, self.text_tokens)
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
                 arena=None, sparse=None, text_tokens=0):
        self.client = client
        self.arena = arena
        self.formats, self.priority, self.timeout = tuple(formats), priority, timeout
        self.sparse = as_sparse(sparse)
        self.text_tokens = check_text_tokens(text_tokens)
        self.options = LayerOptions(sparse=self.sparse)
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
        ranges = pack_batch(element_ranges(n, self.formats, self.sparse, self.text_tokens), b, n)
        kwargs = dict(n_heads=h, head_dim=d, ranges=ranges, options=self.options,
                      priority=self.priority, timeout=self.timeout)
        run = self.arena.attention_layer if self.arena else self.client.attention_layer
        try:
            res = run(xw, self._identity(h, d), **kwargs)
        except KvpackError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise
            res = run(xw, self._identity(h, d, refresh=True), **kwargs)
        self.last_result = res.result
        return from_wire_bf16(res.output, (b, n, h, d), q)


# ── pre-projected q, k, v; CUDA IPC ─────────────────────────────────────────────────────────────

def _uuid_text(uuid):
    text = str(uuid).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


class CudaIpcRegions:
    """CUDA tensors as slices of CUDA IPC regions of one daemon: one region per cudaMalloc segment
    of PyTorch's caching allocator (kvpack.cuda_segments.SegmentRegions), registered on first use
    and addressed by offset, so steady-state calls register nothing. `sweep()` unregisters the
    segments freed since (torch.cuda.empty_cache()); `maybe_sweep()` does so at most every 0.25 s,
    before each call. A segment freed and reallocated at the same address is a new region, never
    the old one. `reaches(t)` says whether t sits on the daemon's GPU (Status.device_uuid against
    torch.cuda.get_device_properties(...).uuid). Thread-safe."""

    def __init__(self, client, *, driver=None):
        self.client = client
        self._driver = driver
        self._lock = threading.Lock()
        self._segments = None               # SegmentRegions, made on first use
        self._daemon = None                 # (uuid, ordinal), or () when it serves no GPU
        self.daemon_waits_on_events = False     # Status.cuda_wait_event
        self.daemon_signals_events = False      # Status.cuda_done_event
        self._reaches = {}                      # device index -> on the daemon's GPU

    def daemon_device(self):
        if self._daemon is None:
            st = self.client.status()
            # getattr: stubs generated from an older kvpack.proto lack the field
            self.daemon_waits_on_events = getattr(st, "cuda_wait_event", False)
            self.daemon_signals_events = getattr(st, "cuda_done_event", False)
            self._daemon = (_uuid_text(st.device_uuid), st.device_ordinal) if st.device_uuid else ()
        return self._daemon

    def reaches(self, t):
        if not t.is_cuda:
            return False
        daemon = self.daemon_device()
        if not daemon:
            return False
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        same = self._reaches.get(index)
        if same is None:      # asked three times per call: the answer per device is kept
            props = torch.cuda.get_device_properties(index)
            same = self._reaches[index] = _uuid_text(getattr(props, "uuid", "")) == daemon[0]
        return same

    @property
    def segments(self):
        with self._lock:
            if self._segments is None:
                from kvpack.cuda_segments import SegmentRegions
                self._segments = SegmentRegions(self.client, self.daemon_device()[1],
                                                driver=self._driver)
            return self._segments

    @property
    def registrations(self):
        """RegisterRegion calls made so far (0 per call in steady state)."""
        return self._segments.registrations if self._segments is not None else 0

    def slice(self, t, nbytes):
        """The RegionSlice of `nbytes` starting at t's first element."""
        return self.segments.slice(t.data_ptr(), nbytes)

    def sweep(self):
        return self._segments.sweep() if self._segments is not None else 0

    def maybe_sweep(self):
        return self._segments.maybe_sweep() if self._segments is not None else 0

    def forget_all(self):
        """Drops every cached region (after NOT_FOUND: a daemon restart or an expired lease)."""
        if self._segments is not None:
            self._segments.forget_all()


def projected_layout(t):
    """How a bf16 [B, N, H, d] tensor (a view is fine) lies in memory, in header.projected terms:
    ("token_major", row_stride, 0), ("head_major", 0, B), or None (copy it first)."""
    b, n, h, d = t.shape
    s = t.stride()
    if s[3] == 1 and s[2] == d and s[1] >= h * d and (b == 1 or s[0] == n * s[1]):
        return "token_major", s[1], 0
    if t.transpose(1, 2).is_contiguous():
        return "head_major", 0, b
    return None


def _span_bytes(layout, row_stride, n_tokens, hd):
    if layout == "head_major":
        return 2 * n_tokens * hd
    return 2 * ((n_tokens - 1) * row_stride + hd)


class ProjectedAttention:
    """attend(q, k, v) over [B, N, H, d] tensors (views of [B, N, H·d] or [B, H, N, d] memory are
    fine) through kvpackd's pre-projected input; returns [B, N, H, d] in q's dtype and device.
    On the daemon's GPU (cuda_ipc=True) q, k, v and the output travel as CUDA IPC regions; else
    inline. `last_result` holds the LayerResult, `last_transport` "cuda_ipc" or "inline".
    attend(q, k, v, ranges=None, sparse=None): ranges over one batch element's N tokens
    (kvpack.Range, sparse flags included), by default one sequence in `formats` whose first
    `text_tokens` are always attended under sparse attention; `sparse` given for one call takes
    the place of the constructor's (kvpack.comfy.AttentionOverride passes its own)."""

    def __init__(self, client, *, formats=("int8", "int4"), causal=False, softmax_scale=0.0,
                 priority=0, timeout=None, cuda_ipc=True, sparse=None, text_tokens=0):
        self.client = client
        self.formats, self.priority, self.timeout = tuple(formats), priority, timeout
        self.sparse = as_sparse(sparse)
        self.text_tokens = check_text_tokens(text_tokens)
        self.options = LayerOptions(causal=causal, softmax_scale=softmax_scale,
                                    sparse=self.sparse)
        self.regions = CudaIpcRegions(client) if cuda_ipc else None
        self.last_result = None
        self.last_transport = None
        self.last_registrations = 0     # RegisterRegion calls the last call made
        self.last_wall_s = 0.0          # the last call's time here, daemon included
        self.use_events = True          # stream order by CUDA IPC events where the daemon can
        self.use_done_events = True     # the daemon answers before its kernels finish, where it can
        self.last_stream_ordered = False    # the last call's answer came before the kernels ended
        # Whether the daemon's kernels were still running when that answer arrived (its done event
        # still pending): then this stream's next kernels were queued before the GPU needed them.
        self.last_answer_ahead = False
        # The last CUDA IPC call's time here by step, seconds: "before" (layouts, output, region
        # lookups, event record), "rpc" (the header and the gRPC call, the daemon's total inside),
        # "after" (the stream's wait on the done event, the output view).
        self.last_split = None
        self._events = threading.local()    # per thread: {device index: interprocess event}
        self._op_id = torch_ops.register(self)
        self._ranges = {}               # (B, N, ranges) -> the packed ranges of the call

    def __call__(self, q, k, v, ranges=None, sparse=None):
        sparse = self.sparse if sparse is None else as_sparse(sparse)
        if ranges:
            check_range_flags(ranges, sparse)
        if torch_ops.compiling():     # one opaque op in the graph (kvpack::projected_attention)
            return torch.ops.kvpack.projected_attention(q, k, v, self._op_id,
                                                        torch_ops.encode_ranges(ranges),
                                                        torch_ops.encode_sparse(sparse))
        return self.attend_eager(q, k, v, ranges, sparse)

    def attend_eager(self, q, k, v, ranges=None, sparse=None):
        start = time.perf_counter()
        registered = self.regions.registrations if self.regions is not None else 0
        try:
            return self._attend(q, k, v, ranges, self.sparse if sparse is None else sparse)
        finally:
            self.last_wall_s = time.perf_counter() - start
            if self.regions is not None:
                self.last_registrations = self.regions.registrations - registered

    @property
    def last_outside_s(self):
        """The last call's time outside the daemon: wall time here minus the daemon's total."""
        if self.last_result is None:
            return None
        return self.last_wall_s - self.last_result.seconds.total

    def _attend(self, q, k, v, element, sparse):
        b, n, h, d = q.shape
        options = (self.options if sparse == self.options.sparse
                   else dataclasses.replace(self.options, sparse=sparse))
        key = (b, n, tuple(element) if element else sparse is not None)
        ranges = self._ranges.get(key)
        if ranges is None:          # one entry per sequence shape (and ranges) the model uses
            if len(self._ranges) >= 64:
                self._ranges.clear()
            element = list(element) if element else element_ranges(
                n, self.formats, sparse, self.text_tokens)
            ranges = self._ranges[key] = pack_batch(element, b, n)
        if self.regions is not None and all(self.regions.reaches(t) for t in (q, k, v)):
            try:
                return self._by_ipc(q, k, v, ranges, options)
            except ValueError as e:
                log.warning("kvpack: CUDA IPC not possible (%s); sending inline", e)
                self.regions = None
            except KvpackError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
                self.regions.forget_all()       # daemon restart or expired lease: register again
                return self._by_ipc(q, k, v, ranges, options)
        qw, kw, vw = (to_wire_bf16(t.reshape(b * n, h * d)) for t in (q, k, v))
        res = self.client.attention_projected(qw, kw, vw, n_heads=h, head_dim=d, ranges=ranges,
                                              options=options, priority=self.priority,
                                              timeout=self.timeout)
        self.last_result, self.last_transport = res.result, "inline"
        return from_wire_bf16(res.output, (b, n, h, d), q)

    def _by_ipc(self, q, k, v, ranges, options):
        t0 = time.perf_counter()
        b, n, h, d = q.shape
        hd, n_tokens = h * d, b * n
        qkv = [t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16) for t in (q, k, v)]
        layouts = [projected_layout(t) for t in qkv]
        # One layout for all three, rows 16-byte aligned (the GPU epilogue's vector loads).
        if (None in layouts or len(set(layouts)) != 1 or layouts[0][1] % 8
                or any(t.data_ptr() % 16 for t in qkv)):
            qkv = [t.contiguous() for t in qkv]
            layouts = [("token_major", hd, 0)] * 3
        layout, row_stride, batch = layouts[0]
        span = _span_bytes(layout, row_stride, n_tokens, hd)
        out = torch.empty((b, n, hd), dtype=torch.bfloat16, device=q.device)
        self.regions.maybe_sweep()  # unregisters the segments freed since (rate-limited)
        slices = [self.regions.slice(t, span) for t in qkv]
        out_slice = self.regions.slice(out, out.numel() * out.element_size())
        kwargs = dict(n_heads=h, head_dim=d, ranges=ranges, layout=layout, row_stride=row_stride,
                      batch=batch, n_tokens=n_tokens, options=options,
                      priority=self.priority, output=out_slice, timeout=self.timeout)
        stream = torch.cuda.current_stream(q.device)
        event = self._caller_event(q.device, stream)
        if event is None:
            stream.synchronize()        # q, k, v written before it reads
        done = self._done_event(q.device, stream)
        t1 = time.perf_counter()
        while True:
            try:
                res = self.client.attention_projected(
                    *slices, cuda_wait_event=event, cuda_done_event=done and done[1], **kwargs)
                break
            except KvpackError as e:
                refused = e.code in (grpc.StatusCode.INVALID_ARGUMENT,
                                     grpc.StatusCode.FAILED_PRECONDITION)
                if done is not None and refused and "cuda_done_event" in e.details:
                    log.warning("kvpack: the daemon cannot signal this process's events (%s); "
                                "it answers after its kernels instead", e.details)
                    self.use_done_events, done = False, None
                elif event is not None and refused and "cuda_wait_event" in e.details:
                    log.warning("kvpack: the daemon cannot wait for this process's events (%s); "
                                "synchronising instead", e.details)
                    self.use_events, event = False, None
                    stream.synchronize()
                else:
                    raise
        t2 = time.perf_counter()
        self.last_result, self.last_transport = res.result, "cuda_ipc"
        self.last_stream_ordered = done is not None
        self.last_answer_ahead = done is not None and not done[0].query()
        if done is not None:
            # kvpackd answered once its last kernel was queued behind `done`: what follows on this
            # stream (reading `out`, reusing q, k, v's memory) waits for it on the GPU, not here.
            stream.wait_event(done[0])
        # Otherwise kvpackd synchronised its stream before answering: `out` holds the result.
        out = out.view(b, n, h, d).to(q.dtype)
        self.last_split = {"before": t1 - t0, "rpc": t2 - t1, "after": time.perf_counter() - t2}
        return out

    def _done_event(self, device, stream):
        """(event, IPC handle) of an event of this thread's for the daemon to record after its last
        kernel (header.cuda_done_event), or None where the daemon cannot (then it answers after
        its kernels). One per thread and device: a thread's calls are sequential and each call's
        wait is queued on the stream before the next call's record."""
        if not (self.use_done_events and self.regions.daemon_signals_events):
            return None
        events = getattr(self._events, "done_by_device", None)
        if events is None:
            events = self._events.done_by_device = {}
        entry = events.get(device.index)
        if entry is None:
            event = torch.cuda.Event(interprocess=True)     # timing off, as IPC requires
            event.record(stream)                             # creates it on this device
            entry = events[device.index] = (event, bytes(event.ipc_handle()))
        return entry

    def _caller_event(self, device, stream):
        """The IPC handle of an event recorded now on the current stream — after the work that
        writes q, k, v and allocates the output — for the daemon to wait for (header.
        cuda_wait_event), or None where the daemon cannot (then the caller synchronises). One
        event per thread and device, re-recorded each call: a thread's calls are sequential, so
        the daemon never waits for another call's record."""
        if not (self.use_events and self.regions.daemon_waits_on_events):
            return None
        events = getattr(self._events, "by_device", None)
        if events is None:
            events = self._events.by_device = {}
        entry = events.get(device.index)
        if entry is None:
            entry = [torch.cuda.Event(interprocess=True), None]   # timing off, as IPC requires
            events[device.index] = entry
        entry[0].record(stream)
        if entry[1] is None:
            entry[1] = bytes(entry[0].ipc_handle())       # exists once the event was recorded
        return entry[1]
