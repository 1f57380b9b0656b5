// The per-head transform choice (kernels/transform_choice.h) of the CUDA layer: the estimate's sample
// is formed on the device from the statistics pre-pass, and one CTA per head (head_estimate.cu) runs
// the CPU reference's decision (transform_select.h SelectHeadTransforms) on it with the same
// arithmetic in the same order, so the two backends make the same choice wherever their rows agree.
//
// Flow (after the pre-pass has written its float K | V sample [S, 2·H·d] and the entry's tables):
//   1. keys: rows EstimateKeyIndex(j, S), j < min(S, kEstimateKeys), of the pre-pass sample,
//      gathered into [n_keys, 2·H·d] floats;
//   2. queries: tokens StatsSampleToken(EstimateQueryIndex(i, S)), i < min(S, kEstimateQueries):
//      x rows gathered, one GEMM against W_q (or the caller's q rows with projected input), then
//      bias / QK-norm / RoPE to float [n_q, H·d] (RowMode::kQuerySample);
//   3. the formats of the sampled keys' ranges (n_keys bytes from the host);
//   4. HeadEstimateKernel: per head the exact reference, the candidates' estimates, the decision;
//   5. the kept rows over the tables, the per-head record (flags, estimates: format v2), in place.
// Nothing returns to the host and nothing synchronises: the whole choice is stream-ordered. (Until
// 2026-12-04 steps 3–5 ran on the host — 24 ms per head on one core of the H200's host, 133 ms of
// a 56-head layer; ChooseFromEstimateSample below is that host path, kept for the tests.)
// Which rows the CPU layer feeds the same decision: the same sample indices of its own pre-pass
// (kernels/cpu/layer.cc). They are the same values where both backends read the same bf16 rows
// (projected input: no GEMM, no bias / QK-norm / RoPE); with x and W the GEMM's summation order, and
// with QK-norm or RoPE the order of their float arithmetic, may move a value by an ulp, and the
// statistics reduction differs in the order of its double sums (row_epilogue.h): the tables then
// agree to ~1e-5 and the choice agrees except where two candidates' estimates tie within that.
//
// Memory: device scratch of ChoiceScratchBytes (the gathered rows) and ChoiceEstimateBytes (per
// head 0.8 MiB at d = 128, 512 keys × 32 queries: HeadEstimateBytes) inside the layer's workspace;
// the estimate's reuses the pre-pass sample's bytes where it fits there (layer.cc PlanStatsScratch).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/cpu/stats.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/row_epilogue.h"
#include "kernels/error.h"
#include "kernels/layer_spec.h"

namespace kvpack::cuda {

// Whether ProjectKv chooses per head for `config`: transforms.choose_per_head, no caller statistics,
// and smoothing or balancing on (otherwise there is nothing to choose and the CPU layer keeps the
// options' set as well).
bool ChoosesPerHead(const LayerConfig& config);

// Device scratch of the choice (0 when !ChoosesPerHead): the index tables, the gathered x rows and
// GEMM output of the queries (x + W input only), the float queries and the gathered float keys.
uint64_t ChoiceScratchBytes(const LayerConfig& config);
// Device scratch of the estimate (step 4): n_heads · HeadEstimateBytes (0 when !ChoosesPerHead). It
// may share bytes with the pre-pass sample, which is dead once the keys are gathered from it.
uint64_t ChoiceEstimateBytes(const LayerConfig& config);

// Which rows form the estimate's sample (steps 1–2): for S = StatsSampleCount sampled tokens, the
// pre-pass sample rows of the keys and the tokens of the queries.
struct EstimateSampleRows {
  int64_t n_sample = 0;              // S
  std::vector<int64_t> key_index;    // [min(S, kEstimateKeys)] EstimateKeyIndex(j, S)
  std::vector<int64_t> query_token;  // [min(S, kEstimateQueries)] token of sample EstimateQueryIndex(i, S)
};
EstimateSampleRows PlanEstimateSample(const LayerConfig& config);

// Step 4 on the device (head_estimate.cu): one CTA per head evaluates and decides as the host's
// ChooseHeadTransforms does, bit for bit, and writes the kept rows over the tables, the flags and
// the estimates into the entry. Inputs as after steps 1–2.
struct HeadEstimateArgs {
  const float* queries = nullptr;    // [n_q, q_stride]: query i of head h at i·q_stride + h·d
  int64_t q_stride = 0;              // H·d
  const float* keys = nullptr;       // [n_k, kv_stride]: K | V of sample key j (V at kv_stride / 2)
  int64_t kv_stride = 0;             // 2·H·d
  const uint8_t* formats = nullptr;  // [n_k] the PageFormat of key j's range
  int n_q = 0, n_k = 0, d = 0;
  double scale = 0.0;                // EstimateSoftmaxScale
  bool rotate = true;
  uint64_t seed = 0;
  TransformOptions transforms;
  uint8_t* kv = nullptr;             // the entry: the full tables in, the kept rows and the record out
  uint64_t mu_k_offset = 0, mu_v_offset = 0, lambda_offset = 0, lambda_v_offset = 0;
  uint64_t head_flags_offset = 0, head_estimates_offset = 0;
  uint8_t* scratch = nullptr;        // n_heads · HeadEstimateBytes(n_q, n_k, d)
};
// One head's global scratch: probabilities and the reference in double, stored rows in float.
struct HeadEstimateScratch {
  double* p = nullptr;            // [n_q, n_k] through the candidate's K side
  double* p_ref = nullptr;        // [n_q, n_k] exact
  double* ref = nullptr;          // [n_q, d] exact outputs
  double* query_error = nullptr;  // [n_q, 2] err, norm
  float* k = nullptr;             // [n_k, d] stored keys
  float* v = nullptr;             // [n_k, d] stored values
  float* q = nullptr;             // [n_q, d] stored queries
  float* o = nullptr;             // [n_q, d] outputs
};
KVPACK_HD inline uint64_t HeadEstimateBytes(int n_q, int n_k, int d) {
  return (2ull * n_q * n_k + static_cast<uint64_t>(n_q) * d + 2ull * n_q) * sizeof(double) +
         (2ull * n_k * d + 2ull * n_q * d) * sizeof(float);
}
KVPACK_HD inline HeadEstimateScratch HeadScratchOf(const HeadEstimateArgs& a, int head) {
  HeadEstimateScratch s;
  uint8_t* base = a.scratch + head * HeadEstimateBytes(a.n_q, a.n_k, a.d);
  const uint64_t pq = static_cast<uint64_t>(a.n_q) * a.n_k, qd = static_cast<uint64_t>(a.n_q) * a.d;
  s.p = reinterpret_cast<double*>(base);
  s.p_ref = s.p + pq;
  s.ref = s.p_ref + pq;
  s.query_error = s.ref + qd;
  s.k = reinterpret_cast<float*>(s.query_error + 2 * a.n_q);
  s.v = s.k + static_cast<uint64_t>(a.n_k) * a.d;
  s.q = s.v + static_cast<uint64_t>(a.n_k) * a.d;
  s.o = s.q + qd;
  return s;
}
Error LaunchHeadEstimate(const HeadEstimateArgs& args, int n_heads, cudaStream_t stream);

// Step 4 on host rows: keys [n_keys, 2·H·d] (row j: K | V of pre-pass sample key_index[j]) and
// queries [n_q, H·d] (row i: Q of query_token[i]), all after bias / QK-norm / RoPE; `stats` holds the
// pre-pass tables on entry and the chosen ones on return. Host-only (no device): what ProjectKv
// runs after its copy, and what a test can feed the CPU layer's own rows to.
cpu::TransformRecord ChooseFromEstimateSample(const LayerConfig& config, const EstimateSampleRows& rows,
                                              const float* keys, const float* queries, KvStats* stats);

// Steps 1–5 above. `base`: the row epilogue parameters of the layer (bias, norms, RoPE, positions)
// with nothing of a mode set; `sample` the pre-pass's float K | V [S, 2·H·d] (device); `scratch`
// ChoiceScratchBytes of device memory (not overlapping `sample`); `estimate_scratch` ChoiceEstimateBytes
// (may overlap `sample`); `blas_workspace` the layer's cuBLASLt workspace (x + W input).
// REQUIRES: ChoosesPerHead(config); the tables of `kv` written by the pre-pass on `stream`.
Error ChooseHeadTransformsFromDevice(const LayerConfig& config, const LayerTensors& tensors,
                                     const RowEpilogueParams& base, const float* sample, const KvLayout& layout,
                                     uint8_t* kv, uint8_t* scratch, uint8_t* estimate_scratch, cublasLtHandle_t blas,
                                     void* blas_workspace, cudaStream_t stream);

}  // namespace kvpack::cuda
