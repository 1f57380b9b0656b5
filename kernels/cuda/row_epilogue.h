// Row epilogues of the streamed projection: each warp transforms one (q, k or v, head) column of a
// GEMM output over a run of tokens.
//
//   kPackKv  bf16 [T, 2·H·d] (K | V)  → bias, QK-norm, RoPE (K), −μ, ÷λ (K) or ÷λ_v (V), R,
//                                        quantize → pages
//   kStats   bf16 [S, 2·H·d] (K | V)  → bias, QK-norm, RoPE (K)                 → float [S, 2·H·d]
//   kQuery   bf16 [T, H·d]     (Q)    → bias, QK-norm, RoPE, ×λ, R              → bf16, in place
//   kQuerySample bf16 [n, H·d] (Q)    → bias, QK-norm, RoPE                     → float [n, H·d]
//                                        (the queries of the per-head choice's sample, head_choice.h)
//
// Each mode may instead read the caller's pre-projected rows (RowEpilogueParams::given): the same
// arithmetic from the same bf16 values, with no GEMM before it and no copy.
//
// plus the statistics reduction (μ_k, μ_v, λ, λ_v per (head, channel)) and the sample gather of the
// pre-pass. Every step runs in fp32 in the order of format.h; the rotation uses the same butterfly
// order as rotation.h, so codes match the CPU reference wherever the fp32 inputs match.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/layer_spec.h"

namespace kvpack::cuda {

enum class RowMode : int { kPackKv = 0, kStats = 1, kQuery = 2, kQuerySample = 3 };
inline constexpr int kMaxHeadDimGpu = 128;


struct RowEpilogueParams {
  // Input: GEMM output rows, bf16.
  const uint16_t* in = nullptr;
  int64_t in_stride = 0;           // elements between rows
  // Or, when given[0] is set, the caller's pre-projected rows (LayerConfig::projected): block b
  // (0: K, or Q in kQuery; 1: V) of (token, head) at given[b] + given_layout.Offset(token, head),
  // read where the GEMM output would be. `in` is then unused.
  const uint16_t* given[2] = {nullptr, nullptr};
  ProjectedLayout given_layout;
  int64_t n_rows = 0;              // tokens in this launch
  int64_t token_begin = 0;         // global token index of row 0 (ignored when token_index is set)
  const int64_t* token_index = nullptr;  // [n_rows] global token of each row (kStats, kQuerySample) or null
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
  int rope_pairs = 0;                      // R/2, R = Σ axis_dims
  float rope_inv_freq[kMaxHeadDimGpu / 2] = {};  // pair j turns by positions[t, axis_of_pair[j]] · inv_freq[j]
  uint8_t rope_axis_of_pair[kMaxHeadDimGpu / 2] = {};
  const float* positions = nullptr;        // [N, rope_axes]

  // Smoothing, balancing and rotation (device tables of the entry; μ = 0 and λ = λ_v = 1 where
  // switched off).
  const float* mu_k = nullptr;
  const float* mu_v = nullptr;
  const float* lambda = nullptr;           // K (kPackKv) and Q (kQuery)
  const float* lambda_v = nullptr;         // V (kPackKv)
  bool rotate = true;
  const uint32_t* head_flags = nullptr;    // the entry's per-head flags: kHeadPlainK / V drop R for a head (may be null)
  uint64_t seed = 0;

  // Outputs.
  uint8_t* kv_block = nullptr;             // kPackKv: the entry's block
  const PageDesc* pages = nullptr;         // kPackKv: device page table
  int n_pages = 0;
  const uint64_t* k_offsets = nullptr;     // kPackKv: device offsets
  const uint64_t* v_offsets = nullptr;
  float* out_float = nullptr;              // kStats: [n_rows, 2·H·d]; kQuerySample: [n_rows, H·d]
  uint16_t* out_bf16 = nullptr;            // kQuery: [n_rows, H·d], row stride out_stride (may be `in`)
  int64_t out_stride = 0;
};

// The RoPE table of a config, computed on the host exactly as the CPU reference does
// (inv_freq = float(theta^(−2i/axis_dims[a])) in double), so both backends turn by the same angles.
void FillRopeTable(const RopeOptions& rope, RowEpilogueParams* params);

Error LaunchRowEpilogue(RowMode mode, const RowEpilogueParams& params, cudaStream_t stream);

// A check of the quantizers' reciprocal (row_epilogue.cu, ReciprocalOfHalf) on this device: how many of
// the positive finite half values s get a result other than __frcp_rn(s)'s (0 expected). Synchronous.
Error CountHalfReciprocalMismatches(int* mismatches);

// A check of the warp row encoders (page_codec.cuh DevicePageCodec<F>::StoreRow, what kPackKv writes)
// against the host's (format.h): encodes `n_rows` float rows of `head_dim` (64 or 128) channels from
// host memory, row i into slot i % kPageTokens of page i / kPageTokens of `format`, and copies the
// pages back to `pages` (host, ⌈n_rows / kPageTokens⌉ · PageBytes(format, head_dim) bytes; slots past
// n_rows are zero). Synchronous; for tests.
Error EncodeRowsOnDevice(PageFormat format, int head_dim, const float* rows, int64_t n_rows, uint8_t* pages);

// Copies rows token_index[i] of x ([N, hidden] bf16) to out [n, hidden].
Error LaunchGatherRows(const uint16_t* x, int64_t hidden, const int64_t* token_index, int64_t n, uint16_t* out,
                       cudaStream_t stream);

// μ_k, μ_v, λ, λ_v per (head, channel) from the pre-pass's float K | V [n_sample, 2·H·d], the CPU
// reference's rule (kernels/cpu/stats.h) in double: μ = mean over the sample (0 without smoothing);
// m_c = max|k_c − μ_c|, λ'_c = sqrt(max(m_c, kLambdaFloor · max m)), λ = λ' / geometric mean of the
// head's λ' (1 without balancing, or when every m_c of the head is 0); λ_v the same rule with V's RMS
// σ_c = sqrt(mean (v_c − μ_v,c)²) in place of m_c. The sums are grouped (kStatsGroups partial sums),
// so μ and σ may differ from the CPU's in the last bits of a double.
inline constexpr double kLambdaFloor = 1e-6;
struct KvStatsOut {
  float* mu_k = nullptr;      // each [n_heads · head_dim], device
  float* mu_v = nullptr;
  float* lambda = nullptr;
  float* lambda_v = nullptr;
};
Error LaunchKvStats(const float* kv, int64_t n_sample, int n_heads, int head_dim, bool smooth, bool balance,
                    const KvStatsOut& out, cudaStream_t stream);

}  // namespace kvpack::cuda
