"""A stand-in for kvpack.Client with the same register_weights / attention_layer contract,
computing layers with kvpack.reference (float64, unquantized) and rounding the output to bf16.
Lets the torch adapter be tested without a daemon."""

import itertools

import numpy as np

from kvpack import reference, tensors
from kvpack.types import LayerOptions, LayerOutput, Weights

ROPE = {"interleaved": reference.ROPE_INTERLEAVED, "split_halves": reference.ROPE_SPLIT_HALVES}


class FakeClient:
    def __init__(self):
        self.weights = {}
        self.layer_calls = []
        self.errors = []                 # raised, in order, by the next attention_layer calls
        self._ids = itertools.count(1)

    def register_weights(self, w_qkv, *, n_heads, head_dim, bias=None, q_norm_weight=None,
                         k_norm_weight=None, timeout=None):
        assert w_qkv.dtype == np.uint16 and w_qkv.shape[0] == 3 * n_heads * head_dim
        handle = f"w{next(self._ids)}"
        self.weights[handle] = dict(w=tensors.from_bf16_bits(w_qkv), bias=bias,
                                    q_norm=q_norm_weight, k_norm=k_norm_weight)
        return Weights(handle, w_qkv.nbytes, 600.0)

    def release_weights(self, handle, timeout=None):
        self.weights.pop(handle)

    def attention_layer(self, x, weights, *, n_heads, head_dim, ranges, positions=None,
                        options=LayerOptions(), keep_kv=False, priority=0, timeout=None):
        handle = getattr(weights, "handle", weights)
        self.layer_calls.append(dict(x_shape=x.shape, handle=handle, ranges=list(ranges),
                                     positions=positions, options=options))
        if self.errors:
            raise self.errors.pop(0)
        w = self.weights[handle]
        rope = options.rope
        out = reference.attention_layer(
            tensors.from_bf16_bits(x), w["w"], n_heads, head_dim, bias=w["bias"],
            q_norm_weight=w["q_norm"], k_norm_weight=w["k_norm"],
            eps=options.qk_norm_eps or 1e-6, positions=positions,
            rope_layout=ROPE[rope.layout] if rope else reference.ROPE_NONE,
            axis_dims=rope.axis_dims if rope else (), theta=rope.theta if rope else 1e4,
            seq_ids=reference.seq_ids_from_ranges([(r.begin, r.end, r.seq_id) for r in ranges],
                                                  x.shape[0]),
            causal=options.causal, softmax_scale=options.softmax_scale)
        return LayerOutput(tensors.to_bf16_bits(out), {"peak_bytes": 0})
