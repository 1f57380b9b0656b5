"""bench/nvml_monitor.py's thread and windows, with a stand-in for the device reading."""

import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from nvml_monitor import NvmlMonitor  # noqa: E402


class Scripted(NvmlMonitor):
    """Used bytes rise 10 per reading from 1000, free falls likewise."""

    def __init__(self):
        super().__init__("GPU-00000000-0000-0000-0000-000000000000", period_s=0.001)
        self.k = 0

    def read(self):
        self.k += 1
        return 1000 + 10 * self.k, 5000 - 10 * self.k


def test_polls_until_stopped_and_windows_take_peaks():
    m = Scripted()
    t0 = time.monotonic()
    m.start()
    time.sleep(0.05)
    m.stop()
    t1 = time.monotonic()
    assert not m.is_alive()
    count = len(m.samples)
    assert count >= 5
    peak, least_free, n = m.window(t0, t1)
    assert n == count
    assert peak == max(s[1] for s in m.samples) and least_free == min(s[2] for s in m.samples)
    assert peak + least_free == 6000
    time.sleep(0.01)
    assert len(m.samples) == count          # stopped for good


def test_an_empty_window_reads_once():
    m = Scripted()
    peak, least_free, n = m.window(0.0, 1.0)
    assert n == 0 and peak == 1010 and least_free == 4990
