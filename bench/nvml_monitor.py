"""Device memory seen from outside the processes that use it: NVML's used and free bytes of one GPU,
polled by a thread (bench/oom12.py reads the peak under its cap from it)."""

import ctypes
import subprocess
import threading
import time


class NvmlMonitor(threading.Thread):
    """Polls the device's used and free bytes (NVML through libnvidia-ml, or nvidia-smi when the
    library does not load) every `period_s` into (time, used, free) samples."""

    def __init__(self, uuid, period_s=0.01):
        super().__init__(daemon=True)
        self.period_s, self.uuid = period_s, uuid
        self.samples, self._halt = [], threading.Event()  # (Thread has its own _stop)
        self.source = "nvml"
        try:
            self._lib = ctypes.CDLL("libnvidia-ml.so.1")
            if self._lib.nvmlInit_v2() != 0:
                raise OSError("nvmlInit_v2 failed")
            self._handle = ctypes.c_void_p()
            if self._lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self._handle)) != 0:
                if self._lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self._handle)) != 0:
                    raise OSError("no NVML handle")

            class Memory(ctypes.Structure):
                _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                            ("used", ctypes.c_ulonglong)]
            self._mem = Memory()
        except OSError:
            self._lib, self.source = None, "nvidia-smi"

    def read(self):
        if self._lib is not None:
            self._lib.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(self._mem))
            return self._mem.used, self._mem.free
        line = subprocess.run(["nvidia-smi", f"--id={self.uuid}", "--query-gpu=memory.used,memory.free",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
        used, free = (int(v) << 20 for v in line.strip().split(","))
        return used, free

    def run(self):
        while not self._halt.is_set():
            used, free = self.read()
            self.samples.append((time.monotonic(), used, free))
            time.sleep(self.period_s)

    def stop(self):
        self._halt.set()
        self.join(timeout=5)

    def window(self, t0, t1):
        """(peak used, least free, samples) over [t0, t1]."""
        s = [x for x in list(self.samples) if t0 <= x[0] <= t1]
        if not s:
            used, free = self.read()
            return used, free, 0
        return max(x[1] for x in s), min(x[2] for x in s), len(s)
