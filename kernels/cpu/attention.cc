#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/epilogue.h"
#include "kernels/cpu/layer.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/format.h"
#include "kernels/page_codec.h"
#include "kernels/rotation.h"
#include "kernels/transform_choice.h"
#include "kernels/visibility.h"

namespace kvpack::cpu {
namespace {

float Dot(const float* a, const float* b, int n) {
  constexpr int kLanes = 8;
  float s[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; i += kLanes) {  // d is a power of two ≥ 16
    for (int l = 0; l < kLanes; ++l) s[l] += a[i + l] * b[i + l];
  }
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// The FP8 path's view of an INT4 page's V rows (mma_path.h kFp8): centred codes, per-row factors g_j,
// offsets lo_j + 8·s_j and the page's unscale s_max / 256.
struct Fp8Page {
  int8_t centred[kPageTokens * kMaxHeadDimCpu];  // code − 8
  float g[kPageTokens];
  float offset[kPageTokens];
  float unscale = 0.0f;
};

void Fp8Operands(const uint8_t* v_bytes, int d, int valid, Fp8Page* page) {
  float s[kPageTokens], lo[kPageTokens];
  float s_max = 0.0f;
  for (int j = 0; j < valid; ++j) {
    IntegerPageRow(PageFormat::kInt4, v_bytes, d, j, page->centred + j * d, &s[j], &lo[j]);
    for (int c = 0; c < d; ++c) page->centred[j * d + c] = static_cast<int8_t>(page->centred[j * d + c] - 8);
    s_max = std::max(s_max, s[j]);
  }
  const float factor = Fp8PageFactor(s_max);
  for (int j = 0; j < valid; ++j) {
    page->g[j] = s[j] * factor;
    page->offset[j] = lo[j] + 8.0f * s[j];
  }
  page->unscale = s_max * (1.0f / kFp8PScale);
}

// One query's P·V over an INT4 page on the FP8 path: a[c] += unscale · Σ_j e4m3(e_j·g_j)·(code_jc − 8)
// (the page's own accumulator, exact here: e4m3 × small integers), *sum += Σ e_j; returns Σ e_j·offset_j.
// logits[j] = −∞ for masked keys; e_j = exp(logit_j − m).
float Fp8PageSum(const Fp8Page& page, const float* logits, float m, int valid, int d, float* a, float* sum) {
  float page_acc[kMaxHeadDimCpu];
  std::fill(page_acc, page_acc + d, 0.0f);
  float off = 0.0f, l = 0.0f;
  for (int j = 0; j < valid; ++j) {
    if (logits[j] == -std::numeric_limits<float>::infinity()) continue;
    const float e = expf(logits[j] - m);
    l += e;
    off += e * page.offset[j];
    const float p8 = Fp8E4m3Round(e * page.g[j]);
    const int8_t* codes = page.centred + j * d;
    for (int c = 0; c < d; ++c) page_acc[c] += p8 * static_cast<float>(codes[c]);
  }
  for (int c = 0; c < d; ++c) a[c] += page.unscale * page_acc[c];
  *sum += l;
  return off;
}

}  // namespace

int32_t IntDot(const int8_t* a, const int8_t* b, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<int32_t>(a[i]) * b[i];
  return s;
}

bool HasBf16Pages(const KvEntryView& kv) {
  for (int i = 0; i < kv.n_pages; ++i) {
    if (static_cast<PageFormat>(kv.pages[i].format) == PageFormat::kBf16) return true;
  }
  return false;
}

float EffectiveScale(const AttentionOptions& attention, int head_dim) {
  return attention.softmax_scale > 0.0f ? attention.softmax_scale : 1.0f / sqrtf(static_cast<float>(head_dim));
}

void BeginTile(const QueryTile& tile, int d, MmaPath mma, TileState* state) {
  const int n = tile.n;
  std::fill(state->m, state->m + n, -std::numeric_limits<float>::infinity());
  std::fill(state->l, state->l + n, 0.0f);
  std::fill(state->acc, state->acc + n * d, 0.0f);
  std::fill(state->v_off, state->v_off + n, 0.0f);
  state->mma = mma;
  if (!Int8Logits(mma)) return;
  for (int i = 0; i < n; ++i) {  // the queries as the INT8 path sees them (mma_path.h)
    const float* q = tile.q + i * d;
    float sum = 0.0f;
    for (int c = 0; c < d; ++c) sum += q[c];
    state->q_scale[i] = QuantizeQueryRow(q, d, state->q_codes + i * d).scale;
    state->q_sum[i] = sum;
  }
}

void FoldPage(const KvEntryView& kv, int head, const QueryTile& tile, const Visibility& visibility, float scale,
              int pg, TileState* state) {
  const int d = kv.head_dim;
  const int n = tile.n;
  float* m = state->m;
  float* l = state->l;
  float* acc = state->acc;
  float k_page[kPageTokens * kMaxHeadDimCpu];  // [64, d] decoded K̂
  float v_page[kPageTokens * kMaxHeadDimCpu];  // [64, d] decoded V̂
  float p[kPageTokens];                        // one query's probabilities for the page
  int8_t k_codes[kPageTokens * kMaxHeadDimCpu];  // the INT8 path: K rows as codes, row scale and offset
  float k_scale[kPageTokens], k_lo[kPageTokens];
  Fp8Page fp8;  // the FP8 path: the INT4 page's V as P·V operands
  const PageDesc& page = kv.pages[pg];
  bool seen = false;  // by some query of the tile (a page no query sees is skipped before its decode)
  for (int i = 0; i < n && !seen; ++i) seen = visibility.PageVisibleToRun(page, tile.seq_ids[i], tile.positions[i]);
  if (!seen) return;
  const PageFormat format = static_cast<PageFormat>(page.format);
  const int64_t index = static_cast<int64_t>(head) * kv.n_pages + pg;
  const uint8_t* k_bytes = kv.pool + kv.k_offsets[index];
  const uint8_t* v_bytes = kv.pool + kv.v_offsets[index];
  const int valid = page.n_valid;
  const bool int8_qk = Int8Logits(state->mma) && HasIntegerCodes(format);  // BF16 pages: bf16 MMAs
  const bool fp8_pv = state->mma == MmaPath::kFp8 && format == PageFormat::kInt4;
  for (int j = 0; j < valid; ++j) {
    if (int8_qk) {
      IntegerPageRow(format, k_bytes, d, j, k_codes + j * d, &k_scale[j], &k_lo[j]);
    } else {
      DecodePageRow(format, k_bytes, d, j, k_page + j * d);
    }
  }
  bool v_decoded = false;
  for (int i = 0; i < n; ++i) {
    const float* q = tile.q + i * d;
    float page_max = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < valid; ++j) {
      if (visibility.KeyVisible(page, j, tile.seq_ids[i], tile.positions[i])) {
        p[j] = int8_qk ? scale * (state->q_scale[i] * k_scale[j] *
                                      static_cast<float>(IntDot(state->q_codes + i * d, k_codes + j * d, d)) +
                                  state->q_sum[i] * k_lo[j])
                       : scale * Dot(q, k_page + j * d, d);
        page_max = std::max(page_max, p[j]);
      } else {
        p[j] = -std::numeric_limits<float>::infinity();
      }
    }
    if (page_max == -std::numeric_limits<float>::infinity()) continue;  // nothing visible
    if (!v_decoded) {
      if (fp8_pv) {
        Fp8Operands(v_bytes, d, valid, &fp8);
      } else {
        for (int j = 0; j < valid; ++j) DecodePageRow(format, v_bytes, d, j, v_page + j * d);
      }
      v_decoded = true;
    }
    const float m_new = std::max(m[i], page_max);
    const float alpha = expf(m[i] - m_new);  // exp(−inf) = 0 on the first visible page
    float* a = acc + i * d;
    float sum = 0.0f;
    for (int c = 0; c < d; ++c) a[c] *= alpha;
    if (fp8_pv) {
      state->v_off[i] = state->v_off[i] * alpha + Fp8PageSum(fp8, p, m_new, valid, d, a, &sum);
    } else {
      for (int j = 0; j < valid; ++j) {
        if (p[j] == -std::numeric_limits<float>::infinity()) continue;
        const float e = expf(p[j] - m_new);
        sum += e;
        const float* vr = v_page + j * d;
        for (int c = 0; c < d; ++c) a[c] += e * vr[c];
      }
    }
    l[i] = l[i] * alpha + sum;
    m[i] = m_new;
  }
}

void FinishTile(const KvEntryView& kv, int head, int n, const TileState& state, float* out) {
  // Normalise, un-rotate, undo V balancing, add μ_v back.
  const int d = kv.head_dim;
  const float* mu_v = kv.mu_v + static_cast<int64_t>(head) * d;
  const float* lambda_v = kv.lambda_v + static_cast<int64_t>(head) * d;
  for (int i = 0; i < n; ++i) {
    float* o = out + i * d;
    if (state.l[i] == 0.0f) {
      std::fill(o, o + d, 0.0f);
      continue;
    }
    const float inv = 1.0f / state.l[i];
    if (state.mma == MmaPath::kFp8) {
      for (int c = 0; c < d; ++c) o[c] = (state.acc[i * d + c] + state.v_off[i]) * inv;
    } else {
      for (int c = 0; c < d; ++c) o[c] = state.acc[i * d + c] * inv;
    }
    if (HeadRotatesV(kv.rotate, kv.head_flags, head)) RotateInverse(o, d, kv.seed);
    for (int c = 0; c < d; ++c) o[c] *= lambda_v[c];
    for (int c = 0; c < d; ++c) o[c] += mu_v[c];
  }
}

void AttendTile(const KvEntryView& kv, int head, const QueryTile& tile, bool causal, float scale, MmaPath mma,
                float* out) {
  // Preconditions: 1 ≤ tile.n ≤ kQueryTile, d ≤ kMaxHeadDimCpu.
  TileState state;
  BeginTile(tile, kv.head_dim, mma, &state);
  const Visibility visibility{causal};
  for (int pg = 0; pg < kv.n_pages; ++pg) FoldPage(kv, head, tile, visibility, scale, pg, &state);
  FinishTile(kv, head, tile.n, state, out);
}

Error AttendFloat(const KvEntryView& kv, const QueryBlock& queries, const AttentionOptions& attention,
                  float* out, const CpuOptions& options) {
  if (kv.head_dim < kMinHeadDimCpu || kv.head_dim > kMaxHeadDimCpu || !IsPowerOfTwo(kv.head_dim)) {
    return Unsupported("kv.head_dim = " + std::to_string(kv.head_dim) + " is not supported");
  }
  if (queries.n_q < 0 || (queries.n_q > 0 && (queries.q == nullptr || out == nullptr))) {
    return InvalidArgument("AttendFloat: queries.q and out must be set for n_q > 0");
  }
  const int d = kv.head_dim;
  const int heads = kv.n_heads;
  const float scale = EffectiveScale(attention, d);
  const MmaPath mma = ResolveMmaPath(attention.mma, HasBf16Pages(kv), kv.head_dim, kv.rotate);
  const int64_t n_tiles = (queries.n_q + kQueryTile - 1) / kQueryTile;
  ParallelFor(options.n_threads, n_tiles * heads, [&](int64_t item) {
    const int64_t first = (item / heads) * kQueryTile;
    const int h = static_cast<int>(item % heads);
    const int n = static_cast<int>(std::min<int64_t>(kQueryTile, queries.n_q - first));
    float q[kQueryTile * kMaxHeadDimCpu];
    float o[kQueryTile * kMaxHeadDimCpu];
    int32_t seq[kQueryTile];
    int64_t pos[kQueryTile];
    for (int i = 0; i < n; ++i) {
      const int64_t t = first + i;
      const float* src = queries.q + (t * heads + h) * d;
      std::copy(src, src + d, q + i * d);
      ToStoredQ(q + i * d, d, kv.lambda + static_cast<int64_t>(h) * d, HeadRotatesK(kv.rotate, kv.head_flags, h), kv.seed);
      seq[i] = queries.seq_ids ? queries.seq_ids[t] : 0;
      pos[i] = queries.positions ? queries.positions[t] : t;
    }
    AttendTile(kv, h, QueryTile{q, seq, pos, n}, attention.causal, scale, mma, o);
    for (int i = 0; i < n; ++i) std::copy(o + i * d, o + (i + 1) * d, out + ((first + i) * heads + h) * d);
  });
  return Error::Ok();
}

}  // namespace kvpack::cpu
