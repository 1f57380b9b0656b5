#include "kernels/layer_spec.h"

#include <cmath>
#include <cstring>
#include <string>

#include "kernels/rotation.h"

namespace kvpack {
namespace {

std::string RangeField(size_t i, const char* field) {
  return "ranges[" + std::to_string(i) + "]." + field;
}

}  // namespace

std::vector<PageDesc> BuildPageLayout(const std::vector<TokenRange>& ranges) {
  std::vector<PageDesc> pages;
  for (size_t r = 0; r < ranges.size(); ++r) {
    const TokenRange& range = ranges[r];
    for (int64_t t = range.begin; t < range.end; t += kPageTokens) {
      PageDesc page{};
      page.token_begin = static_cast<int32_t>(t);
      page.seq_id = range.seq_id;
      page.n_valid = static_cast<uint16_t>(range.end - t < kPageTokens ? range.end - t : kPageTokens);
      page.format = static_cast<uint8_t>(range.format);
      page.range_index = static_cast<uint8_t>(r);
      pages.push_back(page);
    }
  }
  return pages;
}

Error ValidateRanges(int64_t n_tokens, const std::vector<TokenRange>& ranges) {
  if (ranges.empty()) return InvalidArgument("ranges: at least one token range is required");
  if (ranges.size() > static_cast<size_t>(kMaxRanges)) {
    return InvalidArgument("ranges: " + std::to_string(ranges.size()) + " ranges, at most " +
                           std::to_string(kMaxRanges) + " allowed");
  }
  int64_t expected_begin = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const TokenRange& r = ranges[i];
    if (!IsValidPageFormat(static_cast<int>(r.format))) {
      return InvalidArgument(RangeField(i, "format") + " = " + std::to_string(static_cast<int>(r.format)) +
                             " is not a known format (0 int4, 1 int8, 2 bf16)");
    }
    if (r.begin < expected_begin) {
      return InvalidArgument(RangeField(i, "begin") + " = " + std::to_string(r.begin) +
                             " overlaps the previous range, which ends at " + std::to_string(expected_begin));
    }
    if (r.begin > expected_begin) {
      return InvalidArgument(RangeField(i, "begin") + " = " + std::to_string(r.begin) + " leaves tokens [" +
                             std::to_string(expected_begin) + ", " + std::to_string(r.begin) +
                             ") in no range; ranges must cover every token");
    }
    if (r.end <= r.begin) {
      return InvalidArgument(RangeField(i, "end") + " = " + std::to_string(r.end) + " is not after begin = " +
                             std::to_string(r.begin));
    }
    if (r.end > n_tokens) {
      return InvalidArgument(RangeField(i, "end") + " = " + std::to_string(r.end) +
                             " is past the sequence end (n_tokens = " + std::to_string(n_tokens) + ")");
    }
    expected_begin = r.end;
  }
  if (expected_begin != n_tokens) {
    return InvalidArgument("ranges: the last range ends at " + std::to_string(expected_begin) +
                           " but n_tokens = " + std::to_string(n_tokens) + "; ranges must cover every token");
  }
  return Error::Ok();
}

Error ValidateShape(const LayerShape& shape, bool for_gpu) {
  if (shape.n_tokens <= 0) return InvalidArgument("n_tokens = " + std::to_string(shape.n_tokens) + " must be positive");
  if (shape.n_tokens > INT32_MAX) {
    return InvalidArgument("n_tokens = " + std::to_string(shape.n_tokens) + " exceeds 2^31 - 1");
  }
  if (shape.hidden <= 0) return InvalidArgument("hidden = " + std::to_string(shape.hidden) + " must be positive");
  if (shape.n_heads <= 0) return InvalidArgument("n_heads = " + std::to_string(shape.n_heads) + " must be positive");
  const int d = shape.head_dim;
  if (for_gpu) {
    if (d != 64 && d != 128) {
      return Error(ErrorCode::kUnsupported,
                   "head_dim = " + std::to_string(d) + " is not supported on the GPU (64 or 128)");
    }
  } else if (!IsPowerOfTwo(d) || d < kMinHeadDimCpu || d > kMaxHeadDimCpu) {
    return Error(ErrorCode::kUnsupported, "head_dim = " + std::to_string(d) +
                                              " is not supported (a power of two from 16 to 256)");
  }
  return Error::Ok();
}

Error ValidateSparse(const SparseOptions& sparse) {
  if (!sparse.enabled) return Error::Ok();
  if (sparse.mode == SparseMode::kTopK) {
    if (!(sparse.topk_ratio > 0.0f && sparse.topk_ratio <= 1.0f)) {
      return InvalidArgument("attention.sparse.topk_ratio = " + std::to_string(sparse.topk_ratio) +
                             " is outside (0, 1]");
    }
  } else if (sparse.mode == SparseMode::kRelTau) {
    if (!(std::isfinite(sparse.rel_tau) && sparse.rel_tau >= 0.0f)) {
      return InvalidArgument("attention.sparse.rel_tau = " + std::to_string(sparse.rel_tau) +
                             " must be finite and >= 0");
    }
  } else {
    return InvalidArgument("attention.sparse.mode = " + std::to_string(static_cast<int>(sparse.mode)) + " is unknown");
  }
  if (sparse.sink_pages < 0 || sparse.sink_pages > kMaxSinkPages) {
    return InvalidArgument("attention.sparse.sink_pages = " + std::to_string(sparse.sink_pages) + " is outside [0, " +
                           std::to_string(kMaxSinkPages) + "]");
  }
  if (sparse.min_exact_pages < 0 || sparse.min_exact_pages > kMaxMinExactPages) {
    return InvalidArgument("attention.sparse.min_exact_pages = " + std::to_string(sparse.min_exact_pages) +
                           " is outside [0, " + std::to_string(kMaxMinExactPages) + "]");
  }
  return Error::Ok();
}

Error ValidateRope(const RopeOptions& rope, int head_dim) {
  if (rope.layout == RopeLayout::kNone) return Error::Ok();
  if (rope.layout != RopeLayout::kInterleaved && rope.layout != RopeLayout::kSplitHalves) {
    return InvalidArgument("rope.layout = " + std::to_string(static_cast<int>(rope.layout)) + " is unknown");
  }
  if (rope.n_axes < 1 || rope.n_axes > 3) {
    return InvalidArgument("rope.n_axes = " + std::to_string(rope.n_axes) + " must be 1, 2 or 3");
  }
  if (!(rope.theta > 0.0f)) return InvalidArgument("rope.theta must be positive");
  // Each value is bounded before it is summed, and the sum is 64-bit: two values of 2^30 must not
  // wrap an int to a negative total that passes "total <= head_dim".
  int64_t total = 0;
  for (int a = 0; a < rope.n_axes; ++a) {
    const int dims = rope.axis_dims[a];
    if (dims <= 0 || dims % 2 != 0 || dims > head_dim) {
      return InvalidArgument("rope.axis_dims[" + std::to_string(a) + "] = " + std::to_string(dims) +
                             " must be positive, even and at most head_dim = " + std::to_string(head_dim));
    }
    total += dims;
  }
  if (total > head_dim) {
    return InvalidArgument("rope.axis_dims sum to " + std::to_string(total) + ", more than head_dim = " +
                           std::to_string(head_dim));
  }
  return Error::Ok();
}

Error ValidateQkNorm(const QkNormOptions& norm, const LayerShape& shape) {
  if (!norm.enabled) return Error::Ok();
  if (norm.weight_len != shape.head_dim && norm.weight_len != shape.HeadCols()) {
    return InvalidArgument("qk_norm.weight_len = " + std::to_string(norm.weight_len) + " must be head_dim (" +
                           std::to_string(shape.head_dim) + ") or n_heads * head_dim (" +
                           std::to_string(shape.HeadCols()) + ")");
  }
  if (!(norm.eps > 0.0f)) return InvalidArgument("qk_norm.eps must be positive");
  return Error::Ok();
}

int64_t ProjectedLayout::SpanElements(const LayerShape& shape) const {
  if (shape.n_tokens <= 0 || shape.n_heads <= 0) return 0;
  return Offset(shape.n_tokens - 1, shape.n_heads - 1) + shape.head_dim;
}

Error ValidateProjected(const LayerConfig& config) {
  const ProjectedLayout& p = config.projected;
  if (!p.enabled) return Error::Ok();
  const LayerShape& s = config.shape;
  if (config.has_bias) return InvalidArgument("projected input: has_bias must be off (the caller added the bias)");
  if (config.qk_norm.enabled) return InvalidArgument("projected input: qk_norm must be off (the caller applied it)");
  if (config.rope.layout != RopeLayout::kNone) {
    return InvalidArgument("projected input: rope must be off (the caller applied it)");
  }
  if (config.in_place) return InvalidArgument("projected input: in_place is not supported (there is no x)");
  if (p.batch_tokens <= 0 || p.token_stride < 0 || p.head_stride < 0 || p.batch_stride < 0) {
    return InvalidArgument("projected: batch_tokens must be positive and strides non-negative");
  }
  // Offset() and SpanElements() are int64 products of client strides: bound the span in 128 bits
  // first, so no later product wraps to a small size that passes the region bounds check.
  if (s.n_tokens <= 0 || s.n_heads <= 0 || s.head_dim <= 0) {
    return InvalidArgument("projected: n_tokens, n_heads and head_dim must be positive");
  }
  using Wide = __int128;
  const Wide last_token = s.n_tokens - 1;
  const Wide span = last_token / p.batch_tokens * p.batch_stride + last_token % p.batch_tokens * p.token_stride +
                    static_cast<Wide>(s.n_heads - 1) * p.head_stride + s.head_dim;
  if (span > kMaxProjectedSpanElements) {
    return InvalidArgument("projected: the strides span more than " + std::to_string(kMaxProjectedSpanElements) +
                           " elements");
  }
  // Rows of one token's heads must not overlap one another or the next token's.
  const bool token_major = p.head_stride == s.head_dim && p.token_stride >= s.HeadCols();
  const bool head_major = p.token_stride == s.head_dim && p.head_stride >= p.batch_tokens * s.head_dim;
  if (!token_major && !head_major) {
    return InvalidArgument("projected: strides (token " + std::to_string(p.token_stride) + ", head " +
                           std::to_string(p.head_stride) + ") let rows of different heads or tokens overlap");
  }
  if (p.batch_tokens < s.n_tokens && p.batch_stride < static_cast<int64_t>(s.n_heads) * p.head_stride) {
    return InvalidArgument("projected: batch_stride = " + std::to_string(p.batch_stride) +
                           " overlaps the previous batch element");
  }
  return Error::Ok();
}

namespace {

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

constexpr uint64_t kTableAlign = 256;

// The table offsets of a block whose pages take `page_bytes`: everything of KvLayout but the
// per-page vectors, so KvLayoutBytes needs no O(H·P) work.
void PlaceTables(uint64_t page_bytes, uint64_t n_pages, const LayerShape& shape, KvLayout* layout) {
  const uint64_t heads = static_cast<uint64_t>(shape.n_heads);
  const uint64_t stats_bytes = heads * shape.head_dim * sizeof(float);
  layout->page_bytes = page_bytes;
  layout->pages_offset = AlignUp(page_bytes, kTableAlign);
  layout->k_offsets_offset = AlignUp(layout->pages_offset + n_pages * sizeof(PageDesc), kTableAlign);
  layout->v_offsets_offset = AlignUp(layout->k_offsets_offset + heads * n_pages * sizeof(uint64_t), kTableAlign);
  layout->mu_k_offset = AlignUp(layout->v_offsets_offset + heads * n_pages * sizeof(uint64_t), kTableAlign);
  layout->mu_v_offset = AlignUp(layout->mu_k_offset + stats_bytes, kTableAlign);
  layout->lambda_offset = AlignUp(layout->mu_v_offset + stats_bytes, kTableAlign);
  layout->lambda_v_offset = AlignUp(layout->lambda_offset + stats_bytes, kTableAlign);
  layout->head_flags_offset = AlignUp(layout->lambda_v_offset + stats_bytes, kTableAlign);
  layout->head_estimates_offset = AlignUp(layout->head_flags_offset + heads * sizeof(uint32_t), kTableAlign);
  layout->total_bytes =
      AlignUp(layout->head_estimates_offset + heads * kHeadEstimateFields * sizeof(float), kTableAlign);
}

}  // namespace

// Every page size is 64·(row bytes), a multiple of 128, so pages packed back to back stay 128-byte
// aligned and the page bytes are a plain sum (static_asserts in format.h for the GPU head dims).
KvLayout PlanKvLayout(const LayerShape& shape, const std::vector<TokenRange>& ranges) {
  KvLayout layout;
  layout.pages = BuildPageLayout(ranges);
  const uint64_t n_pages = layout.pages.size();
  const uint64_t heads = static_cast<uint64_t>(shape.n_heads);
  layout.k_offsets.resize(heads * n_pages);
  layout.v_offsets.resize(heads * n_pages);
  uint64_t offset = 0;
  for (std::vector<uint64_t>* offsets : {&layout.k_offsets, &layout.v_offsets}) {
    for (uint64_t h = 0; h < heads; ++h) {
      for (uint64_t p = 0; p < n_pages; ++p) {
        (*offsets)[h * n_pages + p] = offset;
        offset += PageBytes(static_cast<PageFormat>(layout.pages[p].format), shape.head_dim);
      }
    }
  }
  PlaceTables(offset, n_pages, shape, &layout);
  return layout;
}

KvLayout PlanKvTables(const LayerShape& shape, const std::vector<TokenRange>& ranges) {
  uint64_t n_pages = 0, head_page_bytes = 0;
  for (const TokenRange& r : ranges) {
    const uint64_t pages = static_cast<uint64_t>((r.end - r.begin + kPageTokens - 1) / kPageTokens);
    n_pages += pages;
    head_page_bytes += pages * PageBytes(r.format, shape.head_dim);
  }
  KvLayout layout;
  PlaceTables(2 * static_cast<uint64_t>(shape.n_heads) * head_page_bytes, n_pages, shape, &layout);
  return layout;
}

uint64_t KvLayoutBytes(const LayerShape& shape, const std::vector<TokenRange>& ranges) {
  return PlanKvTables(shape, ranges).total_bytes;
}

void WriteKvTables(const KvLayout& layout, uint8_t* tables) {
  const uint64_t base = layout.pages_offset;
  memset(tables, 0, layout.mu_k_offset - base);
  memcpy(tables, layout.pages.data(), layout.pages.size() * sizeof(PageDesc));
  memcpy(tables + (layout.k_offsets_offset - base), layout.k_offsets.data(),
         layout.k_offsets.size() * sizeof(uint64_t));
  memcpy(tables + (layout.v_offsets_offset - base), layout.v_offsets.data(),
         layout.v_offsets.size() * sizeof(uint64_t));
}

KvEntryView MakeKvView(const KvLayout& layout, const LayerShape& shape, const uint8_t* block,
                       const TransformOptions& transforms) {
  KvEntryView view;
  view.n_heads = shape.n_heads;
  view.head_dim = shape.head_dim;
  view.n_tokens = shape.n_tokens;
  view.n_pages = static_cast<int>(layout.pages.size());
  view.pages = reinterpret_cast<const PageDesc*>(block + layout.pages_offset);
  view.pool = block;
  view.k_offsets = reinterpret_cast<const uint64_t*>(block + layout.k_offsets_offset);
  view.v_offsets = reinterpret_cast<const uint64_t*>(block + layout.v_offsets_offset);
  view.mu_k = reinterpret_cast<const float*>(block + layout.mu_k_offset);
  view.mu_v = reinterpret_cast<const float*>(block + layout.mu_v_offset);
  view.lambda = reinterpret_cast<const float*>(block + layout.lambda_offset);
  view.lambda_v = reinterpret_cast<const float*>(block + layout.lambda_v_offset);
  view.head_flags = reinterpret_cast<const uint32_t*>(block + layout.head_flags_offset);
  view.head_estimates = reinterpret_cast<const float*>(block + layout.head_estimates_offset);
  view.seed = transforms.seed;
  view.rotate = transforms.rotate;
  return view;
}

ChunkGate CancelGate(std::function<bool()> cancelled) {
  return [cancelled = std::move(cancelled)] {
    return cancelled() ? Error(ErrorCode::kCancelled, "cancelled between chunks") : Error::Ok();
  };
}

MmaPath ConfigMmaPath(const LayerConfig& config) {
  bool has_bf16 = false;
  for (const TokenRange& r : config.ranges) has_bf16 = has_bf16 || r.format == PageFormat::kBf16;
  return ResolveMmaPath(config.attention.mma, has_bf16, config.shape.head_dim, config.transforms.rotate);
}

TransformOptions ChoiceTransforms(const TransformOptions& transforms, MmaPath resolved) {
  TransformOptions t = transforms;
  if (Int8Logits(resolved)) t.choose_plain_k = false;
  return t;
}

TransformOptions ChoiceTransforms(const LayerConfig& config) {
  return ChoiceTransforms(config.transforms, ConfigMmaPath(config));
}

}  // namespace kvpack
