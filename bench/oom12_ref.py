"""The torch-free parts of bench/oom12.py (the request's 12 GiB out-of-memory case), tested on the CPU by
bench/tests/test_oom12_ref.py with numpy and run on the GPU with torch through the same code.

- H3's geometry and token layout: x [N, 5376] bf16, W_qkv [21504, 5376], 56 heads × 128, RMSNorm on
  q and k (one weight of 128 for all heads), split-half RoPE on the first 96 of 128 dims as three
  axes of 32 (frame, height, width). The 152,263 tokens: 1,063 text tokens (position (0, 0, 0): no
  rotation, as Flux and HunyuanVideo treat text), a reference video of 21 frames × 45 × 80 latent
  patches (frames 0..20) and the generated video of the same size (frames 21..41). Smaller N keeps
  the proportions (text ≈ 0.7 %, the rest halved) and the 45 × 80 frame.
- The cap: a ballast of total − cap bytes makes the rest of the device unusable, so what every
  process on it (this one's CUDA context included) can hold is `cap` bytes.
- The reference: float64 attention of a sample of query rows and heads over ALL keys, from the same
  x, W, norm weights and positions; `xp` is numpy or a torch namespace (TorchOps).
"""

import math
import pathlib
import re
import signal
import socket
import subprocess
import time

import numpy as np

H3_TOKENS = 152263
H3_TEXT = 1063
HIDDEN, HEADS, HEAD_DIM = 5376, 56, 128
AXIS_DIMS = (32, 32, 32)
THETA = 10000.0
EPS = 1e-6
FRAME_H, FRAME_W = 45, 80
GIB = 1 << 30
USER_CAP_GIB = 11.94      # "GPU 0 has a total capacity of 11.94 GiB"
USER_HELD_GIB = 6.09      # "Of the allocated memory 6.09 GiB is allocated by PyTorch"

# Allowed formats per range, best first (the daemon takes the first that fits).
MODES = {
    "mixed": {"text": ("bf16", "int8"), "reference": ("int8", "int4"), "generated": ("int4",)},
    "int4": {"text": ("int4",), "reference": ("int4",), "generated": ("int4",)},
    "int8": {"text": ("int8",), "reference": ("int8",), "generated": ("int8",)},
    "bf16": {"text": ("bf16",), "reference": ("bf16",), "generated": ("bf16",)},
}


def token_layout(n):
    """[(name, begin, end)] for text, reference video, generated video over n ≥ 3 tokens."""
    if n < 3:
        raise ValueError("the H3 layout needs at least 3 tokens")
    text = max(1, (n * H3_TEXT + H3_TOKENS // 2) // H3_TOKENS)
    ref = (n - text) // 2
    return [("text", 0, text), ("reference", text, text + ref), ("generated", text + ref, n)]


def positions(n):
    """float32 [n, 3] (frame, row, column) per token, as token_layout lays them out."""
    pos = np.zeros((n, 3), dtype=np.float32)
    frame_tokens = FRAME_H * FRAME_W
    layout = token_layout(n)
    ref_len = layout[1][2] - layout[1][1]
    first_frame = {"reference": 0, "generated": -(-ref_len // frame_tokens)}  # time goes on
    for name, begin, end in layout:
        if name == "text":
            continue
        j = np.arange(end - begin)
        pos[begin:end, 0] = first_frame[name] + j // frame_tokens
        pos[begin:end, 1] = (j % frame_tokens) // FRAME_W
        pos[begin:end, 2] = j % FRAME_W
    return pos


def ranges(n, mode):
    """(name, begin, end, formats) per range of `mode` (a MODES key)."""
    return [(name, b, e, MODES[mode][name]) for name, b, e in token_layout(n)]


def kvpack_ranges(n, mode):
    """kvpack.Range per range of `mode`, one sequence."""
    from kvpack.types import Range
    return [Range(b, e, 0, tuple(f)) for _, b, e, f in ranges(n, mode)]


def kvpack_options():
    """The layer's options: split-half RoPE over AXIS_DIMS, RMSNorm of q and k (weights registered)."""
    from kvpack.types import LayerOptions, Rope
    return LayerOptions(rope=Rope(AXIS_DIMS, "split_halves", THETA), qk_norm_eps=EPS)


def cap_bytes(total, cap):
    """Ballast bytes that leave `cap` bytes of a device of `total` bytes (cudaMemGetInfo's total)."""
    if cap > total:
        raise ValueError(f"cap {cap} is larger than the device ({total} bytes)")
    return total - cap


def other_bytes(held, x_bytes, w_bytes, held_includes_inputs=True):
    """The "other model tensors" allocation: `held` in all, x and W included (the request's
    6.09 GiB is everything PyTorch had allocated), or `held` on top of x and W."""
    other = held - x_bytes - w_bytes if held_includes_inputs else held
    if other < 0:
        raise ValueError(f"held {held} bytes is smaller than x and W ({x_bytes + w_bytes} bytes)")
    return other


_OOM = re.compile(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB|B)")


def oom_bytes(message):
    """The bytes an out-of-memory message says were asked for ("Tried to allocate 6.10 GiB"), or None."""
    m = _OOM.search(message)
    if not m:
        return None
    scale = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}[m.group(2)]
    return int(float(m.group(1)) * scale)


def sample_rows(n, count, seed):
    """`count` distinct query rows (sorted), seeded, spread over every range."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=min(count, n), replace=False))


def sample_heads(count, seed, heads=HEADS):
    rng = np.random.default_rng(seed + 1)
    return np.sort(rng.choice(heads, size=min(count, heads), replace=False))


# ── the reference, on numpy or torch ───────────────────────────────────────────────────────────

class NumpyOps:
    f64 = staticmethod(lambda a: np.asarray(a, dtype=np.float64))
    exp, cos, sin, sqrt = np.exp, np.cos, np.sin, np.sqrt
    cat = staticmethod(lambda arrays, axis: np.concatenate(arrays, axis=axis))
    amax = staticmethod(lambda a, axis: a.max(axis=axis, keepdims=True))
    sum = staticmethod(lambda a, axis: a.sum(axis=axis, keepdims=True))
    mean = staticmethod(lambda a, axis: a.mean(axis=axis, keepdims=True))
    arange = staticmethod(lambda n, like: np.arange(n, dtype=np.float64))
    index = staticmethod(lambda a, idx: a[np.asarray(idx)])


class TorchOps:
    """The same operations on torch tensors of one device (float64 throughout)."""

    def __init__(self, torch, device):
        self.t, self.device = torch, device

    def f64(self, a):
        if isinstance(a, np.ndarray):
            return self.t.from_numpy(np.asarray(a, dtype=np.float64)).to(self.device)
        return a.to(device=self.device, dtype=self.t.float64)

    def exp(self, a): return self.t.exp(a)
    def cos(self, a): return self.t.cos(a)
    def sin(self, a): return self.t.sin(a)
    def sqrt(self, a): return self.t.sqrt(a)
    def cat(self, arrays, axis): return self.t.cat(arrays, dim=axis)
    def amax(self, a, axis): return a.amax(dim=axis, keepdim=True)
    def sum(self, a, axis): return a.sum(dim=axis, keepdim=True)
    def mean(self, a, axis): return a.mean(dim=axis, keepdim=True)
    def arange(self, n, like): return self.t.arange(n, dtype=self.t.float64, device=self.device)

    def index(self, a, idx):
        return a[self.t.as_tensor(np.asarray(idx), device=a.device)]


def rms_norm(xp, t, weight, eps=EPS):
    """t [R, d] float64; weight [d]."""
    return t / xp.sqrt(xp.mean(t * t, -1) + eps) * weight


def rope_split_halves(xp, t, pos, axis_dims=AXIS_DIMS, theta=THETA):
    """t [R, d] float64, pos [R, axes] float64: pair j (channels j, j + R/2 of the first
    R = Σ axis_dims) turns by pos[:, a] · theta^(−2i/axis_dims[a]), axis a owning pairs in order."""
    angles = []
    for a, dim in enumerate(axis_dims):
        i = xp.arange(dim // 2, t)
        angles.append(pos[:, a:a + 1] * theta ** (-2.0 * i / dim))
    ang = xp.cat(angles, 1)
    r = sum(axis_dims)
    half = r // 2
    x0, x1 = t[:, :half], t[:, half:r]
    c, s = xp.cos(ang), xp.sin(ang)
    return xp.cat([x0 * c - x1 * s, x0 * s + x1 * c, t[:, r:]], 1)


def reference_rows(xp, x, w, q_norm, k_norm, pos, rows, heads, *, n_heads=HEADS, head_dim=HEAD_DIM,
                   chunk=16384, eps=EPS):
    """Float64 attention output of query `rows` for `heads` over all N keys (one sequence):
    [len(rows), len(heads), head_dim]. x [N, D], w [3·H·d, D] (any float dtype; converted chunk by
    chunk), q_norm/k_norm [d], pos [N, 3]."""
    n = x.shape[0]
    hd = n_heads * head_dim
    qn, kn = xp.f64(q_norm), xp.f64(k_norm)
    pos64 = xp.f64(pos)
    xq = xp.f64(xp.index(x, rows))
    pq = xp.index(pos64, rows)
    out = []
    for h in heads:
        h = int(h)
        wq = xp.f64(w[h * head_dim:(h + 1) * head_dim])
        wk = xp.f64(w[hd + h * head_dim:hd + (h + 1) * head_dim])
        wv = xp.f64(w[2 * hd + h * head_dim:2 * hd + (h + 1) * head_dim])
        wkv = xp.cat([wk, wv], 0)                                         # [2d, D]
        kv = xp.cat([xp.f64(x[c:c + chunk]) @ wkv.T for c in range(0, n, chunk)], 0)  # [N, 2d]
        k = rope_split_halves(xp, rms_norm(xp, kv[:, :head_dim], kn, eps), pos64)
        v = kv[:, head_dim:]
        q = rope_split_halves(xp, rms_norm(xp, xq @ wq.T, qn, eps), pq)
        s = (q @ k.T) / math.sqrt(head_dim)                                # [R, N]
        p = xp.exp(s - xp.amax(s, 1))
        out.append((p @ v) / xp.sum(p, 1))
        del kv, k, v, s, p
    return out


def errors(got, ref):
    """rel L2 over the sample, and the worst head's cosine (lists of [R, d] float64 arrays per head,
    numpy). Small-output heads hide inside a global norm, so the worst head is reported too."""
    num = sum(float(((g - r) ** 2).sum()) for g, r in zip(got, ref))
    den = sum(float((r ** 2).sum()) for r in ref)
    cos = []
    for g, r in zip(got, ref):
        dot = (g * r).sum(axis=1)
        cos.append(float(np.mean(dot / (np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1) + 1e-300))))
    return {"rel_l2": math.sqrt(num / den), "worst_head_cos": min(cos), "mean_cos": float(np.mean(cos))}


# ── the kvpackd process ─────────────────────────────────────────────────────────────────────────

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(binary, budget, log_path, timeout_s=60, backend="cuda"):
    """kvpackd on free loopback ports with --vram_budget=budget, its output appended to log_path;
    returns (process, target) once it printed "listening on" — in what this start appended (the
    log may hold earlier runs)."""
    port, metrics = free_port(), free_port()
    log = pathlib.Path(log_path)
    offset = log.stat().st_size if log.exists() else 0
    with open(log, "ab") as f:
        proc = subprocess.Popen([str(binary), f"--backend={backend}", f"--listen=127.0.0.1:{port}",
                                 f"--metrics_address=127.0.0.1:{metrics}", f"--vram_budget={budget}",
                                 "--threads=1"], stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvpackd exited with {proc.returncode}: "
                               f"{log.read_bytes()[offset:].decode(errors='replace')[-2000:]}")
        if b"listening on" in log.read_bytes()[offset:]:
            return proc, f"127.0.0.1:{port}"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise TimeoutError(f"kvpackd did not start in {timeout_s} s")


def stop_daemon(proc, timeout_s=60):
    """SIGTERM (kvpackd drains), then its exit code; killed after timeout_s."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
