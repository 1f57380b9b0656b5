"""kvpack.Client(lane=True) and kvpack.lane against a real kvpackd (CPU backend): region-only layer
calls go through the lane with the unary call's bytes and plan; a lane the daemon closed is opened
again; a daemon without lanes leaves the calls on gRPC; deadlines and the daemon's errors arrive as
the gRPC call raises them. Skips, saying why, when no kvpackd binary is built."""

import time
from multiprocessing import shared_memory

import numpy as np
import pytest

import kvpack
from kvpack import lane, tensors, testing
from kvpack.types import Range, RegionSlice

pytestmark = pytest.mark.skipif(
    testing.find_kvpackd() is None,
    reason="no kvpackd binary: build the daemon (scripts/build.sh) or set KVPACK_BUILD_DIR")

N, D, H, HD = 300, 96, 2, 64
OUT = N * H * HD * 2


@pytest.fixture(scope="module")
def daemon():
    with testing.LocalDaemon(budget_bytes=256 << 20, extra_args=("--lease_seconds=2",)) as d:
        yield d


class Layer:
    """x and three output slots in one shared-memory region."""

    def __init__(self, client):
        r = np.random.default_rng(5)
        self.x = tensors.to_bf16_bits(r.standard_normal((N, D)) + 0.3)
        w = tensors.to_bf16_bits(r.standard_normal((3 * H * HD, D)) / D ** 0.5)
        self.weights = client.register_weights(w, n_heads=H, head_dim=HD)
        self.shm = shared_memory.SharedMemory(create=True, size=self.x.nbytes + 3 * OUT)
        self.shm.buf[:self.x.nbytes] = self.x.tobytes()
        self.region = client.register_shm("/" + self.shm.name, self.shm.size)
        self.client = client

    def run(self, slot, **kw):
        out = RegionSlice(self.region, self.x.nbytes + slot * OUT, OUT)
        return self.client.attention_layer(
            RegionSlice(self.region, 0, self.x.nbytes), self.weights, n_heads=H, head_dim=HD,
            n_tokens=N, hidden=D, ranges=[Range(0, N, 0, ("int8",))], output=out, **kw)

    def output(self, slot):
        at = self.x.nbytes + slot * OUT
        return bytes(self.shm.buf[at:at + OUT])

    def close(self):
        self.client.unregister_region(self.region)
        self.shm.close()
        self.shm.unlink()


def test_lane_calls_give_the_unary_calls_bytes_and_plan(daemon):
    with kvpack.Client(daemon.target, timeout=60) as grpc_client, \
            kvpack.Client(daemon.target, timeout=60, lane=True) as c:
        layer = Layer(c)
        try:
            layer.client = grpc_client
            unary = layer.run(0)
            layer.client = c
            laned = layer.run(1)
            assert grpc_client.last_layer_method == "AttentionLayerRegions"
            assert c.last_layer_method == "AttentionLayerLane" and c.lane.calls == 1
            assert layer.output(0) == layer.output(1)
            assert laned.result.plan == unary.result.plan
            assert c.status().lanes == 1
            # The lane's own errors are the daemon's, raised as gRPC's would be.
            with pytest.raises(kvpack.InvalidArgument, match="header.output.region"):
                c.attention_layer(RegionSlice(layer.region, 0, layer.x.nbytes), layer.weights,
                                  n_heads=H, head_dim=HD, n_tokens=N, hidden=D,
                                  ranges=[Range(0, N)], output=RegionSlice(layer.region, 1 << 40, OUT))
            assert c.last_layer_method == "AttentionLayerLane"
            # An expired deadline: DEADLINE_EXCEEDED, and the lane serves on.
            with pytest.raises(kvpack.DeadlineExceeded):
                layer.run(2, timeout=1e-6)
            layer.run(2)
            assert layer.output(2) == layer.output(0)
        finally:
            layer.close()
    # Client.close closed the lane and freed its region.
    with kvpack.Client(daemon.target) as c:
        assert c.status().lanes == 0


def test_a_lane_the_daemon_closed_is_opened_again(daemon):
    with kvpack.Client(daemon.target, timeout=60, lane=True) as c:
        layer = Layer(c)
        try:
            layer.run(0)
            first = c.lane.lane_id
            c._unary("CloseLane", kvpack.client.pb.CloseLaneRequest(lane_id=first), None)
            deadline = time.monotonic() + 10
            while c.lane._word(lane._STATE) != lane.STATE_CLOSED and time.monotonic() < deadline:
                time.sleep(0.01)
            layer.run(1)
            assert c.last_layer_method == "AttentionLayerLane" and c.lane.lane_id != first
            assert layer.output(0) == layer.output(1)
            # Idle past the lease (2 s here): the daemon closes it; the next call opens another.
            second = c.lane.lane_id
            for _ in range(10):             # the layer's region and weights stay; the lane idles
                time.sleep(0.25)
                c.keep_alive([layer.region, layer.weights.handle])
            layer.run(2)
            assert c.lane.lane_id != second and layer.output(2) == layer.output(0)
            assert c.status().lanes == 1
        finally:
            layer.close()


def test_without_lanes_the_calls_stay_on_grpc():
    with testing.LocalDaemon(budget_bytes=64 << 20, extra_args=("--max_lanes=0",)) as d, \
            kvpack.Client(d.target, timeout=60, lane=True) as c:
        layer = Layer(c)
        try:
            layer.run(0)
            assert c.last_layer_method == "AttentionLayerRegions"
            assert not c.lane_wanted and isinstance(c.lane_error, kvpack.ResourceExhausted)
            assert "--max_lanes" in c.lane_error.details
        finally:
            layer.close()


def test_from_env_takes_kvpack_lane(monkeypatch):
    monkeypatch.setenv("KVPACK_LANE", "1")
    with kvpack.Client.from_env(target="unix:///nonexistent.sock") as c:
        assert c.lane_wanted
    monkeypatch.setenv("KVPACK_LANE", "0")
    with kvpack.Client.from_env(target="unix:///nonexistent.sock") as c:
        assert not c.lane_wanted


def test_threads_share_one_lane(daemon):
    """Calls from several threads through one client: one lane, each call answered with its own
    result (a lane carries one call at a time; the others wait their turn)."""
    import threading
    with kvpack.Client(daemon.target, timeout=60, lane=True) as c:
        layer = Layer(c)
        try:
            layer.run(0)
            errors, lanes = [], set()

            def worker(slot):
                try:
                    for _ in range(3):
                        layer.run(slot)
                        lanes.add(c.lane.lane_id)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(slot,)) for slot in (1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors and len(lanes) == 1 and c.lane.calls == 7
            assert layer.output(1) == layer.output(0) and layer.output(2) == layer.output(0)
        finally:
            layer.close()
