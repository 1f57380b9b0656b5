"""CUDA IPC regions by allocation segment: one registration per cudaMalloc segment, not per tensor.

PyTorch's caching allocator carves tensors out of a few large cudaMalloc segments that it reuses
call after call. A tensor's region is therefore the segment it lives in (its base and size, from
cuPointerGetAttributes), registered with kvpackd once and addressed by offset; q, k, v and the
output of a steady-state attention call name regions that are already registered, so the call
is one RPC and no registration (measured by `registrations`).

Freed memory is never addressed. An entry is keyed by (device, base, size, buffer id): the
driver's buffer id is unique for the life of the process, so a segment freed and another
cudaMalloc'd at the same address (torch.cuda.empty_cache(), then new tensors) is a new key and a
new registration, never the old region. `sweep()` drops the entries whose segment is gone and
unregisters them, and keeps at most `max_segments` entries (least recently used go first);
`maybe_sweep()`, run before each call, does so at most every `sweep_interval_s` (a sweep queries
every entry, one driver call each), so the daemon's mapping of a freed segment outlives it by at
most that long plus the time to the next call. Correctness does not depend on sweeping: the key does.
Regions are scoped to the client's tenant by the daemon; one SegmentRegions serves one client.

The driver is reached through ctypes on libcuda.so.1 (no CUDA toolkit, no torch needed here);
tests pass a stand-in with the same two methods.
"""

import collections
import ctypes
import threading
import time

from kvpack.types import RegionSlice

# CUpointer_attribute values (cuda.h).
_ATTR_CONTEXT = 1
_ATTR_BUFFER_ID = 7
_ATTR_DEVICE_ORDINAL = 9
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_ATTR_RANGE_START_ADDR = 11
_ATTR_RANGE_SIZE = 12
_ATTRS = (_ATTR_CONTEXT, _ATTR_BUFFER_ID, _ATTR_DEVICE_ORDINAL, _ATTR_IS_LEGACY_CUDA_IPC_CAPABLE,
          _ATTR_RANGE_START_ADDR, _ATTR_RANGE_SIZE)
IPC_HANDLE_BYTES = 64   # sizeof(CUipcMemHandle) == sizeof(cudaIpcMemHandle_t)

# A segment: the allocation a pointer lies in. buffer_id 0 means "not device memory (or freed)".
Segment = collections.namedtuple("Segment", "device base size buffer_id ipc_capable context")


class CudaDriver:
    """The libcuda calls the registry needs: the segment of a pointer (one cuPointerGetAttributes,
    a few microseconds, no context needed) and a segment's IPC handle (cuIpcGetMemHandle in the
    segment's own context)."""

    def __init__(self, lib=None):
        self._lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        self._lib.cuInit.argtypes = [ctypes.c_uint]
        self._lib.cuPointerGetAttributes.argtypes = [
            ctypes.c_uint, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_uint64]
        self._lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        self._lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        self._lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._check(self._lib.cuInit(0), "cuInit")
        self._attrs = (ctypes.c_int * len(_ATTRS))(*_ATTRS)
        self._buffers = threading.local()   # per thread: the attribute slots, made once

    @staticmethod
    def _check(result, what):
        if result != 0:
            raise ValueError(f"{what} failed with CUresult {result}")

    def segment(self, ptr):
        # Every attribute into a zeroed 8-byte slot: the narrower ones (int, bool) land in its low
        # bytes (little-endian), and an address that is not (or no longer) device memory reads 0.
        # Four calls per attention call: the slots are made once per thread and zeroed here.
        buffers = getattr(self._buffers, "slots", None)
        if buffers is None:
            values = (ctypes.c_uint64 * len(_ATTRS))()
            slots = (ctypes.c_void_p * len(_ATTRS))(
                *[ctypes.addressof(values) + 8 * i for i in range(len(_ATTRS))])
            buffers = self._buffers.slots = (values, slots)
        values, slots = buffers
        ctypes.memset(values, 0, ctypes.sizeof(values))
        self._check(self._lib.cuPointerGetAttributes(len(_ATTRS), self._attrs, slots, ptr),
                    "cuPointerGetAttributes")
        context, buffer_id, device, ipc, base, size = values
        return Segment(device & 0xFFFFFFFF, base, size, buffer_id, bool(ipc & 0xFF), context)

    def ipc_handle(self, segment):
        handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._check(self._lib.cuCtxPushCurrent_v2(segment.context), "cuCtxPushCurrent")
        try:
            self._check(self._lib.cuIpcGetMemHandle(handle, segment.base), "cuIpcGetMemHandle")
        finally:
            popped = ctypes.c_void_p()
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
        return handle.raw


class SegmentRegions:
    """RegionSlices of device memory through one registration per segment. `device` is the
    daemon's ordinal for the GPU (StatusResponse.device_ordinal). Thread-safe.

    Counters: `registrations` (RegisterRegion calls made), `releases` (UnregisterRegion calls for
    dead or evicted segments)."""

    def __init__(self, client, device, *, driver=None, max_segments=64, sweep_interval_s=0.25,
                 timeout=10.0, clock=time.monotonic):
        self.client = client
        self.device = device
        self.driver = driver if driver is not None else CudaDriver()
        self.max_segments = max_segments
        self.sweep_interval_s = sweep_interval_s
        self.timeout = timeout
        self.clock = clock
        self._last_sweep = None
        self.registrations = 0
        self.releases = 0
        self._lock = threading.Lock()
        self._entries = collections.OrderedDict()   # (device, base, size, buffer_id) -> region id

    def __len__(self):
        return len(self._entries)

    def slice(self, ptr, nbytes):
        """The RegionSlice of `nbytes` device bytes at address `ptr`, registering its segment on
        first use. ValueError when the memory cannot be shared this way (not device memory, not
        from cudaMalloc — e.g. expandable segments — or the bytes cross the segment's end)."""
        seg = self.driver.segment(ptr)
        if seg.buffer_id == 0:
            raise ValueError(f"address {ptr:#x} is not CUDA device memory")
        if not seg.ipc_capable:
            raise ValueError("memory not shareable by cudaIpcGetMemHandle (expandable segments "
                             "or a memory pool allocation?)")
        if ptr + nbytes > seg.base + seg.size:
            raise ValueError(f"{nbytes} bytes at {ptr:#x} cross the end of their segment "
                             f"[{seg.base:#x}, +{seg.size})")
        key = (seg.device, seg.base, seg.size, seg.buffer_id)
        with self._lock:
            region_id = self._entries.get(key)
            if region_id is None:
                region_id = self.client.register_cuda_ipc(
                    self.driver.ipc_handle(seg), seg.size, device=self.device,
                    timeout=self.timeout)
                self.registrations += 1
                self._entries[key] = region_id
            else:
                self._entries.move_to_end(key)
        return RegionSlice(region_id, ptr - seg.base, nbytes)

    def maybe_sweep(self):
        """sweep() unless one ran less than sweep_interval_s ago; returns how many it dropped."""
        now = self.clock()
        if self._last_sweep is not None and now - self._last_sweep < self.sweep_interval_s:
            return 0
        return self.sweep()

    def sweep(self):
        """Unregisters the entries whose segment was freed (its base no longer answers with the
        same buffer id) and the least recently used beyond max_segments; returns how many."""
        with self._lock:
            self._last_sweep = self.clock()
            dead = [k for k in self._entries if not self._alive(k)]
            excess = len(self._entries) - len(dead) - self.max_segments
            if excess > 0:
                dead += [k for k in self._entries if k not in dead][:excess]
            regions = [self._entries.pop(k) for k in dead]
            self.releases += len(regions)
        self._unregister(regions)
        return len(regions)

    def forget_all(self):
        """Drops every entry (after NOT_FOUND: a daemon restart or an expired lease)."""
        with self._lock:
            regions = list(self._entries.values())
            self._entries.clear()
            self.releases += len(regions)
        self._unregister(regions)

    def _alive(self, key):
        device, base, size, buffer_id = key
        seg = self.driver.segment(base)
        return (seg.buffer_id, seg.base, seg.size, seg.device) == (buffer_id, base, size, device)

    def _unregister(self, regions):
        for region_id in regions:
            try:
                self.client.unregister_region(region_id, timeout=self.timeout)
            except Exception:   # noqa: BLE001 - the daemon is gone or forgot it: nothing to undo
                pass
