"""Plain values the client API takes and returns; kvpack.client converts them to and from
kvpack.v1 messages. Units: tokens, bytes, seconds."""

import collections.abc
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
    """Block-sparse attention (docs/api.md "Sparse attention"): per query block (the ≤ 128 tokens of
    a page pair) and head, the best key pages by centroid · mean-key score are attended exactly, the other visible
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


# as_sparse's text form, the CLI's words: "topk=R" | "tau=T", then any of "no_tail",
# "sink_pages=K", "min_exact_pages=K", comma-separated ("" / "off" / "dense": no sparse).
_SPARSE_WORDS = {"topk": "topk_ratio", "topk_ratio": "topk_ratio", "tau": "rel_tau",
                 "rel_tau": "rel_tau", "sink_pages": "sink_pages",
                 "min_exact_pages": "min_exact_pages", "tail": "tail"}


def as_sparse(value) -> Optional[Sparse]:
    """A Sparse (or None for dense attention) from a Sparse, None, a mapping of Sparse's fields,
    or text such as "topk=0.2,no_tail,sink_pages=1" (ComfyUI node settings). Raises ValueError,
    naming the field, on bad values (the same errors as Sparse) and TypeError on other types."""
    if value is None or isinstance(value, Sparse):
        return value
    if isinstance(value, collections.abc.Mapping):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(Sparse)})
        if unknown:
            raise ValueError(f"sparse: unknown fields {unknown}")
        return Sparse(**value)
    if not isinstance(value, str):
        raise TypeError(f"sparse must be a kvpack.Sparse, a mapping, text or None, "
                        f"not {type(value).__name__}")
    text = value.strip().lower()
    if text in ("", "off", "dense", "none"):
        return None
    fields = {}
    for word in (w.strip() for w in text.split(",")):
        if word in ("no_tail", "no-tail"):
            fields["tail"] = False
            continue
        name, eq, arg = word.partition("=")
        field = _SPARSE_WORDS.get(name.strip().replace("-", "_"))
        if not eq or field is None:
            raise ValueError(f"sparse: {word!r} is not topk=R, tau=T, no_tail, sink_pages=K or "
                             "min_exact_pages=K")
        arg = arg.strip()
        try:
            if field == "tail":
                if arg not in ("on", "off", "true", "false", "1", "0"):
                    raise ValueError(arg)
                fields[field] = arg in ("on", "true", "1")
            elif field in ("topk_ratio", "rel_tau"):
                fields[field] = float(arg)
            else:
                fields[field] = int(arg)
        except ValueError:
            raise ValueError(f"sparse.{field} = {arg!r} is not a valid value") from None
    return Sparse(**fields)


def check_range_flags(ranges, sparse):
    """always_attend / attend_densely only mean something with sparse attention (the daemon
    answers INVALID_ARGUMENT otherwise): raise ValueError naming the range first."""
    if sparse is not None:
        return
    for i, r in enumerate(ranges or ()):
        if r.always_attend or r.attend_densely:
            flag = "always_attend" if r.always_attend else "attend_densely"
            raise ValueError(f"ranges[{i}].{flag} needs sparse attention "
                             "(sparse=kvpack.Sparse(...))")


def leading_text(n_tokens, text_tokens, formats=("int4",), seq_id=0) -> Sequence[Range]:
    """One sequence of n_tokens whose first text_tokens (H3-style packed text, reference or audio
    conditioning) are marked always_attend: their key pages are never pooled by sparse attention.
    text_tokens = 0 gives one plain range; text_tokens ≥ n_tokens marks them all."""
    if text_tokens < 0:
        raise ValueError(f"text_tokens = {text_tokens} must be >= 0")
    formats = tuple(formats)
    t = min(text_tokens, n_tokens)
    if t == 0:
        return [Range(0, n_tokens, seq_id, formats)]
    ranges = [Range(0, t, seq_id, formats, always_attend=True)]
    if t < n_tokens:
        ranges.append(Range(t, n_tokens, seq_id, formats))
    return ranges


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
