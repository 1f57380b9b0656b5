"""kvpack.cuda_segments.SegmentRegions against a simulated driver (an allocator that reuses freed
addresses, as cudaMalloc does after torch.cuda.empty_cache()) and a recording client: one
registration per segment, offsets inside it, freed segments never addressed and unregistered by
the next sweep. No GPU, no torch."""

import itertools

import pytest

from kvpack.cuda_segments import Segment, SegmentRegions

GRANULE = 2 << 20            # the caching allocator's segments are multiples of 2 MiB
BASE = 0x7F0000000000


class FakeDriver:
    """Segments at the lowest free address (first fit), each with a new buffer id."""

    def __init__(self):
        self.segments = {}                       # base -> Segment
        self._ids = itertools.count(1)
        self.queries = 0

    def malloc(self, size, ipc_capable=True):
        base = BASE
        for b, s in sorted(self.segments.items()):
            if base + size <= b:
                break
            base = max(base, b + s.size)
        self.segments[base] = Segment(0, base, size, next(self._ids), ipc_capable, 0xC0)
        return base

    def free(self, base):
        del self.segments[base]

    def segment(self, ptr):
        self.queries += 1
        for s in self.segments.values():
            if s.base <= ptr < s.base + s.size:
                return s
        return Segment(0, 0, 0, 0, False, 0)

    def ipc_handle(self, seg):
        return seg.buffer_id.to_bytes(8, "little") * 8


class RecordingClient:
    def __init__(self):
        self.regions = {}                        # region id -> IPC handle
        self.registered, self.unregistered = [], []
        self._ids = itertools.count(1)

    def register_cuda_ipc(self, handle, size_bytes, device=0, timeout=None):
        assert len(handle) == 64
        region_id = f"r-{next(self._ids)}"
        self.regions[region_id] = (handle, size_bytes, device)
        self.registered.append(region_id)
        return region_id

    def unregister_region(self, region_id, timeout=None):
        del self.regions[region_id]
        self.unregistered.append(region_id)


@pytest.fixture
def setup():
    driver, client = FakeDriver(), RecordingClient()
    return driver, client, SegmentRegions(client, device=3, driver=driver)


def test_tensors_of_one_segment_share_one_registration(setup):
    driver, client, regions = setup
    base = driver.malloc(4 * GRANULE)
    slices = [regions.slice(base + off, 4096) for off in (0, 8192, 3 * GRANULE + 512)]
    assert regions.registrations == 1 and len(client.registered) == 1
    assert {s.region_id for s in slices} == {client.registered[0]}
    assert [s.offset for s in slices] == [0, 8192, 3 * GRANULE + 512]
    handle, size, device = client.regions[client.registered[0]]
    assert size == 4 * GRANULE and device == 3
    # Steady state: the same calls again register nothing.
    for _ in range(5):
        regions.sweep()
        regions.slice(base + 8192, 4096)
    assert regions.registrations == 1 and regions.releases == 0


def test_freed_segment_at_the_same_address_is_a_new_region(setup):
    driver, client, regions = setup
    old = driver.malloc(GRANULE)
    first = regions.slice(old + 64, 1024)
    driver.free(old)                             # torch.cuda.empty_cache()
    new = driver.malloc(GRANULE)
    assert new == old                            # the allocator hands the address out again
    second = regions.slice(new + 64, 1024)
    assert second.region_id != first.region_id   # never the freed allocation's region
    assert client.regions[second.region_id][0] != client.regions[first.region_id][0]
    assert regions.sweep() == 1                  # the dead one is unregistered
    assert client.unregistered == [first.region_id] and len(regions) == 1
    assert regions.registrations == 2 and regions.releases == 1


def test_sweep_releases_dead_segments_and_keeps_live_ones(setup):
    driver, client, regions = setup
    a, b = driver.malloc(GRANULE), driver.malloc(2 * GRANULE)
    ra, rb = regions.slice(a, 16).region_id, regions.slice(b, 16).region_id
    driver.free(a)
    assert regions.sweep() == 1 and client.unregistered == [ra]
    assert regions.sweep() == 0 and list(client.regions) == [rb]


def test_least_recently_used_beyond_the_cap_are_released(setup):
    driver, client, _ = setup
    regions = SegmentRegions(client, device=0, driver=driver, max_segments=2)
    bases = [driver.malloc(GRANULE) for _ in range(3)]
    ids = [regions.slice(b, 16).region_id for b in bases]
    regions.slice(bases[0], 16)                  # bases[1] is now the least recently used
    assert regions.sweep() == 1 and client.unregistered == [ids[1]]
    assert regions.slice(bases[0], 16).region_id == ids[0] and regions.registrations == 3


def test_unshareable_memory_is_refused(setup):
    driver, _, regions = setup
    with pytest.raises(ValueError, match="not CUDA device memory"):
        regions.slice(0x1000, 16)
    base = driver.malloc(GRANULE, ipc_capable=False)
    with pytest.raises(ValueError, match="expandable"):
        regions.slice(base, 16)
    ok = driver.malloc(GRANULE)
    with pytest.raises(ValueError, match="cross the end"):
        regions.slice(ok + GRANULE - 8, 16)
    assert regions.registrations == 0


def test_maybe_sweep_runs_at_most_once_per_interval(setup):
    driver, client, _ = setup
    now = [10.0]
    regions = SegmentRegions(client, device=0, driver=driver, sweep_interval_s=0.25,
                             clock=lambda: now[0])
    a, b = driver.malloc(GRANULE), driver.malloc(GRANULE)
    regions.slice(a, 16), regions.slice(b, 16)
    assert regions.maybe_sweep() == 0                # the first sweep: nothing dead yet
    driver.free(a)
    queries = driver.queries
    now[0] += 0.1
    assert regions.maybe_sweep() == 0 and driver.queries == queries   # too soon: no query
    now[0] += 0.2
    assert regions.maybe_sweep() == 1 and len(client.unregistered) == 1


def test_forget_all_unregisters_everything(setup):
    driver, client, regions = setup
    for _ in range(3):
        regions.slice(driver.malloc(GRANULE), 16)
    regions.forget_all()
    assert client.regions == {} and len(regions) == 0 and regions.releases == 3


class FakeLibcuda:
    """libcuda's entry points as CudaDriver calls them through ctypes, writing results the way the
    driver does: each attribute into its own slot, in its own width (CUcontext and addresses 8
    bytes, the ordinal an int, the IPC capability a bool), nothing for an unknown pointer."""

    BASE, SIZE, BUFFER_ID, ORDINAL, CONTEXT = 0x7F1200000000, 6 << 20, 77, 2, 0xC0FFEE

    def __init__(self):
        self.pushed = []
        # Plain functions, as a CDLL's are, so that CudaDriver can set their argtypes.
        for name in ("cuInit", "cuPointerGetAttributes", "cuIpcGetMemHandle",
                     "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"):
            setattr(self, name, (lambda f: lambda *a: f(*a))(getattr(self, name)))

    def cuInit(self, flags):
        return 0

    def cuPointerGetAttributes(self, n, attrs, slots, ptr):
        import ctypes
        if not self.BASE <= ptr < self.BASE + self.SIZE:
            return 0                                   # unknown pointer: slots left as they are
        for i in range(n):
            a = attrs[i]
            if a == 1:
                ctypes.c_uint64.from_address(slots[i]).value = self.CONTEXT
            elif a == 7:
                ctypes.c_uint64.from_address(slots[i]).value = self.BUFFER_ID
            elif a == 9:
                ctypes.c_int.from_address(slots[i]).value = self.ORDINAL
            elif a == 10:
                ctypes.c_bool.from_address(slots[i]).value = True
            elif a == 11:
                ctypes.c_uint64.from_address(slots[i]).value = self.BASE
            elif a == 12:
                ctypes.c_size_t.from_address(slots[i]).value = self.SIZE
        return 0

    def cuIpcGetMemHandle(self, buf, ptr):
        import ctypes
        assert ptr == self.BASE and self.pushed == [self.CONTEXT]
        ctypes.memmove(buf, b"H" * 64, 64)
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        self.pushed.append(ctx)
        return 0

    def cuCtxPopCurrent_v2(self, out):
        self.pushed.pop()
        return 0


def test_cuda_driver_reads_every_attribute_in_its_width():
    from kvpack.cuda_segments import CudaDriver

    lib = FakeLibcuda()
    driver = CudaDriver(lib)
    seg = driver.segment(lib.BASE + 4096)
    assert seg == Segment(lib.ORDINAL, lib.BASE, lib.SIZE, lib.BUFFER_ID, True, lib.CONTEXT)
    assert driver.segment(0x1000).buffer_id == 0          # not device memory
    assert driver.ipc_handle(seg) == b"H" * 64 and lib.pushed == []
