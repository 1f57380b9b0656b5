"""kvpack.Client: typed wrappers for every kvpack.v1 RPC.

    with kvpack.Client("unix:///run/kvpackd/kvpackd.sock") as c:
        w = c.register_weights(w_bits, n_heads=24, head_dim=128)
        out = c.attention_layer(x_bits, w, n_heads=24, head_dim=128,
                                ranges=[kvpack.Range(0, n, 0, ("int8", "int4"))])
        out.output            # numpy uint16 (bf16 bits) [N, H·d]; out.result: plan, peak, times

Every call has a deadline (`timeout` per call, else the client's default). A failed call raises a
kvpack.KvpackError subclass carrying the gRPC code and the daemon's message. Tensors are numpy
arrays (bf16 as uint16 bits, see kvpack.tensors) sent inline in 1 MiB chunks, or RegionSlice
references into registered shared-memory / CUDA IPC regions.

Thread-safe: one Client (one channel) may serve several threads.
"""

import os
import threading

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpack import _gen, tensors
from kvpack.errors import KvpackError, Unavailable, from_rpc_error
from kvpack.types import LayerOptions, LayerOutput, RegionSlice, Weights

_gen.ensure()
from kvpack.v1 import kvpack_pb2 as pb  # noqa: E402
from kvpack.v1 import kvpack_pb2_grpc as pb_grpc  # noqa: E402
from kvpack import lane as kvpack_lane  # noqa: E402

DEFAULT_TARGET = "unix:///run/kvpackd/kvpackd.sock"
DEFAULT_TIMEOUT_S = 120.0   # a 152k-token layer takes seconds; a queue of them longer
_MAX_TEMPLATES = 64      # distinct call shapes whose headers are kept (cleared when full)
_FORMAT = {"int4": pb.FORMAT_INT4, "int8": pb.FORMAT_INT8, "bf16": pb.FORMAT_BF16}
_FORMAT_NAME = {v: k for k, v in _FORMAT.items()}
_ROPE = {"interleaved": pb.RopeOptions.LAYOUT_INTERLEAVED,
         "split_halves": pb.RopeOptions.LAYOUT_SPLIT_HALVES}
_MMA = {"auto": pb.AttentionOptions.MMA_AUTO, "bf16": pb.AttentionOptions.MMA_BF16,
        "int8": pb.AttentionOptions.MMA_INT8}


def format_name(value):
    """'int4' | 'int8' | 'bf16' for a kvpack.v1.Format value."""
    return _FORMAT_NAME.get(value, "unspecified")


class Client:
    """A connection to one kvpackd. `target`: "unix:///path.sock" or "host:port". `token`: the
    bearer token (needed beyond loopback); `tenant`: sent as x-kvpack-tenant. `credentials`:
    grpc.ssl_channel_credentials(...) for TLS, else plaintext."""

    def __init__(self, target=DEFAULT_TARGET, *, token=None, tenant=None,
                 timeout=DEFAULT_TIMEOUT_S, credentials=None, channel_options=(),
                 chunk_bytes=tensors.CHUNK_BYTES, lane=False):
        opts = [("grpc.max_receive_message_length", 8 << 20)] + list(channel_options)
        self._channel = (grpc.secure_channel(target, credentials, options=opts) if credentials
                         else grpc.insecure_channel(target, options=opts))
        self._stub = pb_grpc.KvpackStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.target = target
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        # Layer calls with every tensor in a region go over the unary *Regions methods (one
        # message each way); False after a daemon answered UNIMPLEMENTED (older than them).
        self.unary_layers = True
        self._templates = {}        # headers of region-only projected calls, by call shape
        self.last_layer_method = None   # the RPC of the last layer call ("AttentionLayerRegions")
        # lane=True: region-only layer calls go through a lane (kvpack.lane) when the daemon
        # opens one (same host); False after it could not (another host, lanes off or full).
        self.lane_wanted = lane
        self.lane = None
        self._lane_lock = threading.Lock()     # one thread opens a lane; calls queue on it
        self.lane_error = None          # why no lane could be opened
        self._metadata = []
        if token:
            self._metadata.append(("authorization", f"Bearer {token}"))
        if tenant:
            self._metadata.append(("x-kvpack-tenant", tenant))

    @classmethod
    def from_env(cls, **kwargs):
        """A client configured by the environment, as a pod or a service unit sets it:
        KVPACK_TARGET (default the local socket), KVPACK_TOKEN or KVPACK_TOKEN_FILE (the first
        word of its first line, the daemon's "TOKEN [TENANT]" format), KVPACK_TENANT,
        KVPACK_LANE=1 (layer calls through a lane when the daemon is on this host).
        Keyword arguments override."""
        token = os.environ.get("KVPACK_TOKEN")
        if not token and os.environ.get("KVPACK_TOKEN_FILE"):
            with open(os.environ["KVPACK_TOKEN_FILE"]) as f:
                words = f.readline().split()
            token = words[0] if words else None
        settings = dict(target=os.environ.get("KVPACK_TARGET", DEFAULT_TARGET), token=token,
                        tenant=os.environ.get("KVPACK_TENANT"),
                        lane=os.environ.get("KVPACK_LANE", "") not in ("", "0"))
        settings.update(kwargs)
        return cls(settings.pop("target"), **settings)

    # ── plumbing ────────────────────────────────────────────────────────────────────────────

    def close(self):
        if self.lane is not None:
            self.lane.close(timeout=5.0)
            self.lane = None
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _deadline(self, timeout):
        return self.timeout if timeout is None else timeout

    def _unary(self, method, request, timeout):
        try:
            return getattr(self._stub, method)(request, timeout=self._deadline(timeout),
                                               metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, method) from None

    def _chunks(self, tensor_id, array, wrap):
        for offset, data in tensors.chunks(array, self.chunk_bytes):
            yield wrap(chunk=pb.TensorChunk(tensor=tensor_id, offset=offset, data=data))

    def _ref(self, value, tensor_id, dtype, inline):
        """TensorRef for an input; inline arrays are queued in `inline` to follow the header."""
        if value is None:
            return None
        if isinstance(value, RegionSlice):
            return pb.TensorRef(region=pb.RegionSlice(region_id=value.region_id,
                                                      offset=value.offset,
                                                      size_bytes=value.size_bytes))
        array = tensors.as_wire(value, dtype)
        inline.append((tensor_id, array))
        return pb.TensorRef(inline_bytes=array.nbytes)

    # ── health ──────────────────────────────────────────────────────────────────────────────

    def health(self, service="", timeout=5.0):
        """grpc.health.v1 status name: 'SERVING', 'NOT_SERVING', ..."""
        try:
            r = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                   timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "Health.Check") from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def wait_ready(self, timeout=30.0):
        """Blocks until the channel connects; raises Unavailable after `timeout` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                              f"no connection to {self.target} within {timeout} s", "connect") from None

    # ── weights ─────────────────────────────────────────────────────────────────────────────

    def register_weights(self, w_qkv, *, n_heads, head_dim, bias=None, q_norm_weight=None,
                         k_norm_weight=None, hidden=None, timeout=None):
        """Uploads a layer's QKV weight: w_qkv bf16 [3·H·d, D] (rows q | k | v, nn.Linear
        layout; or a RegionSlice, then with `hidden`), bias f32 [3·H·d], q/k norm weights f32
        [d] or [H·d]. Returns Weights (handle, pool bytes, lease)."""
        inline = []
        if isinstance(w_qkv, RegionSlice):
            if hidden is None:
                raise ValueError("a weight in a region needs hidden")
            w = w_qkv
        else:
            w = tensors.as_wire(w_qkv, "bf16")
            hidden = w.shape[1]
        header = pb.WeightsHeader(
            hidden=hidden, n_heads=n_heads, head_dim=head_dim,
            w_qkv=self._ref(w, pb.TENSOR_W_QKV, "bf16", inline),
            bias=self._ref(bias, pb.TENSOR_BIAS, "f32", inline),
            q_norm_weight=self._ref(q_norm_weight, pb.TENSOR_Q_NORM_WEIGHT, "f32", inline),
            k_norm_weight=self._ref(k_norm_weight, pb.TENSOR_K_NORM_WEIGHT, "f32", inline))

        def requests():
            yield pb.WeightsRequest(header=header)
            for tensor_id, array in inline:
                yield from self._chunks(tensor_id, array, pb.WeightsRequest)

        try:
            r = self._stub.RegisterWeights(requests(), timeout=self._deadline(timeout),
                                           metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "RegisterWeights") from None
        return Weights(r.handle, r.pool_bytes, r.lease_seconds)

    def release_weights(self, weights, timeout=None):
        self._unary("ReleaseWeights", pb.ReleaseRequest(handle=_handle(weights)), timeout)

    # ── layers ──────────────────────────────────────────────────────────────────────────────

    def layer_header(self, *, n_tokens, hidden, n_heads, head_dim, ranges, weights=None,
                     options=LayerOptions(), keep_kv=False, kv_handle="", priority=0):
        """The LayerHeader for a layer (without tensor references): also what plan() sends."""
        o = pb.LayerOptions()
        if options.rope is not None:
            o.rope.layout = _ROPE[options.rope.layout]
            o.rope.theta = options.rope.theta
            o.rope.axis_dims.extend(options.rope.axis_dims)
        if options.qk_norm_eps is not None:
            o.qk_norm.enabled = True
            o.qk_norm.eps = options.qk_norm_eps
        o.attention.causal = options.causal
        o.attention.softmax_scale = options.softmax_scale
        o.attention.mma = _MMA[options.mma]
        if options.sparse is not None:
            s = options.sparse
            if s.rel_tau is not None:
                o.attention.sparse.rel_tau = s.rel_tau
            else:
                o.attention.sparse.topk_ratio = 0.2 if s.topk_ratio is None else s.topk_ratio
            o.attention.sparse.tail = s.tail
            o.attention.sparse.sink_pages = s.sink_pages
            o.attention.sparse.min_exact_pages = s.min_exact_pages
        return pb.LayerHeader(
            shape=pb.LayerShape(n_tokens=n_tokens, hidden=hidden, n_heads=n_heads,
                                head_dim=head_dim),
            ranges=[pb.TokenRange(begin=r.begin, end=r.end, seq_id=r.seq_id,
                                  allowed_formats=[_FORMAT[f] for f in r.formats],
                                  always_attend=r.always_attend, attend_densely=r.attend_densely)
                    for r in ranges],
            options=o, weights_handle=_handle(weights) if weights is not None else "",
            keep_kv=keep_kv, kv_handle=kv_handle, priority=priority)

    def _layer(self, method, x, weights, *, n_heads, head_dim, ranges, positions, options,
               keep_kv, kv_handle, priority, output, timeout, n_tokens=None, hidden=None):
        if isinstance(x, RegionSlice):
            if n_tokens is None or hidden is None:
                raise ValueError("x in a region needs n_tokens and hidden")
        else:
            x = tensors.as_wire(x, "bf16")
            n_tokens, hidden = x.shape
        header = self.layer_header(n_tokens=n_tokens, hidden=hidden, n_heads=n_heads,
                                   head_dim=head_dim, ranges=ranges, weights=weights,
                                   options=options, keep_kv=keep_kv, kv_handle=kv_handle,
                                   priority=priority)
        inline = []
        header.x.CopyFrom(self._ref(x, pb.TENSOR_X, "bf16", inline))
        if positions is not None:
            header.positions.CopyFrom(self._ref(positions, pb.TENSOR_POSITIONS, "f32", inline))
        return self._stream_layer(method, header, inline, n_tokens, output, timeout)

    def _stream_layer(self, method, header, inline, n_tokens, output, timeout):
        """Sets the output of `header` and runs the call: over the unary <method>Regions when no
        tensor travels inline (every input and the output in regions), else streams the header
        and the inline tensors and collects the result and the inline output."""
        self._set_output(method, header, output)
        if not inline and self.unary_layers and \
                (method == "Project" or header.output.mode != pb.OUTPUT_INLINE):
            result = self._lane_call(method, header, timeout)
            if result is not None:
                self.last_layer_method = method + "Lane"
                return LayerOutput(None, result)
            try:
                result = self._unary(method + "Regions", header, timeout)
                self.last_layer_method = method + "Regions"
                return LayerOutput(None, result)
            except KvpackError as e:
                # gRPC answers a method the server lacks UNIMPLEMENTED with no message; the
                # daemon's own UNIMPLEMENTED answers name a field.
                if e.code != grpc.StatusCode.UNIMPLEMENTED or e.details:
                    raise
                self.unary_layers = False   # a daemon from before the unary calls: stream
        self.last_layer_method = method
        return self._streamed(method, header, inline, n_tokens, timeout)

    def _lane_call(self, method, header, timeout):
        """The call through the lane (opened on first use); None when there is none or the
        header does not fit it, so the caller sends it over gRPC."""
        if not self.lane_wanted:
            return None
        for _ in range(2):          # a lane the daemon closed (idle, drained) is opened again once
            with self._lane_lock:
                lane = self.lane
                if lane is None or lane.closed:
                    if lane is not None:
                        lane.close(timeout=5.0)
                    try:
                        lane = self.lane = kvpack_lane.Lane(self, timeout=self._deadline(timeout))
                    except KvpackError as e:
                        # UNIMPLEMENTED (an older daemon), NOT_FOUND (the object is not on the
                        # daemon's host), RESOURCE_EXHAUSTED (lanes off or all taken): use gRPC.
                        self.lane_wanted, self.lane_error, self.lane = False, e, None
                        return None
            try:
                return lane.call(method, header, self._deadline(timeout))
            except kvpack_lane.LaneClosed:
                pass
        return None

    @staticmethod
    def _set_output(method, header, output):
        if method == "Project":
            header.output.mode = pb.OUTPUT_NONE
        elif isinstance(output, RegionSlice):
            header.output.mode = pb.OUTPUT_REGION
            _set_slice(header.output.region, output)
        elif output == "in_place":
            header.output.mode = pb.OUTPUT_IN_PLACE
        elif output not in (None, "inline"):
            raise ValueError("output must be None, 'inline', 'in_place' or a RegionSlice")

    def _streamed(self, method, header, inline, n_tokens, timeout):
        def requests():
            yield pb.LayerRequest(header=header)
            for tensor_id, array in inline:
                yield from self._chunks(tensor_id, array, pb.LayerRequest)

        result, buf, got = None, None, 0
        try:
            for r in getattr(self._stub, method)(requests(), timeout=self._deadline(timeout),
                                                 metadata=self._metadata):
                if r.HasField("result"):
                    result = r.result
                    buf = bytearray(result.output_bytes)
                elif r.HasField("chunk"):
                    c = r.chunk
                    if buf is None or c.offset + len(c.data) > len(buf):
                        raise KvpackError(grpc.StatusCode.INTERNAL,
                                          "output chunk outside the announced output", method)
                    buf[c.offset:c.offset + len(c.data)] = c.data
                    got += len(c.data)
        except grpc.RpcError as e:
            raise from_rpc_error(e, method) from None
        if result is None:
            raise KvpackError(grpc.StatusCode.INTERNAL, "the stream ended without a result",
                              method)
        if got != len(buf):
            raise KvpackError(grpc.StatusCode.INTERNAL,
                              f"received {got} of {len(buf)} output bytes", method)
        out = None
        if len(buf):
            out = np.frombuffer(bytes(buf), dtype="<u2").reshape(n_tokens, -1)
        return LayerOutput(out, result)

    def attention_layer(self, x, weights, *, n_heads, head_dim, ranges, positions=None,
                        options=LayerOptions(), keep_kv=False, priority=0, output=None,
                        timeout=None, n_tokens=None, hidden=None):
        """One attention layer: x bf16 [N, D] (uint16 bits or floats, or a RegionSlice with
        n_tokens and hidden), the weights from register_weights, ranges tiling [0, N),
        positions f32 [N, axes] with RoPE. output: None (inline, returned), "in_place", or a
        RegionSlice. Returns LayerOutput(output bits [N, H·d] or None, LayerResult)."""
        return self._layer("AttentionLayer", x, weights, n_heads=n_heads, head_dim=head_dim,
                           ranges=ranges, positions=positions, options=options,
                           keep_kv=keep_kv, kv_handle="", priority=priority, output=output,
                           timeout=timeout, n_tokens=n_tokens, hidden=hidden)

    def project(self, x, weights, *, n_heads, head_dim, ranges, positions=None,
                options=LayerOptions(), priority=0, timeout=None, n_tokens=None, hidden=None):
        """Packs K/V of x and keeps it; returns LayerOutput(None, result) with
        result.kv_handle for attend() and release_kv()."""
        return self._layer("Project", x, weights, n_heads=n_heads, head_dim=head_dim,
                           ranges=ranges, positions=positions, options=options, keep_kv=True,
                           kv_handle="", priority=priority, output=None, timeout=timeout,
                           n_tokens=n_tokens, hidden=hidden)

    def attend(self, x, weights, kv_handle, *, n_heads, head_dim, ranges, positions=None,
               options=LayerOptions(), priority=0, output=None, timeout=None, n_tokens=None,
               hidden=None):
        """Attention over a kept K/V handle (from project() or keep_kv) for the same tokens."""
        return self._layer("Attend", x, weights, n_heads=n_heads, head_dim=head_dim,
                           ranges=ranges, positions=positions, options=options, keep_kv=False,
                           kv_handle=kv_handle, priority=priority, output=output,
                           timeout=timeout, n_tokens=n_tokens, hidden=hidden)

    def attention_projected(self, q, k, v, *, n_heads, head_dim, ranges, layout="token_major",
                            row_stride=0, batch=0, n_tokens=None, options=LayerOptions(),
                            keep_kv=False, priority=0, output=None, timeout=None,
                            cuda_wait_event=None, cuda_done_event=None):
        """Attention over q, k, v already projected (and normed / roped: options.rope and
        qk_norm must be unset), no weights. layout "token_major": element (t, h, c) at
        t·row_stride + h·d + c (arrays: any shape [..., H·d] or [..., H, d], sent compact);
        "head_major": [B, H, N/B, d] contiguous, `batch` = B (arrays: their shape gives it).
        q, k, v are bf16 arrays (uint16 bits or floats) or RegionSlices (then n_tokens, and the
        layout's row_stride / batch, are needed). cuda_wait_event: the 64-byte IPC handle of an
        event the caller recorded after writing tensors in CUDA IPC regions; the daemon waits for
        it instead of the caller synchronising (only where Status.cuda_wait_event is true).
        cuda_done_event: the 64-byte IPC handle of an event of the caller's that the daemon
        records after its last kernel and answers before that kernel finishes; the caller's
        stream must wait for it before reading the output (only where Status.cuda_done_event).
        Returns LayerOutput(output [N, H·d], result)."""
        header, inline, n_tokens = self._projected_header(
            q, k, v, n_heads=n_heads, head_dim=head_dim, ranges=ranges, layout=layout,
            row_stride=row_stride, batch=batch, n_tokens=n_tokens, options=options,
            keep_kv=keep_kv, priority=priority, cuda_wait_event=cuda_wait_event)
        if cuda_done_event is not None:
            header.cuda_done_event = bytes(cuda_done_event)
        return self._stream_layer("AttentionLayer", header, inline, n_tokens, output, timeout)

    def _projected_header(self, q, k, v, *, n_heads, head_dim, ranges, layout, row_stride,
                          batch, n_tokens, options, keep_kv, priority, cuda_wait_event):
        """attention_projected's header, inline tensors and token count."""
        if n_tokens is not None and all(isinstance(t, RegionSlice) for t in (q, k, v)):
            # The region path (kvpack.torch over CUDA IPC) runs once per attention call with the
            # same shape, ranges and options: the header is built once and copied.
            key = (n_heads, head_dim, tuple(ranges), layout, row_stride, batch, n_tokens,
                   options, keep_kv, priority)
            try:
                template = self._templates.get(key)
            except TypeError:       # unhashable arguments (a list of formats): no template
                key, template = None, None
            if template is None:
                template, _, _ = self._projected_header(
                    None, None, None, n_heads=n_heads, head_dim=head_dim, ranges=ranges,
                    layout=layout, row_stride=row_stride, batch=batch, n_tokens=n_tokens,
                    options=options, keep_kv=keep_kv, priority=priority, cuda_wait_event=None)
                if key is not None:
                    if len(self._templates) >= _MAX_TEMPLATES:
                        self._templates.clear()
                    self._templates[key] = template
            header = pb.LayerHeader()
            header.CopyFrom(template)
            p = header.projected
            for ref, t in ((p.q, q), (p.k, k), (p.v, v)):
                _set_slice(ref.region, t)
            if cuda_wait_event is not None:
                header.cuda_wait_event = bytes(cuda_wait_event)
            return header, [], n_tokens
        hd = n_heads * head_dim
        refs, inline = [], []
        for name, t, tid in (("q", q, pb.TENSOR_Q), ("k", k, pb.TENSOR_K), ("v", v, pb.TENSOR_V)):
            if t is None:           # a template: the caller fills the references
                refs.append(None)
                continue
            if isinstance(t, RegionSlice):
                if n_tokens is None:
                    raise ValueError(f"{name} in a region needs n_tokens")
                refs.append(self._ref(t, tid, "bf16", inline))
                continue
            a = tensors.as_wire(t, "bf16")
            if layout == "head_major":
                if a.ndim != 4 or a.shape[1] != n_heads or a.shape[3] != head_dim:
                    raise ValueError(f"{name}: head-major wants [B, {n_heads}, N/B, {head_dim}], got {a.shape}")
                batch, n = a.shape[0], a.shape[0] * a.shape[2]
            else:
                a = a.reshape(-1, hd)
                n, row_stride = a.shape[0], 0
            if n_tokens is not None and n != n_tokens:
                raise ValueError(f"{name} holds {n} tokens, expected {n_tokens}")
            n_tokens = n
            refs.append(self._ref(a, tid, "bf16", inline))
        header = self.layer_header(n_tokens=n_tokens, hidden=0, n_heads=n_heads,
                                   head_dim=head_dim, ranges=ranges, options=options,
                                   keep_kv=keep_kv, priority=priority)
        p = header.projected
        p.layout = (pb.ProjectedQkv.LAYOUT_HEAD_MAJOR if layout == "head_major"
                    else pb.ProjectedQkv.LAYOUT_TOKEN_MAJOR)
        p.row_stride = row_stride if layout != "head_major" else 0
        p.batch = batch if layout == "head_major" else 0
        for ref, r in ((p.q, refs[0]), (p.k, refs[1]), (p.v, refs[2])):
            if r is not None:
                ref.CopyFrom(r)
        if cuda_wait_event is not None:
            header.cuda_wait_event = bytes(cuda_wait_event)
        return header, inline, n_tokens

    def release_kv(self, kv_handle, timeout=None):
        self._unary("ReleaseKv", pb.ReleaseRequest(handle=kv_handle), timeout)

    # ── planning and status ─────────────────────────────────────────────────────────────────

    def plan(self, *, n_tokens, hidden, n_heads, head_dim, ranges, weights=None, has_bias=False,
             qk_norm_weight_len=0, options=LayerOptions(), timeout=None):
        """Dry run: PlanResponse(fits, plan, reason) — formats, chunks, predicted peak bytes."""
        header = self.layer_header(n_tokens=n_tokens, hidden=hidden, n_heads=n_heads,
                                   head_dim=head_dim, ranges=ranges, weights=weights,
                                   options=options)
        if qk_norm_weight_len:
            header.options.qk_norm.weight_len = qk_norm_weight_len
        return self._unary("Plan", pb.PlanRequest(header=header, has_bias=has_bias), timeout)

    def status(self, timeout=None):
        """StatusResponse: budget, pool by state and format, high-water, queue, your tenant, and
        which attention kernel serves on which GPU arch (attention_kernel, compute_capability,
        cuda_archs_built, sm_count)."""
        return self._unary("Status", pb.StatusRequest(), timeout)

    # ── regions ─────────────────────────────────────────────────────────────────────────────

    def register_shm(self, shm_name, size_bytes, timeout=None):
        """Registers a POSIX shared-memory object (shm_open name, e.g. "/kvpack-42"); returns
        the region id."""
        r = self._unary("RegisterRegion", pb.RegisterRegionRequest(
            kind=pb.REGION_SHM, shm_name=shm_name, size_bytes=size_bytes), timeout)
        return r.region_id

    def register_cuda_ipc(self, ipc_handle, size_bytes, device=0, timeout=None):
        """Registers a cudaIpcMemHandle_t (64 bytes) of memory on the daemon's GPU."""
        r = self._unary("RegisterRegion", pb.RegisterRegionRequest(
            kind=pb.REGION_CUDA_IPC, cuda_ipc_handle=bytes(ipc_handle), size_bytes=size_bytes,
            device=device), timeout)
        return r.region_id

    def unregister_region(self, region_id, timeout=None):
        """Waits for the requests using the region, then the daemon unmaps it."""
        self._unary("UnregisterRegion", pb.UnregisterRegionRequest(region_id=region_id),
                    timeout)

    def region_status(self, region_id="", timeout=None):
        return list(self._unary("RegionStatus", pb.RegionStatusRequest(region_id=region_id),
                                timeout).regions)

    def keep_alive(self, ids, timeout=None):
        """Renews the leases of handles and regions; returns how many were found."""
        return self._unary("KeepAlive", pb.KeepAliveRequest(ids=list(ids)), timeout).renewed


def _set_slice(slice_pb, region_slice):
    slice_pb.region_id = region_slice.region_id
    slice_pb.offset = region_slice.offset
    slice_pb.size_bytes = region_slice.size_bytes


def _handle(weights):
    return weights.handle if isinstance(weights, Weights) else str(weights)
