"""kvpack's torch entry points as torch.library custom ops, so torch.compile keeps them whole.

A compiled model sees each kvpack call as one opaque op with a fake (meta) implementation that
gives the output's shape, dtype and device; Dynamo traces around it without a graph break and
Inductor leaves it alone. The ops take tensors and plain values only, so the Python object that
does the work (a ProjectedAttention, an AttentionOverride, a KvpackSelfAttention) is named by a
small integer from `register()`; it is looked up when the op runs (eagerly, on real tensors).

    kvpack::projected_attention(q, k, v, attend_id, ranges, sparse) -> [B, N, H, d]
                                                                             (ProjectedAttention)
    kvpack::attention_override(q, k, v, hook_id, heads, skip_reshape,
                               skip_output_reshape) -> [B, N, H·d] | [B, H, N, d]  (comfy hook)
    kvpack::self_attention(x, positions, module_id, ranges) -> [..., N, H·d] (KvpackSelfAttention)

Outputs are always fresh contiguous tensors (what the fake implementations promise). The
objects go through their op only while Dynamo traces (`compiling()`); called eagerly they run
directly, without the dispatcher's cost. `AVAILABLE` is False on torch without
torch.library.custom_op (before 2.4): the objects are then always called directly.
"""

import itertools
import threading
import weakref
from typing import List, Optional

import torch

from kvpack.types import FORMATS, Range, Sparse

AVAILABLE = hasattr(torch.library, "custom_op")

_lock = threading.Lock()
_ids = itertools.count(1)
_objects = {}       # id -> weakref to the object


def compiling():
    """Whether Dynamo is tracing the caller (a constant True inside a compiled graph)."""
    return AVAILABLE and torch.compiler.is_compiling()


def register(obj):
    """An id for obj, valid while obj lives."""
    with _lock:
        key = next(_ids)
        _objects[key] = weakref.ref(obj, lambda _, key=key: _objects.pop(key, None))
    return key


def lookup(key):
    ref = _objects.get(key)
    obj = ref() if ref is not None else None
    if obj is None:
        raise RuntimeError(f"kvpack op: object {key} is gone")
    return obj


# Ranges travel as five ints each: begin, end, seq_id, the formats, best first, as base-4
# digits of their 1-based index in FORMATS (("int8", "int4") -> 2 + 4·1), and the sparse flags
# (1: always_attend, 2: attend_densely).
def encode_ranges(ranges):
    out = []
    for r in ranges or ():
        code = sum((FORMATS.index(f) + 1) * 4 ** i for i, f in enumerate(r.formats))
        flags = (1 if r.always_attend else 0) | (2 if r.attend_densely else 0)
        out += [r.begin, r.end, r.seq_id, code, flags]
    return out


def decode_ranges(values):
    ranges = []
    for i in range(0, len(values), 5):
        begin, end, seq_id, code, flags = values[i:i + 5]
        formats = []
        while code:
            formats.append(FORMATS[code % 4 - 1])
            code //= 4
        ranges.append(Range(begin, end, seq_id, tuple(formats), always_attend=bool(flags & 1),
                            attend_densely=bool(flags & 2)))
    return ranges


# A per-call Sparse travels as five floats (none: no floats, the object's own setting):
# topk_ratio and rel_tau (-1: unset), tail (0 / 1), sink_pages, min_exact_pages.
def encode_sparse(sparse):
    if sparse is None:
        return []
    return [-1.0 if sparse.topk_ratio is None else float(sparse.topk_ratio),
            -1.0 if sparse.rel_tau is None else float(sparse.rel_tau),
            1.0 if sparse.tail else 0.0, float(sparse.sink_pages), float(sparse.min_exact_pages)]


def decode_sparse(values):
    if not values:
        return None
    topk, tau, tail, sink, min_exact = values
    return Sparse(topk_ratio=None if topk < 0 else topk, rel_tau=None if tau < 0 else tau,
                  tail=tail != 0.0, sink_pages=int(sink), min_exact_pages=int(min_exact))


if AVAILABLE:
    @torch.library.custom_op("kvpack::projected_attention", mutates_args=())
    def projected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            attend_id: int, ranges: List[int],
                            sparse: List[float]) -> torch.Tensor:
        return lookup(attend_id).attend_eager(q, k, v, decode_ranges(ranges) or None,
                                              decode_sparse(sparse)).contiguous()

    @projected_attention.register_fake
    def _(q, k, v, attend_id, ranges, sparse):
        return q.new_empty(q.shape)

    @torch.library.custom_op("kvpack::attention_override", mutates_args=())
    def attention_override(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hook_id: int,
                           heads: int, skip_reshape: bool,
                           skip_output_reshape: bool) -> torch.Tensor:
        return lookup(hook_id).run_eager(q, k, v, heads, skip_reshape,
                                         skip_output_reshape).contiguous()

    @attention_override.register_fake
    def _(q, k, v, hook_id, heads, skip_reshape, skip_output_reshape):
        if skip_reshape:                                     # q [B, H, N, d]
            b, h, n, d = q.shape
        else:                                                # q [B, N, H·d]
            b, n, hd = q.shape
            h, d = heads, hd // heads
        shape = (b, h, n, d) if skip_output_reshape else (b, n, h * d)
        return q.new_empty(shape)

    @torch.library.custom_op("kvpack::self_attention", mutates_args=())
    def self_attention(x: torch.Tensor, positions: Optional[torch.Tensor], module_id: int,
                       ranges: List[int]) -> torch.Tensor:
        module = lookup(module_id)
        return module.forward_eager(x, positions, decode_ranges(ranges) or None).contiguous()

    @self_attention.register_fake
    def _(x, positions, module_id, ranges):
        module = lookup(module_id)
        return x.new_empty((*x.shape[:-1], module.heads * module.head_dim))
