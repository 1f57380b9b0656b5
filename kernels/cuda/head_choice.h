// The per-head transform choice (kernels/transform_choice.h) of the CUDA layer: the estimate's sample
// is formed on the device from the statistics pre-pass, copied to the host, and chosen there by the
// CPU reference's own driver (cpu::ChooseTransforms, kernels/cpu/stats.h) — the same host function
// on the same kind of rows, so the two backends make the same choice wherever their rows agree.
//
// Flow (after the pre-pass has written its float K | V sample [S, 2·H·d] and the entry's tables):
//   1. keys: rows EstimateKeyIndex(j, S), j < min(S, kEstimateKeys), of the pre-pass sample,
//      gathered into [n_keys, 2·H·d] floats;
//   2. queries: tokens StatsSampleToken(EstimateQueryIndex(i, S)), i < min(S, kEstimateQueries):
//      x rows gathered, one GEMM against W_q (or the caller's q rows with projected input), then
//      bias / QK-norm / RoPE to float [n_q, H·d] (RowMode::kQuerySample);
//   3. copy keys, queries and the four tables (μ_k, μ_v, λ, λ_v) to the host — (2·n_keys + n_q)·d
//      + 4·d floats per head — and synchronise the stream;
//   4. cpu::ChooseTransforms on those rows and tables (all host cores);
//   5. upload the chosen tables and the per-head record (flags, estimates: format v2).
// Which rows the CPU layer feeds the same function: the same sample indices of its own pre-pass
// (kernels/cpu/layer.cc). They are the same values where both backends read the same bf16 rows
// (projected input: no GEMM, no bias / QK-norm / RoPE); with x and W the GEMM's summation order, and
// with QK-norm or RoPE the order of their float arithmetic, may move a value by an ulp, and the
// statistics reduction differs in the order of its double sums (row_epilogue.h): the tables then
// agree to ~1e-5 and the choice agrees except where two candidates' estimates tie within that.
//
// Memory: device scratch of ChoiceScratchBytes inside the layer's workspace; host vectors of the
// copies above ((2·512 + 32 + 4)·d floats, 530 KiB, per head at d = 128 and S ≥ 512) and the
// driver's per-thread copy of one head's sample.
// The host step synchronises the stream once (ProjectKv is otherwise asynchronous).
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

// Which rows form the estimate's sample (steps 1–2): for S = StatsSampleCount sampled tokens, the
// pre-pass sample rows of the keys and the tokens of the queries.
struct EstimateSampleRows {
  int64_t n_sample = 0;              // S
  std::vector<int64_t> key_index;    // [min(S, kEstimateKeys)] EstimateKeyIndex(j, S)
  std::vector<int64_t> query_token;  // [min(S, kEstimateQueries)] token of sample EstimateQueryIndex(i, S)
};
EstimateSampleRows PlanEstimateSample(const LayerConfig& config);

// Step 4 on host rows: keys [n_keys, 2·H·d] (row j: K | V of pre-pass sample key_index[j]) and
// queries [n_q, H·d] (row i: Q of query_token[i]), all after bias / QK-norm / RoPE; `stats` holds the
// pre-pass tables on entry and the chosen ones on return. Host-only (no device): what ProjectKv
// runs after its copy, and what a test can feed the CPU layer's own rows to.
cpu::TransformRecord ChooseFromEstimateSample(const LayerConfig& config, const EstimateSampleRows& rows,
                                              const float* keys, const float* queries, KvStats* stats);

// Steps 1–5 above. `base`: the row epilogue parameters of the layer (bias, norms, RoPE, positions)
// with nothing of a mode set; `sample` the pre-pass's float K | V [S, 2·H·d] (device); `scratch`
// ChoiceScratchBytes of device memory; `blas_workspace` the layer's cuBLASLt workspace (x + W input).
// REQUIRES: ChoosesPerHead(config); the tables of `kv` written by the pre-pass on `stream`.
Error ChooseHeadTransformsFromDevice(const LayerConfig& config, const LayerTensors& tensors,
                                     const RowEpilogueParams& base, const float* sample, const KvLayout& layout,
                                     uint8_t* kv, uint8_t* scratch, cublasLtHandle_t blas, void* blas_workspace,
                                     cudaStream_t stream);

}  // namespace kvpack::cuda
