"""Plain values the client API takes and returns; kvpack.client converts them to and from
kvpack.v1 messages. Units: tokens, bytes, seconds."""

import dataclasses
from typing import Optional, Sequence, Tuple

FORMATS = ("int4", "int8", "bf16")          # packed K/V formats, kernels/format.h
ROPE_LAYOUTS = ("none", "interleaved", "split_halves")


@dataclasses.dataclass(frozen=True)
class Range:
    """Tokens [begin, end) of one sequence, and the K/V formats they may be stored in, best
    first (the daemon takes the first that fits and falls no further than the last)."""
    begin: int
    end: int
    seq_id: int = 0
    formats: Tuple[str, ...] = ("int4",)

    def __post_init__(self):
        if not 0 <= self.begin < self.end:
            raise ValueError(f"range [{self.begin}, {self.end}) is empty or negative")
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise ValueError(f"formats must be a non-empty subset of {FORMATS}, got {self.formats}")

    def shifted(self, tokens, seq_ids):
        return dataclasses.replace(self, begin=self.begin + tokens, end=self.end + tokens,
                                   seq_id=self.seq_id + seq_ids)


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary embedding on 1 to 3 position axes over the first Σ axis_dims channels of a head
    (kernels/layer_spec.h). positions are float32 [N, len(axis_dims)]."""
    axis_dims: Tuple[int, ...]
    layout: str = "split_halves"
    theta: float = 10000.0

    def __post_init__(self):
        if self.layout not in ROPE_LAYOUTS[1:]:
            raise ValueError(f"RoPE layout must be one of {ROPE_LAYOUTS[1:]}")
        if not 1 <= len(self.axis_dims) <= 3 or any(d <= 0 or d % 2 for d in self.axis_dims):
            raise ValueError("axis_dims: 1 to 3 positive even sizes")


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    rope: Optional[Rope] = None
    qk_norm_eps: Optional[float] = None     # set when q/k norm weights are registered
    causal: bool = False
    softmax_scale: float = 0.0              # 0: 1/sqrt(head_dim)


def whole(n_tokens, formats=("int4",)) -> Sequence[Range]:
    """One range covering a single sequence of n_tokens."""
    return [Range(0, n_tokens, 0, tuple(formats))]


@dataclasses.dataclass(frozen=True)
class Weights:
    """A registered QKV weight: pass `handle` (or this object) to attention_layer."""
    handle: str
    pool_bytes: int
    lease_seconds: float


@dataclasses.dataclass(frozen=True)
class LayerOutput:
    """output: bf16 bits [N, H·d] (numpy uint16), None unless the output came back inline.
    result: the daemon's kvpack.v1.LayerResult (plan, peak bytes, stage seconds, kv_handle)."""
    output: Optional[object]
    result: object


@dataclasses.dataclass(frozen=True)
class RegionSlice:
    """Bytes [offset, offset + size_bytes) of a registered region, in place of an inline tensor
    (or as the output destination)."""
    region_id: str
    offset: int
    size_bytes: int
