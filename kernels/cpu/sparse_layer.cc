#include "kernels/cpu/sparse_layer.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/cpu/pack.h"
#include "kernels/cpu/thread_pool.h"

namespace kvpack::cpu {
namespace {

uint64_t Align8(uint64_t b) { return (b + 7) & ~uint64_t{7}; }

// Bytes of one (block, head) route: two lists, scores, order, marks, the report.
uint64_t RouteItemBytes(int n_pages) {
  return Align8(static_cast<uint64_t>(n_pages) * (4 * sizeof(int32_t) + 1)) + sizeof(SparseReport);
}

}  // namespace

uint64_t RoutingBytes(const LayerConfig& config) {
  if (!config.attention.sparse.enabled) return 0;
  const int P = static_cast<int>(SparsePageCount(config));
  const int heads = config.shape.n_heads;
  return Align8(PageStatsBytes(heads, config.shape.head_dim, P)) +
         static_cast<uint64_t>(SparseBlocksPerChunk(config)) * heads * RouteItemBytes(P);
}

double RoutedFractionBound(const LayerConfig& config) {
  const SparseOptions& s = config.attention.sparse;
  if (!s.enabled || s.mode != SparseMode::kTopK) return 1.0;
  for (const TokenRange& r : config.ranges) {
    if (r.always_attend || r.attend_densely) return 1.0;
  }
  // Per block (the queries of its 1 or 2 pages, b of them) the pages it sees, V: its sequence's pages
  // (causal: those up to its last). Exact ≤ min(V, max(ceil(r·V) + b + 2 (the block's pages ±1) + sinks,
  // floor)).
  const std::vector<PageDesc> pages = BuildPageLayout(config.ranges);
  const int n_pages = static_cast<int>(pages.size());
  std::vector<std::pair<int32_t, int64_t>> seen;  // (sequence id, pages so far); few sequences
  auto count_of = [&](int32_t seq) -> int64_t& {
    for (auto& e : seen) {
      if (e.first == seq) return e.second;
    }
    seen.push_back({seq, 0});
    return seen.back().second;
  };
  for (const PageDesc& p : pages) ++count_of(p.seq_id);
  std::vector<std::pair<int32_t, int64_t>> totals = seen;
  for (auto& e : seen) e.second = 0;
  double exact = 0.0, visible = 0.0;
  for (int i = 0; i < n_pages; ++i) {
    const PageDesc& p = pages[i];
    int64_t& so_far = count_of(p.seq_id);
    ++so_far;
    if (!LeadsQueryBlock(pages.data(), n_pages, i)) continue;
    const int b = QueryBlockPages(pages.data(), n_pages, i);
    int64_t v = so_far + (b - 1);
    if (!config.attention.causal) {
      for (const auto& e : totals) {
        if (e.first == p.seq_id) v = e.second;
      }
    }
    const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(s.topk_ratio) * v - 1e-6)));
    exact += static_cast<double>(std::min<int64_t>(v, std::max<int64_t>(k + b + 2 + s.sink_pages, s.min_exact_pages)));
    visible += static_cast<double>(v);
  }
  return visible > 0.0 ? exact / visible : 1.0;
}

void AttendChunkSparse(const LayerConfig& config, const KvEntryView& kv, const uint16_t* q_ws, int64_t begin,
                       int64_t end, uint8_t* routing, int threads, uint16_t* out, SparseReport* report) {
  const int d = kv.head_dim;
  const int heads = kv.n_heads;
  const int P = kv.n_pages;
  const int64_t hd = static_cast<int64_t>(heads) * d;
  const AttentionOptions& attention = config.attention;
  const float scale = EffectiveScale(attention, d);
  const MmaPath mma = ConfigMmaPath(config);
  const TokenPageMap map(config.ranges);
  int first_page, last_page, slot;
  map.Locate(begin, &first_page, &slot);
  map.Locate(end - 1, &last_page, &slot);
  const int64_t n_blocks = last_page - first_page + 1;
  const PageStatsView stats{reinterpret_cast<const uint16_t*>(routing),
                            reinterpret_cast<const uint16_t*>(routing) + static_cast<int64_t>(heads) * P * d};
  uint8_t* routes = routing + Align8(PageStatsBytes(heads, d, P));
  const uint64_t item_bytes = RouteItemBytes(P);
  const std::vector<uint8_t> flags = RangeFlags(config.ranges);
  // Items are (page slot, head); a slot whose page is the partner of the one before it has no block
  // (its report stays zero).
  ParallelFor(threads, n_blocks * heads, [&](int64_t item) {
    const int lead = first_page + static_cast<int>(item / heads);
    const int h = static_cast<int>(item % heads);
    uint8_t* mem = routes + item * item_bytes;
    SparseReport* item_report = reinterpret_cast<SparseReport*>(mem + item_bytes - sizeof(SparseReport));
    *item_report = SparseReport{};
    if (!LeadsQueryBlock(kv.pages, P, lead)) return;
    const PageDesc& page = kv.pages[lead];
    const int64_t t0 = page.token_begin;
    const int n = QueryBlockRows(kv.pages, P, lead);
    int32_t* exact = reinterpret_cast<int32_t*>(mem);
    int32_t* pooled = exact + P;
    float* scores = reinterpret_cast<float*>(pooled + P);
    int32_t* order = reinterpret_cast<int32_t*>(scores + P);
    uint8_t* mark = reinterpret_cast<uint8_t*>(order + P);
    // The block's stored queries (bf16 in the workspace) and their mean.
    float q[kQueryBlock * kMaxHeadDimCpu];
    int32_t seq[kQueryBlock];
    int64_t pos[kQueryBlock];
    double acc[kMaxHeadDimCpu] = {};
    for (int i = 0; i < n; ++i) {
      const uint16_t* src = q_ws + (t0 + i - begin) * hd + static_cast<int64_t>(h) * d;
      for (int c = 0; c < d; ++c) {
        q[i * d + c] = Bf16ToFloat(src[c]);
        acc[c] += q[i * d + c];
      }
      seq[i] = page.seq_id;
      pos[i] = t0 + i;
    }
    float centroid[kMaxHeadDimCpu];
    for (int c = 0; c < d; ++c) centroid[c] = static_cast<float>(acc[c] / n);
    int n_exact = 0, n_pooled = 0;
    RoutePages(kv, stats, h, centroid, page.seq_id, t0, t0 + n - 1, attention, scale, flags,
               RouteScratch{scores, order, mark}, exact, &n_exact, pooled, &n_pooled, item_report);
    const RoutedPages routed{exact, n_exact, pooled, n_pooled};
    float o[kQueryTile * kMaxHeadDimCpu];
    for (int i0 = 0; i0 < n; i0 += kQueryTile) {
      const int count = std::min(kQueryTile, n - i0);
      AttendTileRouted(kv, stats, h, QueryTile{q + i0 * d, seq + i0, pos + i0, count}, attention.causal, scale,
                       mma, routed, o);
      for (int i = 0; i < count; ++i) {
        uint16_t* dst = out + (t0 + i0 + i) * hd + static_cast<int64_t>(h) * d;
        for (int c = 0; c < d; ++c) dst[c] = FloatToBf16(o[i * d + c]);
      }
    }
  });
  if (report != nullptr) {
    for (int64_t item = 0; item < n_blocks * heads; ++item) {
      const SparseReport* r = reinterpret_cast<const SparseReport*>(routes + (item + 1) * item_bytes - sizeof(SparseReport));
      report->visible_pages += r->visible_pages;
      report->exact_pages += r->exact_pages;
      report->pooled_pages += r->pooled_pages;
    }
  }
}

}  // namespace kvpack::cpu
