"""Lanes: the unary layer calls through shared memory instead of a gRPC round trip, for a client
on the daemon's host (proto/kvpack/v1/lane.h is the layout, docs/api.md "Lanes" the protocol).

    client = kvpack.Client(target, lane=True)      # or KVPACK_LANE=1 with Client.from_env()

Between two attention calls both processes sleep through the attention, and waking gRPC's
threads on both sides costs more than the round trip itself (0.88 ms on the H200 host after 18 ms
idle, 0.37 back to back). On a lane the daemon's thread spins on a sequence word for a bounded
window after each answer and this client spins on the answer's word while it waits, so a call
costs microseconds of transport; both sides sleep on a futex after their spin window.

A Lane is one POSIX shared-memory object registered as a region and opened with OpenLane: the
identity (magic, version, area sizes), a client line and a daemon line of u32 words, then the
request area (a serialized LayerHeader) and the answer area (a LayerResult, or an error message).
"""

import ctypes
import platform
import threading
import time
from multiprocessing import shared_memory

import grpc

from kvpack.errors import _BY_CODE, KvpackError
from kvpack.v1 import kvpack_pb2 as pb

MAGIC, VERSION = 0x4E4C564B, 1
# u32 fields: byte offsets (proto/kvpack/v1/lane.h)
_MAGIC, _VERSION, _REQUEST_AREA, _ANSWER_AREA = 0, 4, 8, 12
_REQUEST_SEQ, _METHOD, _REQUEST_BYTES, _TIMEOUT_US, _CANCEL_SEQ = 64, 68, 72, 76, 80
_ANSWER_SEQ, _CODE, _ANSWER_BYTES, _STATE = 128, 132, 136, 140
AREAS_AT = 4096
MIN_AREA, MAX_AREA = 4096, 4 << 20
METHODS = {"AttentionLayer": 0, "Project": 1, "Attend": 2}
STATE_OPEN, STATE_CLOSED = 1, 2

# How long a call spins on its answer before it sleeps on the futex: on a GPU, longer than the
# daemon's share of an attention call at video lengths (it answers before its kernels end); on
# the CPU backend briefly, since the attention runs on the cores a spinning caller would take.
SPIN_S_GPU, SPIN_S_CPU = 0.2, 0.0005
# After its deadline a call is cancelled through cancel_seq and still gets an answer; a daemon
# that does not answer within this much more is taken for gone and the lane is dropped.
CANCEL_GRACE_S = 5.0
# While parked, the client looks at the daemon's state word this often.
_PARK_TICK_S = 0.01

_CODES = {c.value[0]: c for c in grpc.StatusCode}
_SYS_FUTEX = {"x86_64": 202, "AMD64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
# x86 keeps stores in order and loads in order (TSO), which the protocol needs between the
# request bytes and request_seq and between answer_seq and the answer; elsewhere a syscall that
# runs a full barrier (FUTEX_WAKE, linux/futex: smp_mb before it looks for waiters) orders them.
_NEEDS_FENCE = platform.machine() not in ("x86_64", "AMD64", "i686", "i386")
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _futex(address, op, value, timespec=None):
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_long(op),
                  ctypes.c_long(value), timespec, None, ctypes.c_long(0))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class LaneClosed(Exception):
    """The daemon closed the lane before it read the request: safe to send it another way."""


class Lane:
    """One lane of `client`'s tenant. `area_bytes`: the size of each of the request and answer
    areas (headers and results are a few KiB). `spin_s`: how long a call spins on its answer
    before it sleeps on the futex (a core of this process busy meanwhile); None: SPIN_S_GPU
    when the daemon runs on a GPU, else SPIN_S_CPU (on the CPU backend the attention runs on
    this host's cores, and a spinning caller would take one from it). `daemon_spin_us`: the
    daemon's spin window after each answer (0: the daemon's --lane_spin_us, its ceiling).
    Thread-safe: calls go one at a time."""

    def __init__(self, client, *, area_bytes=256 << 10, spin_s=None, daemon_spin_us=0, timeout=None):
        if not MIN_AREA <= area_bytes <= MAX_AREA:
            raise ValueError(f"area_bytes must be in [{MIN_AREA}, {MAX_AREA}]")
        if spin_s is None:          # asked first: nothing to undo when it fails
            gpu = client.status(timeout).backend == "cuda"
            spin_s = SPIN_S_GPU if gpu else SPIN_S_CPU
        self._client = client
        self.area_bytes = area_bytes
        self.spin_s = spin_s
        self.region_id = self.lane_id = None
        self._lock = threading.Lock()
        self._shm = shared_memory.SharedMemory(create=True, size=AREAS_AT + 2 * area_bytes)
        self._words = (ctypes.c_uint32 * (AREAS_AT // 4)).from_buffer(self._shm.buf)
        self._base = ctypes.addressof(self._words)
        for at, value in ((_MAGIC, MAGIC), (_VERSION, VERSION), (_REQUEST_AREA, area_bytes),
                          (_ANSWER_AREA, area_bytes)):
            self._words[at // 4] = value
        self.closed = False
        try:
            self.region_id = client.register_shm("/" + self._shm.name, self._shm.size, timeout)
            opened = client._unary("OpenLane", pb.OpenLaneRequest(
                region_id=self.region_id, spin_us=daemon_spin_us), timeout)
        except BaseException:
            self._release(timeout)
            raise
        self.lane_id = opened.lane_id
        self.daemon_spin_us = opened.spin_us
        self.calls = 0

    # ── the call ─────────────────────────────────────────────────────────────────────────────

    def call(self, method, header, timeout):
        """Runs `method` ("AttentionLayer", "Project", "Attend": their *Regions form) on
        `header`; returns the LayerResult, raises the KvpackError the daemon answered, returns
        None when the header does not fit the request area (send it over gRPC), raises
        LaneClosed when the daemon closed the lane before reading the request."""
        data = header.SerializeToString()
        if len(data) > self.area_bytes:
            return None
        with self._lock:
            if self.closed or self._word(_STATE) != STATE_OPEN:
                self.closed = True
                raise LaneClosed()
            seq = self._send(METHODS[method], data, timeout)
            code, answer = self._wait(seq, timeout, method)
            self.calls += 1
        if code == 0:
            return pb.LayerResult.FromString(answer)
        status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
        raise _BY_CODE.get(status, KvpackError)(status, answer.decode("utf-8", "replace"),
                                                method + "Lane")

    def _send(self, method_value, data, timeout):
        buf = self._shm.buf
        buf[AREAS_AT:AREAS_AT + len(data)] = data
        w = self._words
        w[_METHOD // 4] = method_value
        w[_REQUEST_BYTES // 4] = len(data)
        w[_TIMEOUT_US // 4] = min(max(int(timeout * 1e6), 1), 0xFFFFFFFF) if timeout else 0
        seq = (w[_REQUEST_SEQ // 4] + 1) & 0xFFFFFFFF or 1
        if _NEEDS_FENCE:
            self._wake(_CANCEL_SEQ)
        w[_REQUEST_SEQ // 4] = seq
        self._wake(_REQUEST_SEQ)       # always: a parked daemon thread sleeps on this word
        return seq

    def _wait(self, seq, timeout, method):
        w = self._words
        answer_at = _ANSWER_SEQ // 4
        start = time.perf_counter()
        spin_until = start + self.spin_s
        deadline = start + timeout if timeout else None
        cancelled = False
        while True:
            for _ in range(256):
                if w[answer_at] == seq:
                    if _NEEDS_FENCE:
                        self._wake(_CANCEL_SEQ)
                    n = min(w[_ANSWER_BYTES // 4], self.area_bytes)
                    at = AREAS_AT + self.area_bytes
                    return w[_CODE // 4], bytes(self._shm.buf[at:at + n])
            now = time.perf_counter()
            if w[_STATE // 4] == STATE_CLOSED and w[answer_at] != seq:
                self.closed = True
                raise LaneClosed()
            if deadline is not None and now > deadline:
                if not cancelled:
                    w[_CANCEL_SEQ // 4] = seq      # the daemon stops the call and answers
                    cancelled = True
                elif now > deadline + CANCEL_GRACE_S:
                    self.closed = True
                    raise KvpackError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"no answer on lane {self.lane_id} {CANCEL_GRACE_S:.0f} s "
                                      "after the deadline; the lane is dropped", method + "Lane")
            if now > spin_until:
                self._park(_ANSWER_SEQ, w[answer_at])

    # ── futexes on the shared words ──────────────────────────────────────────────────────────

    def _word(self, at):
        return self._words[at // 4]

    def _wake(self, at):
        if _SYS_FUTEX is not None:
            _futex(self._base + at, _FUTEX_WAKE, 0x7FFFFFFF)

    def _park(self, at, value):
        if _SYS_FUTEX is None:
            time.sleep(1e-4)
            return
        ts = _Timespec(0, int(_PARK_TICK_S * 1e9))
        _futex(self._base + at, _FUTEX_WAIT, value, ctypes.byref(ts))

    # ── lifetime ─────────────────────────────────────────────────────────────────────────────

    def close(self, timeout=None):
        """Closes the lane on the daemon, unregisters the region and frees the object."""
        with self._lock:
            self.closed = True
            if self.lane_id is not None:
                try:
                    self._client._unary("CloseLane", pb.CloseLaneRequest(lane_id=self.lane_id),
                                        timeout)
                except KvpackError:
                    pass        # already closed (idle, drained, daemon restarted)
                self.lane_id = None
            self._release(timeout)

    def _release(self, timeout):
        if self.region_id is not None:
            try:
                self._client.unregister_region(self.region_id, timeout)
            except KvpackError:
                pass
            self.region_id = None
        if self._shm is not None:
            self.__dict__.pop("_words", None)
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    def __del__(self):
        # Not closed: drop the view into the object so that SharedMemory's own finaliser can
        # unmap it (the daemon lets the lane go when its lease passes).
        self.__dict__.pop("_words", None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
