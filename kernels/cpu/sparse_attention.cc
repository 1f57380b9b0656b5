#include "kernels/cpu/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/epilogue.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/format.h"
#include "kernels/rotation.h"
#include "kernels/transform_choice.h"

namespace kvpack::cpu {
namespace {

// a · b for a bf16 statistic b: double sum in channel order, rounded to float once (the GPU's
// ScoreKernel reads the same bf16 values and sums the same way, so scores agree bit for bit).
float DotBf16(const float* a, const uint16_t* b, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(a[i]) * Bf16ToFloat(b[i]);
  return static_cast<float>(s);
}

// Index of the page of sequence `seq` holding position `pos`, or −1. Pages are in ascending
// token_begin (ranges tile [0, N) in order).
int PageHolding(const KvEntryView& kv, int32_t seq, int64_t pos) {
  const PageDesc* end = kv.pages + kv.n_pages;
  const PageDesc* it =
      std::upper_bound(kv.pages, end, pos, [](int64_t p, const PageDesc& page) { return p < page.token_begin; });
  if (it == kv.pages) return -1;
  --it;
  if (it->seq_id != seq || pos >= static_cast<int64_t>(it->token_begin) + it->n_valid) return -1;
  return static_cast<int>(it - kv.pages);
}

// Top-k count: ceil(ratio · n), at least 1; a product within 1e-6 of an integer counts as that
// integer (0.2f is slightly above 0.2, and 0.2 of 10 pages is 2).
int TopKCount(float ratio, int n) {
  const double x = static_cast<double>(ratio) * n;
  return std::max(1, std::min(n, static_cast<int>(std::ceil(x - 1e-6))));
}

// Folds one pooled page into query i's softmax state: n tokens of logit s and value v_sum / n.
void FoldPooled(TileState* state, int i, int d, float s, float count, const uint16_t* v_sum) {
  const float m_new = std::max(state->m[i], s);
  const float alpha = expf(state->m[i] - m_new);
  const float e = expf(s - m_new);
  float* a = state->acc + i * d;
  for (int c = 0; c < d; ++c) a[c] = a[c] * alpha + e * Bf16ToFloat(v_sum[c]);
  state->l[i] = state->l[i] * alpha + count * e;
  state->v_off[i] *= alpha;
  state->m[i] = m_new;
}

}  // namespace

float PooledKeyCodes(const uint16_t* mean_k, int d, int8_t* codes) {
  float k[kMaxHeadDimCpu];
  for (int c = 0; c < d; ++c) k[c] = Bf16ToFloat(mean_k[c]);
  return QuantizeQueryRow(k, d, codes).scale;
}

uint64_t PageStatsBytes(int n_heads, int head_dim, int n_pages) {
  return 2ull * sizeof(uint16_t) * static_cast<uint64_t>(n_heads) * static_cast<uint64_t>(n_pages) *
         static_cast<uint64_t>(head_dim);
}

std::vector<uint8_t> RangeFlags(const std::vector<TokenRange>& ranges) {
  std::vector<uint8_t> flags(ranges.size(), 0);
  for (size_t r = 0; r < ranges.size(); ++r) {
    flags[r] = static_cast<uint8_t>((ranges[r].always_attend ? kRangeAlwaysAttend : 0) |
                                    (ranges[r].attend_densely ? kRangeAttendDensely : 0));
  }
  return flags;
}

int64_t QueryBlockEnd(const KvEntryView& kv, const int32_t* seq_ids, const int64_t* positions, int64_t n_q,
                      int64_t first) {
  auto seq = [&](int64_t i) { return seq_ids ? seq_ids[i] : 0; };
  auto pos = [&](int64_t i) { return positions ? positions[i] : i; };
  // The block's pages: the one holding the first query, and its partner when it leads a pair.
  const int page = PageHolding(kv, seq(first), pos(first));
  const int partner = page >= 0 && PairsWithNext(kv.pages, kv.n_pages, page) ? page + 1 : -2;
  int64_t end = first + 1;
  while (end < n_q && end - first < kQueryBlock && seq(end) == seq(first)) {
    const int at = PageHolding(kv, seq(end), pos(end));
    if (at != page && at != partner) break;
    ++end;
  }
  return end;
}

void StoredBlockQueries(const KvEntryView& kv, int head, const float* q, int64_t first, int n, float* stored,
                        float* centroid) {
  const int d = kv.head_dim;
  double acc[kMaxHeadDimCpu] = {};
  for (int i = 0; i < n; ++i) {
    const float* src = q + ((first + i) * kv.n_heads + head) * d;
    float* row = stored + i * d;
    std::copy(src, src + d, row);
    ToStoredQ(row, d, kv.lambda + static_cast<int64_t>(head) * d, HeadRotatesK(kv.rotate, kv.head_flags, head), kv.seed);
    for (int c = 0; c < d; ++c) acc[c] += row[c];
  }
  for (int c = 0; c < d; ++c) centroid[c] = static_cast<float>(acc[c] / n);
}

void RoutePages(const KvEntryView& kv, const PageStatsView& stats, int head, const float* centroid, int32_t seq,
                int64_t first_pos, int64_t last_pos, const AttentionOptions& attention, float scale,
                const std::vector<uint8_t>& range_flags, const RouteScratch& scratch, int32_t* exact, int* n_exact,
                int32_t* pooled, int* n_pooled, SparseReport* report) {
  const SparseOptions& sparse = attention.sparse;
  const Visibility visibility{attention.causal};
  const int d = kv.head_dim;
  const int P = kv.n_pages;
  auto flag_of = [&](int pg) -> uint8_t {
    const int r = kv.pages[pg].range_index;
    return r < static_cast<int>(range_flags.size()) ? range_flags[r] : 0;
  };
  // The block's diagonal: pages holding its first and last positions (one block never spans more
  // than two pages of its sequence), ±1.
  const int diag_first = PageHolding(kv, seq, first_pos);
  const int diag_last = PageHolding(kv, seq, last_pos);
  const bool dense_block = diag_first >= 0 && (flag_of(diag_first) & kRangeAttendDensely);
  auto near_diagonal = [&](int pg) {
    for (int diag : {diag_first, diag_last}) {
      if (diag >= 0 && pg >= diag - 1 && pg <= diag + 1) return true;
    }
    return false;
  };

  // Visible pages, their scores, and what is exact whatever the scores say (mark 1).
  const uint16_t* mean_k = stats.mean_k + static_cast<int64_t>(head) * P * d;
  int n_visible = 0;
  int sinks_left = sparse.sink_pages;
  for (int pg = 0; pg < P; ++pg) {
    const PageDesc& page = kv.pages[pg];
    scratch.mark[pg] = 0;
    if (!visibility.PageVisibleToRun(page, seq, last_pos)) continue;
    scratch.order[n_visible++] = pg;
    // A page seen in part is exact and ranks first: its mean holds keys the block must not see
    // (causal, masked slots), so it must not move any other page's routing.
    const bool partial = !visibility.PageFullyVisibleToBlock(page, seq, first_pos);
    scratch.scores[pg] = partial ? std::numeric_limits<float>::infinity()
                                 : scale * DotBf16(centroid, mean_k + static_cast<int64_t>(pg) * d, d);
    bool forced = partial || dense_block || near_diagonal(pg) || (flag_of(pg) & kRangeAlwaysAttend);
    if (sinks_left > 0) {
      forced = true;
      --sinks_left;
    }
    if (forced) scratch.mark[pg] = 1;
  }
  // Best first, ties to the lower index.
  std::sort(scratch.order, scratch.order + n_visible, [&](int32_t a, int32_t b) {
    return scratch.scores[a] != scratch.scores[b] ? scratch.scores[a] > scratch.scores[b] : a < b;
  });
  if (n_visible > 0) {
    if (sparse.mode == SparseMode::kTopK) {
      const int k = TopKCount(sparse.topk_ratio, n_visible);
      for (int i = 0; i < k; ++i) scratch.mark[scratch.order[i]] = 1;
    } else {
      // Over the fully visible pages (the partial ones, scored +inf, are exact already).
      double sum = 0.0, sum2 = 0.0, top = -std::numeric_limits<double>::infinity();
      int scored = 0;
      for (int i = 0; i < n_visible; ++i) {
        const double s = scratch.scores[scratch.order[i]];
        if (std::isinf(s)) continue;
        sum += s;
        sum2 += s * s;
        top = std::max(top, s);
        ++scored;
      }
      if (scored > 0) {
        const double mean = sum / scored;
        const double std_dev = std::sqrt(std::max(0.0, sum2 / scored - mean * mean));
        const double threshold = top - static_cast<double>(sparse.rel_tau) * std_dev;
        for (int i = 0; i < n_visible && scratch.scores[scratch.order[i]] >= threshold; ++i) {
          scratch.mark[scratch.order[i]] = 1;
        }
      }
    }
  }
  int count = 0;
  for (int i = 0; i < n_visible; ++i) count += scratch.mark[scratch.order[i]];
  const int floor = std::min(sparse.min_exact_pages, n_visible);
  for (int i = 0; i < n_visible && count < floor; ++i) {
    if (!scratch.mark[scratch.order[i]]) {
      scratch.mark[scratch.order[i]] = 1;
      ++count;
    }
  }
  // The lists, ascending.
  *n_exact = 0;
  *n_pooled = 0;
  for (int pg = 0; pg < P; ++pg) {
    if (scratch.mark[pg]) {
      exact[(*n_exact)++] = pg;
    } else if (sparse.tail && visibility.PageVisibleToRun(kv.pages[pg], seq, last_pos)) {
      pooled[(*n_pooled)++] = pg;
    }
  }
  if (report != nullptr) {
    report->visible_pages += n_visible;
    report->exact_pages += *n_exact;
    report->pooled_pages += *n_pooled;
  }
}

void AttendTileRouted(const KvEntryView& kv, const PageStatsView& stats, int head, const QueryTile& tile, bool causal,
                      float scale, MmaPath mma, const RoutedPages& routed, float* out) {
  const int d = kv.head_dim;
  const int64_t P = kv.n_pages;
  TileState state;
  BeginTile(tile, d, mma, &state);
  const Visibility visibility{causal};
  for (int i = 0; i < routed.n_exact; ++i) FoldPage(kv, head, tile, visibility, scale, routed.exact[i], &state);
  const uint16_t* mean_k = stats.mean_k + head * P * d;
  const uint16_t* v_sum = stats.v_sum + head * P * d;
  for (int i = 0; i < routed.n_pooled; ++i) {
    const int64_t pg = routed.pooled[i];
    const float count = static_cast<float>(kv.pages[pg].n_valid);
    int8_t k_codes[kMaxHeadDimCpu];
    float k_scale = 0.0f;
    if (Int8Logits(mma)) k_scale = PooledKeyCodes(mean_k + pg * d, d, k_codes);
    for (int q = 0; q < tile.n; ++q) {
      const float s = Int8Logits(mma)
                          ? scale * (state.q_scale[q] * k_scale * static_cast<float>(IntDot(state.q_codes + q * d, k_codes, d)))
                          : scale * DotBf16(tile.q + q * d, mean_k + pg * d, d);
      FoldPooled(&state, q, d, s, count, v_sum + pg * d);
    }
  }
  FinishTile(kv, head, tile.n, state, out);
}

Error SparseAttendFloat(const KvEntryView& kv, const QueryBlock& queries, const AttentionOptions& attention,
                        const std::vector<TokenRange>& ranges, float* out, const CpuOptions& options,
                        SparseReport* report) {
  if (!attention.sparse.enabled) return InvalidArgument("SparseAttendFloat: attention.sparse.enabled is not set");
  if (Error e = ValidateSparse(attention.sparse); !e.ok()) return e;
  if (kv.head_dim < kMinHeadDimCpu || kv.head_dim > kMaxHeadDimCpu || !IsPowerOfTwo(kv.head_dim)) {
    return Unsupported("kv.head_dim = " + std::to_string(kv.head_dim) + " is not supported");
  }
  if (queries.n_q < 0 || (queries.n_q > 0 && (queries.q == nullptr || out == nullptr))) {
    return InvalidArgument("SparseAttendFloat: queries.q and out must be set for n_q > 0");
  }
  const int d = kv.head_dim;
  const int heads = kv.n_heads;
  const int64_t P = kv.n_pages;
  const float scale = EffectiveScale(attention, d);
  const MmaPath mma = ResolveMmaPath(attention.mma, HasBf16Pages(kv), d, kv.rotate);
  std::vector<uint16_t> mean_k(static_cast<size_t>(heads) * P * d), v_sum(mean_k.size());
  ComputePageStats(kv, mean_k.data(), v_sum.data(), options);
  const PageStatsView stats{mean_k.data(), v_sum.data()};
  const std::vector<uint8_t> flags = RangeFlags(ranges);

  std::vector<int64_t> block_begin;  // evaluation code: O(n_q / 64) is fine here
  for (int64_t b = 0; b < queries.n_q; b = QueryBlockEnd(kv, queries.seq_ids, queries.positions, queries.n_q, b)) {
    block_begin.push_back(b);
  }
  block_begin.push_back(queries.n_q);
  const int64_t n_blocks = static_cast<int64_t>(block_begin.size()) - 1;
  std::vector<SparseReport> reports(static_cast<size_t>(n_blocks * heads));
  ParallelFor(options.n_threads, n_blocks * heads, [&](int64_t item) {
    const int64_t b = item / heads;
    const int h = static_cast<int>(item % heads);
    const int64_t first = block_begin[b];
    const int n = static_cast<int>(block_begin[b + 1] - first);
    float q[kQueryBlock * kMaxHeadDimCpu];
    int32_t seq[kQueryBlock];
    int64_t pos[kQueryBlock];
    for (int i = 0; i < n; ++i) {
      const int64_t t = first + i;
      seq[i] = queries.seq_ids ? queries.seq_ids[t] : 0;
      pos[i] = queries.positions ? queries.positions[t] : t;
    }
    float centroid[kMaxHeadDimCpu];
    StoredBlockQueries(kv, h, queries.q, first, n, q, centroid);
    const int64_t last_pos = *std::max_element(pos, pos + n);
    const int64_t first_pos = *std::min_element(pos, pos + n);
    std::vector<float> scores(P);
    std::vector<int32_t> order(P), exact(P), pooled(P);
    std::vector<uint8_t> mark(P);
    int n_exact = 0, n_pooled = 0;
    RoutePages(kv, stats, h, centroid, seq[0], first_pos, last_pos, attention, scale, flags,
               RouteScratch{scores.data(), order.data(), mark.data()}, exact.data(), &n_exact, pooled.data(),
               &n_pooled, &reports[item]);
    const RoutedPages routed{exact.data(), n_exact, pooled.data(), n_pooled};
    float o[kQueryTile * kMaxHeadDimCpu];
    for (int t0 = 0; t0 < n; t0 += kQueryTile) {
      const int count = std::min(kQueryTile, n - t0);
      AttendTileRouted(kv, stats, h, QueryTile{q + t0 * d, seq + t0, pos + t0, count}, attention.causal, scale,
                       mma, routed, o);
      for (int i = 0; i < count; ++i) std::copy(o + i * d, o + (i + 1) * d, out + ((first + t0 + i) * heads + h) * d);
    }
  });
  if (report != nullptr) {
    for (const SparseReport& r : reports) {
      report->visible_pages += r.visible_pages;
      report->exact_pages += r.exact_pages;
      report->pooled_pages += r.pooled_pages;
    }
  }
  return Error::Ok();
}

}  // namespace kvpack::cpu
