"""Plain values the client API takes and returns; kvpack.client converts them to and from
kvpack.v1 messages. Units: tokens, bytes, seconds."""

import dataclasses
import math
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
    # Block-sparse attention (LayerOptions.sparse) only: the range's key pages are never pooled
    # (text, reference, audio conditioning); its queries attend every visible page exactly.
    always_attend: bool = False
    attend_densely: bool = False

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


MAX_SINK_PAGES = 1024             # kernels/layer_spec.h kMaxSinkPages
MAX_MIN_EXACT_PAGES = 1 << 20     # kMaxMinExactPages


@dataclasses.dataclass(frozen=True)
class Sparse:
    """Block-sparse attention (docs/api.md "Sparse attention"): per query block of 64 tokens and
    head, the best key pages by centroid · mean-key score are attended exactly, the other visible
    pages as one pooled term each. Give topk_ratio in (0, 1] or rel_tau ≥ 0 (neither: top-k 0.2).
    Runs on the daemon's CPU backend; LayerResult.routed_fraction reports what it routed."""
    topk_ratio: Optional[float] = None
    rel_tau: Optional[float] = None
    tail: bool = True
    sink_pages: int = 0
    min_exact_pages: int = 0

    def __post_init__(self):
        if self.topk_ratio is not None and self.rel_tau is not None:
            raise ValueError("sparse: give topk_ratio or rel_tau, not both")
        if self.topk_ratio is not None and not 0.0 < self.topk_ratio <= 1.0:
            raise ValueError(f"sparse.topk_ratio = {self.topk_ratio} is outside (0, 1]")
        if self.rel_tau is not None and not (math.isfinite(self.rel_tau) and self.rel_tau >= 0.0):
            raise ValueError(f"sparse.rel_tau = {self.rel_tau} must be finite and >= 0")
        if not 0 <= self.sink_pages <= MAX_SINK_PAGES:
            raise ValueError(f"sparse.sink_pages = {self.sink_pages} is outside [0, {MAX_SINK_PAGES}]")
        if not 0 <= self.min_exact_pages <= MAX_MIN_EXACT_PAGES:
            raise ValueError(f"sparse.min_exact_pages = {self.min_exact_pages} is outside "
                             f"[0, {MAX_MIN_EXACT_PAGES}]")


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    rope: Optional[Rope] = None
    qk_norm_eps: Optional[float] = None     # set when q/k norm weights are registered
    causal: bool = False
    softmax_scale: float = 0.0              # 0: 1/sqrt(head_dim)
    sparse: Optional[Sparse] = None         # block-sparse attention
    mma: str = "auto"                       # "auto" | "bf16" | "int8" (tensor-core arithmetic)

    def __post_init__(self):
        if self.mma not in ("auto", "bf16", "int8"):
            raise ValueError(f"mma = {self.mma!r}: 'auto', 'bf16' or 'int8'")


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
