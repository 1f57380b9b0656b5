// The block-sparse path's page statistics and routing on the GPU (sparse.h), bit for bit the CPU's
// ComputePageStats and RoutePages (cpu/sparse_attention.cc): every sum runs in double in the CPU's
// order, and this file is compiled with --fmad=false (kernels/cuda/CMakeLists.txt) so that no
// multiply and add fuse where the host's code rounds twice.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/row_epilogue.h"  // kMaxHeadDimGpu
#include "kernels/cuda/sparse.h"
#include "kernels/mma_path.h"
#include "kernels/page_codec.h"
#include "kernels/sparse_plan.h"
#include "kernels/visibility.h"

namespace kvpack::cuda {
namespace {

constexpr int kRouteThreads = 256;
uint64_t AlignUp(uint64_t v) { return (v + 255) / 256 * 256; }

int SortSize(int n_pages) {
  int n = 1;
  while (n < n_pages) n <<= 1;
  return n;
}

// ── Statistics ──────────────────────────────────────────────────────────────────────────────────
// Channel c of row `slot` of a page, decoded as the codec's DecodeRow does (same float operations).
template <PageFormat F>
__device__ __forceinline__ float DecodeElement(const uint8_t* page, int d, int slot, int c) {
  using Codec = PageCodec<F>;
  const uint8_t* codes = page + slot * Codec::CodeBytes(d);
  if constexpr (F == PageFormat::kInt4) {
    Int4RowMeta m;
    memcpy(&m, page + MetaOffset(F, d) + slot * Codec::kMetaBytes, sizeof(m));
    return DecodeInt4(codes[c / 2], c & 1, m);
  } else if constexpr (F == PageFormat::kInt8) {
    Int8RowMeta m;
    memcpy(&m, page + MetaOffset(F, d) + slot * Codec::kMetaBytes, sizeof(m));
    return static_cast<float>(static_cast<int8_t>(codes[c])) * HalfToFloat(m.scale);
  } else if constexpr (F == PageFormat::kBf16) {
    uint16_t b;
    memcpy(&b, codes + 2 * c, 2);
    return Bf16ToFloat(b);
  } else {
    static_assert(kUnhandledFormat<F>, "a page format without an element decode");
  }
}

// One CTA per (page, head), one thread per channel: the slots in order, in double; rounded to float,
// then to bf16 (format.h's FloatToBf16, the CPU's very code). With mean_codes (the INT8 MMA path),
// the bf16 mean key is then quantized as a query row is (QueryScaleOf / QueryCode over the CTA's d
// values: the CPU's PooledKeyCodes): codes [H, P, d] int8 and s_k [H, P].
__global__ void PageStatsKernel(const KvEntryView kv, AttentionParams::Route route) {
  const int pg = blockIdx.x, h = blockIdx.y, c = threadIdx.x, d = kv.head_dim;
  const int64_t item = static_cast<int64_t>(h) * kv.n_pages + pg;
  const PageDesc page = kv.pages[pg];
  const uint8_t* k_bytes = kv.pool + kv.k_offsets[item];
  const uint8_t* v_bytes = kv.pool + kv.v_offsets[item];
  double k_acc = 0.0, v_acc = 0.0;
  DispatchFormat(static_cast<PageFormat>(page.format), [&](auto tag) {
    constexpr PageFormat F = decltype(tag)::kFormat;
    for (int j = 0; j < page.n_valid; ++j) {
      k_acc += DecodeElement<F>(k_bytes, d, j, c);
      v_acc += DecodeElement<F>(v_bytes, d, j, c);
    }
    return 0;
  });
  const uint16_t mean = FloatToBf16(static_cast<float>(k_acc / page.n_valid));
  route.mean_k[item * d + c] = mean;
  route.v_sum[item * d + c] = FloatToBf16(static_cast<float>(v_acc));
  if (route.mean_codes == nullptr) return;  // uniform: the bf16 path
  __shared__ float warp_max[kMaxHeadDimGpu / 32];
  const float x = Bf16ToFloat(mean);
  float amax = fabsf(x);
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  if ((c & 31) == 0) warp_max[c >> 5] = amax;
  __syncthreads();
  for (int w = 0; w < d / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  const QueryScale qs = QueryScaleOf(amax);
  route.mean_codes[item * d + c] = QueryCode(x, qs);
  if (c == 0) route.mean_scales[item] = qs.scale;
}

// ── Routing ─────────────────────────────────────────────────────────────────────────────────────
// Scores as sort keys: descending key order = descending score, ties to the lower page index (the
// CPU's comparator). −0 is +0 (they compare equal there). Key 0 = not visible (sorts last).
__device__ __forceinline__ uint32_t OrderedBits(float f) {
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float ScoreOfKey(unsigned long long key) {
  const uint32_t o = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
__device__ __forceinline__ int PageOfKey(unsigned long long key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

// Index of the page of sequence `seq` holding position `pos`, or −1 (the CPU's PageHolding).
__device__ int PageHolding(const KvEntryView& kv, int32_t seq, int64_t pos) {
  int lo = 0, hi = kv.n_pages;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (pos < kv.pages[mid].token_begin) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  if (lo == 0) return -1;
  const PageDesc& page = kv.pages[lo - 1];
  return page.seq_id == seq && pos < static_cast<int64_t>(page.token_begin) + page.n_valid ? lo - 1 : -1;
}

__device__ int TopKCount(float ratio, int n) {
  const double x = static_cast<double>(ratio) * n;
  const int k = static_cast<int>(ceil(x - 1e-6));
  return max(1, min(n, k));
}

// Descending bitonic sort of n (a power of two) keys in shared memory.
__device__ void SortDescending(unsigned long long* keys, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const unsigned long long a = keys[i], b = keys[ixj];
          if ((i & k) == 0 ? a < b : a > b) keys[i] = b, keys[ixj] = a;
        }
      }
      __syncthreads();
    }
  }
}

// The k largest of keys[0, n) (distinct where nonzero, 1 ≤ k ≤ the nonzero count), found a byte at a
// time from the top (radix select) instead of by sorting: they are the keys with key >> *shift ≥
// *prefix. Each round histograms the next byte of the keys that share the bytes chosen so far, and one
// warp finds the byte value where the count from the top reaches k; the search stops at the first byte
// whose bucket holds exactly the keys still wanted (so within 8 rounds: the keys are distinct).
// Every thread of the CTA calls it.
__device__ void SelectLargestKeys(const unsigned long long* keys, int n, int k, unsigned long long* prefix, int* shift) {
  __shared__ int hist[256];
  __shared__ unsigned long long chosen;  // the bytes chosen so far
  __shared__ int wanted, done;           // keys still wanted among those sharing them
  const int tid = threadIdx.x;
  if (tid == 0) chosen = 0, wanted = k, done = 0;
  for (int s = 56; s >= 0; s -= 8) {
    for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const unsigned long long high = chosen;
    for (int i = tid; i < n; i += blockDim.x) {
      const unsigned long long key = keys[i];
      if (key != 0 && (s == 56 || key >> (s + 8) == high)) atomicAdd(&hist[key >> s & 255], 1);
    }
    __syncthreads();
    if (tid < 32) {  // lane l: bytes 255 − 8l … 248 − 8l, counted from the top
      int own = 0;
      for (int j = 0; j < 8; ++j) own += hist[255 - 8 * tid - j];
      int above = own;  // inclusive scan over the lanes
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, above, o);
        if (tid >= o) above += v;
      }
      above -= own;  // keys in higher bytes than lane l's
      const int want = wanted;
      if (above < want && above + own >= want) {
        for (int j = 0; j < 8; ++j) {
          const int byte = 255 - 8 * tid - j, c = hist[byte];
          if (above + c >= want) {
            chosen = high << 8 | static_cast<unsigned long long>(byte);
            wanted = want - above;
            done = c == want - above;
            break;
          }
          above += c;
        }
      }
    }
    __syncthreads();
    if (done) {
      *prefix = chosen, *shift = s;
      return;
    }
  }
}

constexpr uint8_t kExact = 1, kVisible = 2;

// Centroids: one CTA per (page slot, head), one thread per channel — for a slot whose page leads a query
// block, the mean of the block's stored bf16 queries (its one or two pages' rows, contiguous), double
// sums in row order (the CPU's AttendChunkSparse); zeros for a partner page's slot (which ScoreKernel
// and RoutePagesKernel skip).
__global__ void CentroidKernel(const AttentionParams p, float* centroids) {
  const int b = blockIdx.x, h = blockIdx.y, c = threadIdx.x, d = p.kv.head_dim;
  const int lead = p.route.first_page + b;
  float* out = centroids + (static_cast<int64_t>(b) * p.kv.n_heads + h) * d + c;
  if (!LeadsQueryBlock(p.kv.pages, p.kv.n_pages, lead)) {
    *out = 0.0f;
    return;
  }
  const PageDesc block = p.kv.pages[lead];
  const int n = QueryBlockRows(p.kv.pages, p.kv.n_pages, lead);
  double acc = 0.0;
  for (int i = 0; i < n; ++i) {
    acc += Bf16ToFloat(p.q[(block.token_begin + i - p.q_token_begin) * p.q_stride + h * d + c]);
  }
  *out = static_cast<float>(acc / n);
}

// Dots centroid · mean_k of every (block, page) of a head: scores[b, h, pg] for each slot b whose page
// leads a block (the k-th such slot of the chunk is row k: partner slots, which no one reads, take no
// work), each a double sum over the channels in order of the float centroid times the bf16 mean key,
// rounded to float (the CPU's DotBf16), not yet scaled. A CTA takes kScoreBlocks blocks × kScorePages
// pages of one head (a thread whose four rows are past the chunk's last block skips the dots), kScoreChunk
// channels at a time through shared memory (as doubles, converted once as they are loaded), and each
// thread a 4 × 4 tile of scores: 8 shared loads per 16 double FMAs (four scores of one block per
// thread, 5 loads per 4 FMAs, took H3's routing to 29.6 ms where this takes 23.0, session 13 on the
// H100; one CTA per (block, head) reading every mean key took 0.2 s on H3's layer). Each score's sum
// still runs over the channels in order, so the scores are the same bits.
constexpr int kScoreBlocks = 32, kScorePages = 64, kScoreChunk = 32, kScoreTile = 4;
constexpr int kScoreThreads = (kScoreBlocks / kScoreTile) * (kScorePages / kScoreTile);  // 128
template <int kDim>
__global__ void __launch_bounds__(kScoreThreads) ScoreKernel(const AttentionParams p, const float* centroids, float* scores) {
  static_assert(kDim % kScoreChunk == 0, "whole channel chunks");
  constexpr int kPitch = kScoreChunk + 1;  // doubles per row: a warp's 16 key rows in distinct banks
  constexpr int kBlockStep = kScoreBlocks / kScoreTile, kPageStep = kScorePages / kScoreTile;  // 8, 16
  __shared__ double cen[kScoreBlocks][kPitch];
  __shared__ double keys[kScorePages][kPitch];
  __shared__ int slot_of[kScoreBlocks];  // row r: the slot of block b0 + r, or −1 past the last block
  const int b0 = blockIdx.x * kScoreBlocks, h = blockIdx.y, pg0 = blockIdx.z * kScorePages, tid = threadIdx.x;
  const int P = p.kv.n_pages, H = p.kv.n_heads;
  const int rb = tid / kPageStep, rp = tid % kPageStep;  // blocks rb + 8·i, pages rp + 16·j
  if (tid < 32) {  // warp 0 numbers the chunk's leading slots, 32 at a time
    for (int r = tid; r < kScoreBlocks; r += 32) slot_of[r] = -1;
    __syncwarp();
    int seen = 0;
    for (int base = 0; base < p.route.n_blocks; base += 32) {
      const int slot = base + tid;
      const bool lead = slot < p.route.n_blocks && LeadsQueryBlock(p.kv.pages, P, p.route.first_page + slot);
      const unsigned m = __ballot_sync(0xffffffffu, lead);
      const int k = seen + __popc(m & ((1u << tid) - 1u));
      if (lead && k >= b0 && k < b0 + kScoreBlocks) slot_of[k - b0] = slot;
      seen += __popc(m);
    }
  }
  __syncthreads();
  if (slot_of[0] < 0) return;  // past the chunk's last block (uniform)
  bool any_row = false;
#pragma unroll
  for (int i = 0; i < kScoreTile; ++i) any_row |= slot_of[rb + kBlockStep * i] >= 0;
  double acc[kScoreTile][kScoreTile] = {};
  for (int c0 = 0; c0 < kDim; c0 += kScoreChunk) {
    for (int u = tid; u < kScoreBlocks * kScoreChunk; u += kScoreThreads) {
      const int r = u / kScoreChunk, c = u % kScoreChunk, b = slot_of[r];
      cen[r][c] = b >= 0 ? centroids[(static_cast<int64_t>(b) * H + h) * kDim + c0 + c] : 0.0f;
    }
    for (int u = tid; u < kScorePages * kScoreChunk; u += kScoreThreads) {
      const int r = u / kScoreChunk, c = u % kScoreChunk;
      keys[r][c] = pg0 + r < P ? Bf16ToFloat(p.route.mean_k[(static_cast<int64_t>(h) * P + pg0 + r) * kDim + c0 + c]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < (any_row ? kScoreChunk : 0); ++c) {
      double x[kScoreTile], y[kScoreTile];
#pragma unroll
      for (int i = 0; i < kScoreTile; ++i) x[i] = cen[rb + kBlockStep * i][c], y[i] = keys[rp + kPageStep * i][c];
#pragma unroll
      for (int i = 0; i < kScoreTile; ++i) {
#pragma unroll
        for (int j = 0; j < kScoreTile; ++j) acc[i][j] += x[i] * y[j];
      }
    }
    __syncthreads();  // every thread is done with the chunk before the next one overwrites it
  }
#pragma unroll
  for (int i = 0; i < kScoreTile; ++i) {
    const int b = slot_of[rb + kBlockStep * i];
    if (b < 0) continue;
#pragma unroll
    for (int j = 0; j < kScoreTile; ++j) {
      const int pg = pg0 + rp + kPageStep * j;
      if (pg < P) scores[(static_cast<int64_t>(b) * H + h) * P + pg] = static_cast<float>(acc[i][j]);
    }
  }
}

// One CTA per (page slot, head) of the chunk; the slot of a partner page (no block) returns at once.
__global__ void __launch_bounds__(kRouteThreads) RoutePagesKernel(const SparseChunk chunk, const float* dots, int sort_size) {
  extern __shared__ unsigned long long keys[];                       // [sort_size]
  uint8_t* mark = reinterpret_cast<uint8_t*>(keys + sort_size);        // [P]: kExact | kVisible
  __shared__ int n_visible, n_marked;
  __shared__ unsigned long long tally[3];
  __shared__ double threshold;
  const AttentionParams& p = chunk.attention;
  const KvEntryView& kv = p.kv;
  const SparseOptions& sparse = chunk.options;
  const int P = kv.n_pages, tid = threadIdx.x;
  const int b = blockIdx.x, h = blockIdx.y;
  const int lead = chunk.attention.route.first_page + b;
  if (!LeadsQueryBlock(kv.pages, P, lead)) return;  // uniform over the CTA, before any barrier
  const PageDesc block = kv.pages[lead];
  const int32_t seq = block.seq_id;
  const int n = QueryBlockRows(kv.pages, P, lead);
  const int64_t first_pos = block.token_begin, last_pos = first_pos + n - 1;
  const Visibility visibility = p.visibility;
  auto flag_of = [&](int pg) -> uint8_t {
    const int r = kv.pages[pg].range_index;
    return r < chunk.n_ranges ? chunk.range_flags[r] : 0;
  };

  if (tid == 0) n_visible = 0, n_marked = 0, tally[0] = tally[1] = tally[2] = 0;
  __syncthreads();

  // Visible pages, scores, forced pages.
  const int diag_first = PageHolding(kv, seq, first_pos), diag_last = PageHolding(kv, seq, last_pos);
  const bool dense_block = diag_first >= 0 && (flag_of(diag_first) & kSparseRangeAttendDensely);
  const float* dot = dots + (static_cast<int64_t>(b) * kv.n_heads + h) * P;  // ScoreKernel's row
  for (int pg = tid; pg < sort_size; pg += blockDim.x) {
    unsigned long long key = 0;
    if (pg < P) {
      const PageDesc page = kv.pages[pg];
      uint8_t m = 0;
      if (visibility.PageVisibleToRun(page, seq, last_pos)) {
        const bool partial = !visibility.PageFullyVisibleToBlock(page, seq, first_pos);
        float score = INFINITY;
        if (!partial) score = p.softmax_scale * dot[pg];
        const bool near = (diag_first >= 0 && pg >= diag_first - 1 && pg <= diag_first + 1) ||
                          (diag_last >= 0 && pg >= diag_last - 1 && pg <= diag_last + 1);
        const bool forced = partial || dense_block || near || (flag_of(pg) & kSparseRangeAlwaysAttend);
        m = kVisible | (forced ? kExact : 0);
        key = (static_cast<unsigned long long>(OrderedBits(score)) << 32) | (0xffffffffu - static_cast<uint32_t>(pg));
        atomicAdd(&n_visible, 1);
      }
      mark[pg] = m;
    }
    keys[pg] = key;
  }
  __syncthreads();
  if (tid == 0) {  // the first sink_pages visible pages, in entry order
    int left = sparse.sink_pages;
    for (int pg = 0; pg < P && left > 0; ++pg) {
      if (mark[pg] & kVisible) mark[pg] |= kExact, --left;
    }
  }
  __syncthreads();  // the sinks
  const int nv = n_visible;
  bool sorted = false;
  if (nv > 0 && sparse.mode == SparseMode::kTopK) {  // the k best without a sort
    unsigned long long prefix = 0;
    int shift = 0;
    SelectLargestKeys(keys, P, TopKCount(sparse.topk_ratio, nv), &prefix, &shift);
    for (int pg = tid; pg < P; pg += blockDim.x) {
      if (keys[pg] != 0 && keys[pg] >> shift >= prefix) mark[pg] |= kExact;
    }
  } else if (nv > 0) {
    SortDescending(keys, sort_size);
    sorted = true;
    if (tid == 0) {  // over the fully visible pages, in score order (the CPU's sums)
      double sum = 0.0, sum2 = 0.0, top = -INFINITY;
      int scored = 0;
      for (int i = 0; i < nv; ++i) {
        const double s = ScoreOfKey(keys[i]);
        if (isinf(s)) continue;
        sum += s;
        sum2 += s * s;
        top = fmax(top, s);
        ++scored;
      }
      threshold = INFINITY;
      if (scored > 0) {
        const double mean = sum / scored;
        const double std_dev = sqrt(fmax(0.0, sum2 / scored - mean * mean));
        threshold = top - static_cast<double>(sparse.rel_tau) * std_dev;
      }
    }
    __syncthreads();
    for (int i = tid; i < nv; i += blockDim.x) {
      if (static_cast<double>(ScoreOfKey(keys[i])) >= threshold) mark[PageOfKey(keys[i])] |= kExact;
    }
  }
  __syncthreads();
  int mine = 0;
  for (int pg = tid; pg < P; pg += blockDim.x) mine += mark[pg] & kExact;
  atomicAdd(&n_marked, mine);
  __syncthreads();
  const int floor = min(sparse.min_exact_pages, nv);
  if (n_marked < floor && !sorted) SortDescending(keys, sort_size);  // the floor walks the score order
  if (tid == 0) {  // the floor: the best remaining pages
    int count = n_marked;
    for (int i = 0; i < nv && count < floor; ++i) {
      uint8_t& m = mark[PageOfKey(keys[i])];
      if (!(m & kExact)) m |= kExact, ++count;
    }
  }
  __syncthreads();

  // The two bitmasks and the tallies.
  const int64_t base = (static_cast<int64_t>(b) * kv.n_heads + h) * chunk.attention.route.words;
  unsigned long long counts[3] = {0, 0, 0};  // visible, exact, pooled
  for (int w = tid; w < chunk.attention.route.words; w += blockDim.x) {
    uint32_t exact = 0, pooled = 0;
    for (int bit = 0; bit < 32; ++bit) {
      const int pg = w * 32 + bit;
      if (pg >= P) break;
      const uint8_t m = mark[pg];
      if (m & kExact) {
        exact |= 1u << bit;
      } else if (sparse.tail && (m & kVisible)) {
        pooled |= 1u << bit;
      }
      counts[0] += (m & kVisible) ? 1 : 0;
    }
    counts[1] += __popc(exact);
    counts[2] += __popc(pooled);
    chunk.attention.route.exact_bits[base + w] = exact;
    chunk.attention.route.pooled_bits[base + w] = pooled;
  }
  for (int i = 0; i < 3; ++i) {
    if (counts[i]) atomicAdd(&tally[i], counts[i]);
  }
  __syncthreads();
  if (tid < 3) atomicAdd(&chunk.tallies[tid], tally[tid]);
}

}  // namespace

SparseRegion PlanSparseRegion(const LayerConfig& c) {
  SparseRegion r;
  if (!c.attention.sparse.enabled) return r;
  const uint64_t P = SparsePageCount(c), H = c.shape.n_heads, d = c.shape.head_dim;
  const uint64_t blocks = SparseBlocksPerChunk(c);
  const bool codes = Int8Logits(ConfigMmaPath(c));
  r.codes = codes;
  r.words = static_cast<int>((P + 31) / 32);
  r.mean_k = 0;
  r.v_sum = AlignUp(r.mean_k + H * P * d * sizeof(uint16_t));
  r.mean_codes = AlignUp(r.v_sum + H * P * d * sizeof(uint16_t));
  r.mean_scales = AlignUp(r.mean_codes + (codes ? H * P * d : 0));
  r.flags = AlignUp(r.mean_scales + (codes ? H * P * sizeof(float) : 0));
  r.leads = AlignUp(r.flags + c.ranges.size());
  r.exact_bits = AlignUp(r.leads + P * sizeof(int32_t));
  r.pooled_bits = AlignUp(r.exact_bits + blocks * H * r.words * sizeof(uint32_t));
  r.tallies = AlignUp(r.pooled_bits + blocks * H * r.words * sizeof(uint32_t));
  r.centroids = AlignUp(r.tallies + 3 * sizeof(unsigned long long));
  r.scores = AlignUp(r.centroids + blocks * H * d * sizeof(float));
  r.end = AlignUp(r.scores + blocks * H * P * sizeof(float));
  return r;
}

void BindSparseRegion(const SparseRegion& r, uint8_t* region, SparseChunk* chunk) {
  AttentionParams::Route& route = chunk->attention.route;
  route.mean_k = reinterpret_cast<uint16_t*>(region + r.mean_k);
  route.v_sum = reinterpret_cast<uint16_t*>(region + r.v_sum);
  const bool codes = r.codes;
  route.mean_codes = codes ? reinterpret_cast<int8_t*>(region + r.mean_codes) : nullptr;
  route.mean_scales = codes ? reinterpret_cast<float*>(region + r.mean_scales) : nullptr;
  route.exact_bits = reinterpret_cast<uint32_t*>(region + r.exact_bits);
  route.pooled_bits = reinterpret_cast<uint32_t*>(region + r.pooled_bits);
  route.words = r.words;
  chunk->range_flags = region + r.flags;
  chunk->lead_table = reinterpret_cast<int32_t*>(region + r.leads);
  chunk->tallies = reinterpret_cast<unsigned long long*>(region + r.tallies);
  chunk->centroids = reinterpret_cast<float*>(region + r.centroids);
  chunk->scores = reinterpret_cast<float*>(region + r.scores);
}

Error SparseSupported(const LayerConfig& c) {
  KVPACK_RETURN_IF_ERROR(ValidateSparse(c.attention.sparse));
  const int64_t pages = SparsePageCount(c);
  if (pages > kMaxSparsePagesGpu) {
    return Unsupported("sparse attention on the GPU: the entry has " + std::to_string(pages) + " pages, more than " +
                       std::to_string(kMaxSparsePagesGpu) + " (" + std::to_string(int64_t{kMaxSparsePagesGpu} * kPageTokens) +
                       " tokens)");
  }
  return Error::Ok();
}

Error LaunchPageStats(const KvEntryView& kv, const AttentionParams::Route& route, cudaStream_t stream) {
  if (kv.n_pages <= 0) return Error::Ok();
  if (kv.head_dim % 32 != 0 || kv.head_dim > kMaxHeadDimGpu) return Unsupported("sparse attention: head_dim must be 64 or 128");
  PageStatsKernel<<<dim3(kv.n_pages, kv.n_heads), kv.head_dim, 0, stream>>>(kv, route);
  KVPACK_CUDA_RETURN_LAUNCH("sparse page statistics");
  return Error::Ok();
}

Error LaunchRoutePages(const SparseChunk& chunk, cudaStream_t stream) {
  const AttentionParams& a = chunk.attention;
  const int blocks = a.route.n_blocks, P = a.kv.n_pages, H = a.kv.n_heads, d = a.kv.head_dim;
  if (blocks <= 0) return Error::Ok();
  if (P > kMaxSparsePagesGpu) return Unsupported("sparse attention on the GPU: too many pages");
  CentroidKernel<<<dim3(blocks, H), d, 0, stream>>>(a, chunk.centroids);
  KVPACK_CUDA_RETURN_LAUNCH("sparse centroids");
  const dim3 tiles((blocks + kScoreBlocks - 1) / kScoreBlocks, H, (P + kScorePages - 1) / kScorePages);
  if (d == 128) {
    ScoreKernel<128><<<tiles, kScoreThreads, 0, stream>>>(a, chunk.centroids, chunk.scores);
  } else if (d == 64) {
    ScoreKernel<64><<<tiles, kScoreThreads, 0, stream>>>(a, chunk.centroids, chunk.scores);
  } else {
    return Unsupported("sparse attention: head_dim must be 64 or 128");
  }
  KVPACK_CUDA_RETURN_LAUNCH("sparse scores");
  const int smem = SparseRouteSharedBytes(P);
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(RoutePagesKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  RoutePagesKernel<<<dim3(blocks, H), kRouteThreads, smem, stream>>>(chunk, chunk.scores, SortSize(P));
  KVPACK_CUDA_RETURN_LAUNCH("sparse routing");
  return Error::Ok();
}

}  // namespace kvpack::cuda
