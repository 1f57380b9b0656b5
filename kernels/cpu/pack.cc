#include "kernels/cpu/pack.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/epilogue.h"
#include "kernels/cpu/layer.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/format.h"
#include "kernels/transform_choice.h"

namespace kvpack::cpu {

TokenPageMap::TokenPageMap(const std::vector<TokenRange>& ranges) : ranges_(ranges) {
  first_page_.reserve(ranges.size());
  int page = 0;
  for (const TokenRange& r : ranges) {
    first_page_.push_back(page);
    page += static_cast<int>((r.end - r.begin + kPageTokens - 1) / kPageTokens);
  }
}

int TokenPageMap::RangeOf(int64_t token) const {
  const auto it = std::upper_bound(ranges_.begin(), ranges_.end(), token,
                                   [](int64_t t, const TokenRange& r) { return t < r.end; });
  return static_cast<int>(it - ranges_.begin());
}

void TokenPageMap::Locate(int64_t token, int* page, int* slot) const {
  const int r = RangeOf(token);
  const int64_t offset = token - ranges_[r].begin;
  *page = first_page_[r] + static_cast<int>(offset / kPageTokens);
  *slot = static_cast<int>(offset % kPageTokens);
}

void WriteBlockHeader(const KvLayout& layout, const KvStats& stats, uint8_t* block) {
  memset(block, 0, layout.pages_offset);
  memset(block + layout.head_flags_offset, 0, layout.total_bytes - layout.head_flags_offset);
  WriteKvTables(layout, block + layout.pages_offset);
  const size_t stats_bytes = stats.mu_k.size() * sizeof(float);
  memcpy(block + layout.mu_k_offset, stats.mu_k.data(), stats_bytes);
  memcpy(block + layout.mu_v_offset, stats.mu_v.data(), stats_bytes);
  memcpy(block + layout.lambda_offset, stats.lambda.data(), stats_bytes);
  memcpy(block + layout.lambda_v_offset, stats.lambda_v.data(), stats_bytes);
}

void WriteTransformRecord(const KvLayout& layout, const TransformRecord& record, uint8_t* block) {
  memcpy(block + layout.head_flags_offset, record.head_flags.data(), record.head_flags.size() * sizeof(uint32_t));
  memcpy(block + layout.head_estimates_offset, record.head_estimates.data(),
         record.head_estimates.size() * sizeof(float));
}

void PackRow(const KvLayout& layout, const LayerShape& shape, const TransformOptions& transforms,
             const KvStats& stats, int page, int slot, int head, float* k, float* v, uint8_t* block) {
  const int d = shape.head_dim;
  const int64_t n_pages = static_cast<int64_t>(layout.pages.size());
  const int64_t stat = static_cast<int64_t>(head) * d;
  const PageFormat format = static_cast<PageFormat>(layout.pages[page].format);
  // The head's flags as the block holds them (zero where no record was written: the entry's rotation).
  const uint32_t* flags = reinterpret_cast<const uint32_t*>(block + layout.head_flags_offset);
  ToStoredK(k, d, stats.mu_k.data() + stat, stats.lambda.data() + stat,
            HeadRotatesK(transforms.rotate, flags, head), transforms.seed);
  ToStoredV(v, d, stats.mu_v.data() + stat, stats.lambda_v.data() + stat,
            HeadRotatesV(transforms.rotate, flags, head), transforms.seed);
  EncodePageRow(format, k, d, slot, block + layout.k_offsets[head * n_pages + page]);
  EncodePageRow(format, v, d, slot, block + layout.v_offsets[head * n_pages + page]);
}

Error PackKv(const float* k, const float* v, const LayerShape& shape, const std::vector<TokenRange>& ranges,
             const KvStats& stats, const TransformOptions& transforms, uint8_t* kv, const CpuOptions& options,
             const TransformRecord* record) {
  if (Error e = ValidateShape(shape, false); !e.ok()) return e;
  if (Error e = ValidateRanges(shape.n_tokens, ranges); !e.ok()) return e;
  const size_t hd = static_cast<size_t>(shape.HeadCols());
  if (stats.mu_k.size() != hd || stats.mu_v.size() != hd || stats.lambda.size() != hd ||
      stats.lambda_v.size() != hd) {
    return InvalidArgument("stats: mu_k, mu_v, lambda and lambda_v must each have n_heads * head_dim = " +
                           std::to_string(hd) + " entries");
  }
  if (k == nullptr || v == nullptr || kv == nullptr) return InvalidArgument("PackKv: k, v and kv must not be null");
  const KvLayout layout = PlanKvLayout(shape, ranges);
  WriteBlockHeader(layout, stats, kv);
  if (record != nullptr) {
    if (record->head_flags.size() != static_cast<size_t>(shape.n_heads) ||
        record->head_estimates.size() != static_cast<size_t>(shape.n_heads) * kHeadEstimateFields) {
      return InvalidArgument("PackKv: the transform record must hold n_heads flags and estimates");
    }
    WriteTransformRecord(layout, *record, kv);
  }
  const TokenPageMap map(ranges);
  const int d = shape.head_dim;
  ParallelFor(options.n_threads, shape.n_tokens, [&](int64_t t) {
    int page, slot;
    map.Locate(t, &page, &slot);
    float k_row[kMaxHeadDimCpu], v_row[kMaxHeadDimCpu];
    for (int h = 0; h < shape.n_heads; ++h) {
      const int64_t offset = t * static_cast<int64_t>(hd) + static_cast<int64_t>(h) * d;
      std::copy(k + offset, k + offset + d, k_row);
      std::copy(v + offset, v + offset + d, v_row);
      PackRow(layout, shape, transforms, stats, page, slot, h, k_row, v_row, kv);
    }
  });
  return Error::Ok();
}

void ComputePageStats(const KvEntryView& kv, uint16_t* mean_k, uint16_t* v_sum, const CpuOptions& options) {
  const int d = kv.head_dim;
  ParallelFor(options.n_threads, static_cast<int64_t>(kv.n_heads) * kv.n_pages, [&](int64_t item) {
    const int pg = static_cast<int>(item % kv.n_pages);
    const PageDesc& page = kv.pages[pg];
    const PageFormat format = static_cast<PageFormat>(page.format);
    const uint8_t* k_bytes = kv.pool + kv.k_offsets[item];
    const uint8_t* v_bytes = kv.pool + kv.v_offsets[item];
    double k_acc[kMaxHeadDimCpu] = {}, v_acc[kMaxHeadDimCpu] = {};
    float row[kMaxHeadDimCpu];
    for (int j = 0; j < page.n_valid; ++j) {
      DecodePageRow(format, k_bytes, d, j, row);
      for (int c = 0; c < d; ++c) k_acc[c] += row[c];
      DecodePageRow(format, v_bytes, d, j, row);
      for (int c = 0; c < d; ++c) v_acc[c] += row[c];
    }
    uint16_t* mk = mean_k + item * d;
    uint16_t* vs = v_sum + item * d;
    for (int c = 0; c < d; ++c) {
      mk[c] = FloatToBf16(static_cast<float>(k_acc[c] / page.n_valid));
      vs[c] = FloatToBf16(static_cast<float>(v_acc[c]));
    }
  });
}

}  // namespace kvpack::cpu
