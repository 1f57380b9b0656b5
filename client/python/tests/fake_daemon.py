"""An in-process kvpack.v1 server for the client tests: real gRPC over loopback, the layer
computed by kvpack.reference (unquantized), tensors inline or in POSIX shared memory. It checks
what the real daemon checks at the wire (token, chunk coverage, sizes) and nothing more."""

import concurrent.futures
import itertools
import mmap
import os
import threading
import time

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvpack import reference, tensors
from kvpack.v1 import kvpack_pb2 as pb
from kvpack.v1 import kvpack_pb2_grpc as pb_grpc

ROPE = {pb.RopeOptions.LAYOUT_NONE: reference.ROPE_NONE,
        pb.RopeOptions.LAYOUT_INTERLEAVED: reference.ROPE_INTERLEAVED,
        pb.RopeOptions.LAYOUT_SPLIT_HALVES: reference.ROPE_SPLIT_HALVES}
OUT_CHUNK = 1000          # small, so even test layers come back in several chunks


class FakeKvpack(pb_grpc.KvpackServicer):
    def __init__(self, token=None, budget_bytes=1 << 30):
        self.token = token
        self.budget_bytes = budget_bytes
        self.weights, self.kv, self.regions = {}, {}, {}
        self.tenants = []
        self.delay_s = 0.0
        self.unary_regions = True
        self.unary_calls = []       # *Regions methods called, in order
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # ── helpers ─────────────────────────────────────────────────────────────────────────────

    def _admit(self, context):
        md = dict(context.invocation_metadata())
        if self.token and md.get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        self.tenants.append(md.get("x-kvpack-tenant", "default"))

    def _id(self, prefix):
        return f"{prefix}-{next(self._ids):08x}"

    def _read(self, ref, inline, tensor_id, dtype, shape, context, name):
        """A tensor from its TensorRef: inline chunks or a region slice."""
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if ref.WhichOneof("location") == "inline_bytes":
            if ref.inline_bytes != size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{name}: inline_bytes {ref.inline_bytes} != {size}")
            buf = inline.get(tensor_id, b"")
            if len(buf) != size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{name}: chunks cover {len(buf)} of {size} bytes")
            return np.frombuffer(bytes(buf), dtype=dtype).reshape(shape)
        s = ref.region
        region = self.regions.get(s.region_id)
        if region is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{name}: unknown region")
        if s.size_bytes != size or s.offset + size > len(region["map"]):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: region slice out of bounds")
        return np.frombuffer(region["map"], dtype=dtype, count=int(np.prod(shape)),
                             offset=s.offset).reshape(shape)

    @staticmethod
    def _gather(requests):
        header, inline = None, {}
        for r in requests:
            if r.HasField("header"):
                header = r.header
            else:
                c = r.chunk
                buf = inline.setdefault(c.tensor, bytearray())
                if len(buf) < c.offset + len(c.data):
                    buf.extend(b"\0" * (c.offset + len(c.data) - len(buf)))
                buf[c.offset:c.offset + len(c.data)] = c.data
        return header, inline

    # ── weights ─────────────────────────────────────────────────────────────────────────────

    def RegisterWeights(self, request_iterator, context):
        self._admit(context)
        h, inline = self._gather(request_iterator)
        hd = h.n_heads * h.head_dim
        w = {"w": self._read(h.w_qkv, inline, pb.TENSOR_W_QKV, "<u2", (3 * hd, h.hidden),
                             context, "w_qkv")}
        for key, ref, tid in (("bias", h.bias, pb.TENSOR_BIAS),
                              ("q_norm", h.q_norm_weight, pb.TENSOR_Q_NORM_WEIGHT),
                              ("k_norm", h.k_norm_weight, pb.TENSOR_K_NORM_WEIGHT)):
            if ref.WhichOneof("location"):
                n = 3 * hd if key == "bias" else ref.inline_bytes // 4 or ref.region.size_bytes // 4
                w[key] = self._read(ref, inline, tid, "<f4", (n,), context, key)
        handle = self._id("w")
        self.weights[handle] = w
        return pb.WeightsResponse(handle=handle, pool_bytes=w["w"].nbytes, lease_seconds=600)

    def ReleaseWeights(self, request, context):
        self._admit(context)
        if self.weights.pop(request.handle, None) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown weights handle")
        return pb.ReleaseResponse()

    # ── layers ──────────────────────────────────────────────────────────────────────────────

    def _layer(self, request_iterator, context, method):
        self._admit(context)
        h, inline = self._gather(request_iterator)
        if self.delay_s:
            time.sleep(self.delay_s)
        w = self.weights.get(h.weights_handle)
        if w is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "weights_handle: unknown handle")
        s = h.shape
        need = s.n_tokens * 3 * s.n_heads * s.head_dim * 2
        if need > self.budget_bytes:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"floor plan needs {need} bytes, budget {self.budget_bytes}")
        x = self._read(h.x, inline, pb.TENSOR_X, "<u2", (s.n_tokens, s.hidden), context, "x")
        rope = h.options.rope
        pos = None
        if rope.layout != pb.RopeOptions.LAYOUT_NONE:
            pos = self._read(h.positions, inline, pb.TENSOR_POSITIONS, "<f4",
                             (s.n_tokens, len(rope.axis_dims)), context, "positions")
        seq = reference.seq_ids_from_ranges([(r.begin, r.end, r.seq_id) for r in h.ranges],
                                            s.n_tokens)
        out = reference.attention_layer(
            tensors.from_bf16_bits(x), tensors.from_bf16_bits(w["w"]), s.n_heads, s.head_dim,
            bias=w.get("bias"), q_norm_weight=w.get("q_norm") if h.options.qk_norm.enabled else None,
            k_norm_weight=w.get("k_norm"), eps=h.options.qk_norm.eps or 1e-6, positions=pos,
            rope_layout=ROPE[rope.layout], axis_dims=list(rope.axis_dims),
            theta=rope.theta or 10000.0, seq_ids=seq, causal=h.options.attention.causal,
            softmax_scale=h.options.attention.softmax_scale)
        bits = tensors.to_bf16_bits(out)
        result = pb.LayerResult(peak_bytes=need)
        result.plan.predicted_peak_bytes = need
        for r in h.ranges:
            result.plan.ranges.add(format=r.allowed_formats[0] if r.allowed_formats
                                   else pb.FORMAT_INT4, tokens=r.end - r.begin)
        if h.keep_kv or method == "Project":
            result.kv_handle = self._id("kv")
            self.kv[result.kv_handle] = bits
        mode = pb.OUTPUT_NONE if method == "Project" else h.output.mode
        if mode == pb.OUTPUT_REGION:
            region = self.regions[h.output.region.region_id]
            off = h.output.region.offset
            region["map"][off:off + bits.nbytes] = bits.tobytes()
        if mode == pb.OUTPUT_INLINE:
            result.output_bytes = bits.nbytes
        yield pb.LayerResponse(result=result)
        if mode == pb.OUTPUT_INLINE:
            # Out of order on purpose: the client must place chunks by offset.
            pieces = list(tensors.chunks(bits, OUT_CHUNK))
            for offset, data in pieces[1:] + pieces[:1]:
                yield pb.LayerResponse(chunk=pb.TensorChunk(tensor=pb.TENSOR_OUTPUT,
                                                            offset=offset, data=data))

    def AttentionLayer(self, request_iterator, context):
        yield from self._layer(request_iterator, context, "AttentionLayer")

    def Project(self, request_iterator, context):
        yield from self._layer(request_iterator, context, "Project")

    def Attend(self, request_iterator, context):
        yield from self._layer(request_iterator, context, "Attend")

    def _regions(self, header, context, method):
        """The unary *Regions form: the stream's work on a header alone; inline tensors and an
        inline output refused naming the field, as kvpackd does. `unary_regions = False` answers
        as a daemon from before these methods (UNIMPLEMENTED with no message)."""
        if not self.unary_regions:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "")
        self.unary_calls.append(method + "Regions")
        for name in ("x", "positions"):
            if getattr(header, name).WhichOneof("location") == "inline_bytes":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"header.{name}.inline_bytes: {method}Regions takes tensors in "
                              "regions only")
        if method != "Project" and header.output.mode == pb.OUTPUT_INLINE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"header.output.mode: {method}Regions writes into a region")
        return next(self._layer(iter([pb.LayerRequest(header=header)]), context, method)).result

    def AttentionLayerRegions(self, request, context):
        return self._regions(request, context, "AttentionLayer")

    def ProjectRegions(self, request, context):
        return self._regions(request, context, "Project")

    def AttendRegions(self, request, context):
        return self._regions(request, context, "Attend")

    def ReleaseKv(self, request, context):
        self._admit(context)
        if self.kv.pop(request.handle, None) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown K/V handle")
        return pb.ReleaseResponse()

    # ── plan, status, regions ───────────────────────────────────────────────────────────────

    def Plan(self, request, context):
        self._admit(context)
        s = request.header.shape
        need = s.n_tokens * 3 * s.n_heads * s.head_dim * 2
        r = pb.PlanResponse(fits=need <= self.budget_bytes)
        r.plan.predicted_peak_bytes = need
        if not r.fits:
            r.reason = f"needs {need} bytes, budget {self.budget_bytes}"
        return r

    def Status(self, request, context):
        self._admit(context)
        return pb.StatusResponse(version="fake", backend="cpu", budget_bytes=self.budget_bytes,
                                 weights_handles=len(self.weights), kv_handles=len(self.kv),
                                 shm_regions=len(self.regions), serving=True)

    def RegisterRegion(self, request, context):
        self._admit(context)
        if request.kind != pb.REGION_SHM:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "CUDA IPC needs the CUDA backend")
        path = "/dev/shm/" + request.shm_name.lstrip("/")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, f"shm_name: {e.strerror}")
        try:
            m = mmap.mmap(fd, request.size_bytes)
        finally:
            os.close(fd)
        region_id = self._id("r")
        self.regions[region_id] = {"map": m, "name": request.shm_name}
        return pb.RegisterRegionResponse(region_id=region_id, lease_seconds=600)

    def UnregisterRegion(self, request, context):
        self._admit(context)
        region = self.regions.pop(request.region_id, None)
        if region is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown region")
        region["map"].close()
        return pb.UnregisterRegionResponse()

    def RegionStatus(self, request, context):
        self._admit(context)
        ids = [request.region_id] if request.region_id else list(self.regions)
        return pb.RegionStatusResponse(regions=[
            pb.RegionInfo(region_id=i, kind=pb.REGION_SHM, shm_name=self.regions[i]["name"],
                          size_bytes=len(self.regions[i]["map"])) for i in ids if i in self.regions])

    def KeepAlive(self, request, context):
        self._admit(context)
        known = set(self.weights) | set(self.kv) | set(self.regions)
        return pb.KeepAliveResponse(renewed=sum(i in known for i in request.ids),
                                    lease_seconds=600)


class FakeDaemon:
    """`with FakeDaemon() as d: kvpack.Client(d.target)`."""

    def __init__(self, **kwargs):
        self.service = FakeKvpack(**kwargs)
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_KvpackServicer_to_server(self.service, self.server)
        self.health = health.HealthServicer()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(grace=None).wait()
