// Row epilogues of the streamed projection: one warp per (token, head) row of a GEMM output.
//
//   kPackKv  bf16 [T, 2·H·d] (K | V)  → bias, QK-norm, RoPE (K), −μ, ÷λ (K), R, quantize → pages
//   kStats   bf16 [S, 2·H·d] (K | V)  → bias, QK-norm, RoPE (K)                 → float [S, 2·H·d]
//   kQuery   bf16 [T, H·d]     (Q)    → bias, QK-norm, RoPE, ×λ, R              → bf16, in place
//
// plus the statistics reduction (μ_k, μ_v, λ per (head, channel)) and the sample gather of the
// pre-pass. Every step runs in fp32 in the order of format.h; the rotation uses the same butterfly
// order as rotation.h, so codes match the CPU reference wherever the fp32 inputs match.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/layer_spec.h"

namespace kvpack::cuda {

enum class RowMode : int { kPackKv = 0, kStats = 1, kQuery = 2 };

struct RowEpilogueParams {
  // Input: GEMM output rows, bf16.
  const uint16_t* in = nullptr;
  int64_t in_stride = 0;           // elements between rows
  int64_t n_rows = 0;              // tokens in this launch
  int64_t token_begin = 0;         // global token index of row 0 (ignored when token_index is set)
  const int64_t* token_index = nullptr;  // [n_rows] global token of each row (pre-pass sample) or null
  int n_heads = 0;
  int head_dim = 0;

  // Transforms before smoothing.
  const float* bias = nullptr;             // [3·H·d] (q | k | v) or null
  const float* q_norm_weight = nullptr;    // QK-norm weights or null (norm off for that tensor)
  const float* k_norm_weight = nullptr;
  int norm_weight_len = 0;                 // d or H·d
  float norm_eps = 1e-6f;
  bool norm = false;
  RopeLayout rope_layout = RopeLayout::kNone;
  int rope_axes = 0;
  int rope_axis_dims[3] = {0, 0, 0};
  float rope_theta = 10000.0f;
  const float* positions = nullptr;        // [N, rope_axes]

  // Smoothing and rotation (device tables of the entry; μ = 0 and λ = 1 where switched off).
  const float* mu_k = nullptr;
  const float* mu_v = nullptr;
  const float* lambda = nullptr;
  bool rotate = true;
  uint64_t seed = 0;

  // Outputs.
  uint8_t* kv_block = nullptr;             // kPackKv: the entry's block
  const PageDesc* pages = nullptr;         // kPackKv: device page table
  int n_pages = 0;
  const uint64_t* k_offsets = nullptr;     // kPackKv: device offsets
  const uint64_t* v_offsets = nullptr;
  float* out_float = nullptr;              // kStats: [n_rows, 2·H·d]
  uint16_t* out_bf16 = nullptr;            // kQuery: [n_rows, H·d], row stride out_stride (may be `in`)
  int64_t out_stride = 0;
};

Error LaunchRowEpilogue(RowMode mode, const RowEpilogueParams& params, cudaStream_t stream);

// Copies rows token_index[i] of x ([N, hidden] bf16) to out [n, hidden].
Error LaunchGatherRows(const uint16_t* x, int64_t hidden, const int64_t* token_index, int64_t n, uint16_t* out,
                       cudaStream_t stream);

// μ_k, μ_v, λ per (head, channel) from the pre-pass's float K | V [n_sample, 2·H·d]:
// μ = mean over the sample (0 without smoothing); λ_c = max|k_c − μ_c|^0.5, clamped below at
// kMinLambda and divided by its geometric mean over the head's d channels (1 without balancing).
inline constexpr float kMinLambda = 1e-4f;
Error LaunchKvStats(const float* kv, int64_t n_sample, int n_heads, int head_dim, bool smooth, bool balance,
                    float* mu_k, float* mu_v, float* lambda, cudaStream_t stream);

}  // namespace kvpack::cuda
