#include "kernels/cuda/head_choice.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/pack.h"
#include "kernels/cpu/stats.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/transform_choice.h"
#include "kernels/transform_select.h"

namespace kvpack::cuda {
namespace {

constexpr uint64_t kAlign = 256;
uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Pieces of the choice's scratch, byte offsets from its start.
struct ChoiceScratch {
  int64_t n_sample = 0, n_keys = 0, n_queries = 0;
  uint64_t key_index = 0, query_token = 0, gathered = 0, projected = 0, queries = 0, keys = 0, formats = 0;
  uint64_t end = 0;
};

ChoiceScratch PlanChoiceScratch(const LayerConfig& c) {
  ChoiceScratch p;
  p.n_sample = cpu::StatsSampleCount(c.shape.n_tokens, c.transforms);
  p.n_keys = EstimateKeyCount(p.n_sample);
  p.n_queries = EstimateQueryCount(p.n_sample);
  const uint64_t hd = c.shape.HeadCols(), nq = p.n_queries;
  const bool gemm = !c.projected.enabled;
  p.key_index = 0;
  p.query_token = AlignUp(p.key_index + p.n_keys * sizeof(int64_t));
  p.gathered = AlignUp(p.query_token + nq * sizeof(int64_t));
  p.projected = AlignUp(p.gathered + (gemm ? nq * c.shape.hidden * 2 : 0));
  p.queries = AlignUp(p.projected + (gemm ? nq * hd * 2 : 0));
  p.keys = AlignUp(p.queries + nq * hd * sizeof(float));
  p.formats = AlignUp(p.keys + p.n_keys * 2 * hd * sizeof(float));
  p.end = AlignUp(p.formats + p.n_keys);
  return p;
}

}  // namespace

bool ChoosesPerHead(const LayerConfig& c) {
  return c.transforms.choose_per_head && c.stats == nullptr && (c.transforms.smooth || c.transforms.balance);
}

uint64_t ChoiceScratchBytes(const LayerConfig& c) { return ChoosesPerHead(c) ? PlanChoiceScratch(c).end : 0; }

uint64_t ChoiceEstimateBytes(const LayerConfig& c) {
  if (!ChoosesPerHead(c)) return 0;
  const ChoiceScratch p = PlanChoiceScratch(c);
  return static_cast<uint64_t>(c.shape.n_heads) *
         HeadEstimateBytes(static_cast<int>(p.n_queries), static_cast<int>(p.n_keys), c.shape.head_dim);
}

EstimateSampleRows PlanEstimateSample(const LayerConfig& c) {
  const int64_t n = c.shape.n_tokens, s = cpu::StatsSampleCount(n, c.transforms);
  EstimateSampleRows r;
  r.n_sample = s;
  r.key_index.resize(EstimateKeyCount(s));
  r.query_token.resize(EstimateQueryCount(s));
  for (size_t j = 0; j < r.key_index.size(); ++j) r.key_index[j] = EstimateKeyIndex(static_cast<int64_t>(j), s);
  for (size_t i = 0; i < r.query_token.size(); ++i) {
    r.query_token[i] = cpu::StatsSampleToken(EstimateQueryIndex(static_cast<int64_t>(i), s), n, s);
  }
  return r;
}

cpu::TransformRecord ChooseFromEstimateSample(const LayerConfig& c, const EstimateSampleRows& rows,
                                              const float* keys, const float* queries, KvStats* stats) {
  const int64_t n = c.shape.n_tokens, s = rows.n_sample, hd = c.shape.HeadCols();
  const int d = c.shape.head_dim;
  std::vector<int64_t> key_slot(s, -1), query_slot(s, -1);  // sample index → row of keys / queries
  for (size_t j = 0; j < rows.key_index.size(); ++j) key_slot[rows.key_index[j]] = static_cast<int64_t>(j);
  for (size_t i = 0; i < rows.query_token.size(); ++i) {
    query_slot[EstimateQueryIndex(static_cast<int64_t>(i), s)] = static_cast<int64_t>(i);
  }
  const cpu::SampleRowFn key_row = [&](int64_t i, int h, float* k_row, float* v_row) {
    const float* row = keys + key_slot[i] * 2 * hd + static_cast<int64_t>(h) * d;
    std::copy(row, row + d, k_row);
    std::copy(row + hd, row + hd + d, v_row);
  };
  const cpu::QueryRowFn query_row = [&](int64_t i, int h, float* q_row) {
    const float* row = queries + query_slot[i] * hd + static_cast<int64_t>(h) * d;
    std::copy(row, row + d, q_row);
  };
  const cpu::TokenPageMap ranges(c.ranges);
  return cpu::ChooseTransforms(
      s, s, c.shape, ChoiceTransforms(c), c.attention.softmax_scale, key_row, query_row,
      [&](int64_t i) { return c.ranges[ranges.RangeOf(cpu::StatsSampleToken(i, n, s))].format; }, stats,
      /*n_threads=*/0);
}

Error ChooseHeadTransformsFromDevice(const LayerConfig& c, const LayerTensors& t, const RowEpilogueParams& base,
                                     const float* sample, const KvLayout& layout, uint8_t* kv, uint8_t* scratch,
                                     uint8_t* estimate_scratch, cublasLtHandle_t blas, void* blas_workspace,
                                     cudaStream_t stream) {
  const ChoiceScratch sp = PlanChoiceScratch(c);
  const int64_t hd = c.shape.HeadCols(), hidden = c.shape.hidden;
  int64_t* d_key_index = reinterpret_cast<int64_t*>(scratch + sp.key_index);
  int64_t* d_query_token = reinterpret_cast<int64_t*>(scratch + sp.query_token);
  float* d_queries = reinterpret_cast<float*>(scratch + sp.queries);
  float* d_keys = reinterpret_cast<float*>(scratch + sp.keys);

  // ── 1. Keys: rows of the pre-pass sample ──────────────────────────────────────────────────────
  const EstimateSampleRows rows = PlanEstimateSample(c);
  KVPACK_CUDA_RETURN(cudaMemcpyAsync(d_key_index, rows.key_index.data(), rows.key_index.size() * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream));
  KVPACK_CUDA_RETURN(cudaMemcpyAsync(d_query_token, rows.query_token.data(),
                                     rows.query_token.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
  // A float row of 2·H·d values moves as 4·H·d 16-bit halves: the gather copies bytes, 16 at a time.
  KVPACK_RETURN_IF_ERROR(LaunchGatherRows(reinterpret_cast<const uint16_t*>(sample), 4 * hd, d_key_index, sp.n_keys,
                                          reinterpret_cast<uint16_t*>(d_keys), stream));

  // ── 2. Queries: projected here (x + W) or the caller's rows, then bias / QK-norm / RoPE ────────
  RowEpilogueParams p = base;
  // Its own GEMM object (the layer's keeps the algorithm of the K/V shapes); cuBLASLt has taken what
  // it needs from the descriptors when Run returns.
  BlasGemm gemm(blas, blas_workspace);
  if (c.projected.enabled) {
    p.given[0] = t.q, p.given_layout = c.projected;
  } else {
    uint16_t* gathered = reinterpret_cast<uint16_t*>(scratch + sp.gathered);
    uint16_t* projected = reinterpret_cast<uint16_t*>(scratch + sp.projected);
    KVPACK_RETURN_IF_ERROR(LaunchGatherRows(t.x, hidden, d_query_token, sp.n_queries, gathered, stream));
    GemmArgs g;
    g.a = gathered, g.lda = hidden;
    g.b = t.w_qkv, g.ldb = hidden;  // rows [q] of W
    g.c = projected, g.ldc = hd;
    g.m = sp.n_queries, g.n = hd, g.k = hidden;
    KVPACK_RETURN_IF_ERROR(gemm.Run(g, stream));
    p.in = projected, p.in_stride = hd;
  }
  p.n_rows = sp.n_queries, p.token_index = d_query_token;
  p.out_float = d_queries;
  KVPACK_RETURN_IF_ERROR(LaunchRowEpilogue(RowMode::kQuerySample, p, stream));

  // ── 3–5. The choice on the device (head_estimate.cu): the decision of ChooseHeadTransforms on
  // the same rows, written into the entry; nothing comes back to the host, nothing synchronises ──
  const cpu::TokenPageMap ranges(c.ranges);
  std::vector<uint8_t> formats(rows.key_index.size());
  for (size_t j = 0; j < formats.size(); ++j) {
    const int64_t token = cpu::StatsSampleToken(rows.key_index[j], c.shape.n_tokens, rows.n_sample);
    formats[j] = static_cast<uint8_t>(c.ranges[ranges.RangeOf(token)].format);
  }
  uint8_t* d_formats = scratch + sp.formats;
  KVPACK_CUDA_RETURN(cudaMemcpyAsync(d_formats, formats.data(), formats.size(), cudaMemcpyHostToDevice, stream));
  // The record's bytes (flags, estimates, padding) start from zero, as the host layer writes them.
  KVPACK_CUDA_RETURN(cudaMemsetAsync(kv + layout.head_flags_offset, 0, layout.total_bytes - layout.head_flags_offset,
                                     stream));
  HeadEstimateArgs a;
  a.queries = d_queries, a.q_stride = hd;
  a.keys = d_keys, a.kv_stride = 2 * hd;
  a.formats = d_formats;
  a.n_q = static_cast<int>(sp.n_queries), a.n_k = static_cast<int>(sp.n_keys), a.d = c.shape.head_dim;
  a.scale = EstimateSoftmaxScale(c.attention.softmax_scale, c.shape.head_dim);
  a.rotate = c.transforms.rotate, a.seed = c.transforms.seed;
  a.transforms = ChoiceTransforms(c);
  a.kv = kv;
  a.mu_k_offset = layout.mu_k_offset, a.mu_v_offset = layout.mu_v_offset;
  a.lambda_offset = layout.lambda_offset, a.lambda_v_offset = layout.lambda_v_offset;
  a.head_flags_offset = layout.head_flags_offset, a.head_estimates_offset = layout.head_estimates_offset;
  a.scratch = estimate_scratch;  // may be `sample`'s bytes: the keys were gathered from it above
  KVPACK_RETURN_IF_ERROR(LaunchHeadEstimate(a, c.shape.n_heads, stream));
  // Pageable sources: the copies above have read them when cudaMemcpyAsync returned; the GEMM object's
  // work is queued (its destructor frees nothing the stream still reads).
  return Error::Ok();
}

}  // namespace kvpack::cuda
