#include "kernels/cuda/row_epilogue.h"

#include <cmath>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/page_codec.cuh"
#include "kernels/cuda/warp_row.cuh"
#include "kernels/transform_choice.h"

namespace kvpack::cuda {
namespace {

// A block is 8 warps: 8 consecutive columns (column j = block·H + head: the q, k or v rows of one
// head) over the same kRowsPerWarp tokens. Each warp keeps its column's constants (bias, norm
// weights, μ, λ and the rotation signs, folded) in registers for all its rows, and keeps the loads of
// rows r + 1 … r + kRowsAhead in flight while it transforms row r (one row's latency was the largest
// stall with a single load ahead).
constexpr int kWarpsPerBlock = 8;
constexpr int kRowsPerWarp = 16;
constexpr int kRowsAhead = 3;
// Four blocks per SM (64 registers a thread): 32 warps to hide the shuffles' and loads' latencies.
constexpr int kBlocksPerSm = 4;
constexpr bool ReadsQ(RowMode mode) { return mode == RowMode::kQuery || mode == RowMode::kQuerySample; }
constexpr bool WritesFloat(RowMode mode) { return mode == RowMode::kStats || mode == RowMode::kQuerySample; }
// Input column blocks of a mode: q; or k | v.
constexpr int ColumnBlocks(RowMode mode) { return ReadsQ(mode) ? 1 : 2; }

// RoPE on one row (after QK-norm, before smoothing), the CPU reference's arithmetic without FMA
// contraction. `buf` is this warp's d floats of shared memory, used to read each channel's partner.
template <int kPerLane>
__device__ void ApplyRope(float (&x)[kPerLane], float* buf, int lane, const RowEpilogueParams& p, int64_t token) {
  const int half = p.rope_pairs;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) buf[lane * kPerLane + i] = x[i];
  __syncwarp();
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane * kPerLane + i;
    if (c >= 2 * half) continue;
    int pair, partner;
    bool first;
    if (p.rope_layout == RopeLayout::kInterleaved) {
      pair = c >> 1, first = (c & 1) == 0, partner = c ^ 1;
    } else {
      first = c < half;
      pair = first ? c : c - half;
      partner = first ? c + half : c - half;
    }
    const float angle = __fmul_rn(p.positions[token * p.rope_axes + p.rope_axis_of_pair[pair]], p.rope_inv_freq[pair]);
    float s, co;
    sincosf(angle, &s, &co);
    const float other = buf[partner];
    // (x0, x1) → (x0·cos − x1·sin, x0·sin + x1·cos), x0 the first channel of the pair.
    x[i] = first ? __fsub_rn(__fmul_rn(x[i], co), __fmul_rn(other, s))
                 : __fadd_rn(__fmul_rn(other, s), __fmul_rn(x[i], co));
  }
  __syncwarp();
}

// The page that holds one token, found once and kept while the warp's tokens stay inside it.
struct PageCursor {
  int64_t begin = 0, end = 0;  // tokens [begin, end) of the page in hand; empty at first
  PageFormat format = PageFormat::kInt4;
  uint8_t* base = nullptr;

  __device__ void Seek(const RowEpilogueParams& p, int head, int which, int64_t token) {
    if (token >= begin && token < end) return;
    const int index = FindPage(p.pages, p.n_pages, token);
    const PageDesc page = p.pages[index];
    begin = page.token_begin, end = begin + page.n_valid;
    format = static_cast<PageFormat>(page.format);
    base = p.kv_block + (which == 0 ? p.k_offsets : p.v_offsets)[static_cast<int64_t>(head) * p.n_pages + index];
  }
};

template <int kDim, RowMode kMode>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, kBlocksPerSm) RowEpilogueKernel(const RowEpilogueParams p) {
  constexpr int kPerLane = kDim / 32;
  constexpr int kBlocks = ColumnBlocks(kMode);
  __shared__ float rope_buf[kWarpsPerBlock][kDim];

  // ── Which column, which rows ──────────────────────────────────────────────────────────────────
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int column = blockIdx.y * kWarpsPerBlock + warp;
  if (column >= kBlocks * p.n_heads) return;  // warp-uniform
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * kRowsPerWarp;
  const int n_rows = static_cast<int>(min(static_cast<int64_t>(kRowsPerWarp), p.n_rows - row_begin));
  const int which = column / p.n_heads, head = column % p.n_heads;  // input columns column·d …
  const int kind = ReadsQ(kMode) ? 0 : 1 + which;                   // 0 q, 1 k, 2 v: W / bias block
  const int64_t head_cols = static_cast<int64_t>(p.n_heads) * kDim;
  const int chan = lane * kPerLane;  // first channel of this lane
  const int hc = head * kDim + chan;  // column inside one q / k / v block

  // ── The column's constants ────────────────────────────────────────────────────────────────────
  // bias; QK-norm weights; shift μ and factor f: K and V are divided by f = λ·s (or λ_v·s), Q is
  // multiplied by it, s the rotation sign. Folding s in is exact: it only flips signs.
  float bias[kPerLane], norm_w[kPerLane], shift[kPerLane], factor[kPerLane], inv_factor[kPerLane];
  const float* norm_table = kind == 0 ? p.q_norm_weight : (kind == 1 ? p.k_norm_weight : nullptr);
  const bool norm = p.norm && norm_table != nullptr;
  const int w0 = p.norm_weight_len == kDim ? chan : hc;
  // q and k rotate together, V on its own (the head's flags may drop R: transform_choice.h).
  const bool rotate = kind == 2 ? HeadRotatesV(p.rotate, p.head_flags, head) : HeadRotatesK(p.rotate, p.head_flags, head);
  float signs[kPerLane];
  LaneSigns(signs, lane, p.seed);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    bias[i] = p.bias ? p.bias[kind * head_cols + hc + i] : 0.0f;
    norm_w[i] = norm ? norm_table[w0 + i] : 1.0f;
    const float sign = rotate ? signs[i] : 1.0f;
    shift[i] = 0.0f, factor[i] = sign;
    if constexpr (kMode == RowMode::kQuery) {
      factor[i] = p.lambda[hc + i] * sign;
    } else if constexpr (kMode == RowMode::kPackKv) {
      shift[i] = (which == 0 ? p.mu_k : p.mu_v)[hc + i];
      factor[i] = (which == 0 ? p.lambda : p.lambda_v)[hc + i] * sign;
    }
    inv_factor[i] = __frcp_rn(factor[i]);
  }

  // ── Rows ──────────────────────────────────────────────────────────────────────────────────────
  // Rows row_begin + r, r < n_rows (at most kRowsPerWarp): the workspace's step by in_stride (a row of
  // q or of k | v, < 2^31 elements), given rows sit where the caller's layout puts their token.
  const bool given = p.given[0] != nullptr;
  const ProjectedLayout& gl = p.given_layout;
  const auto token_of = [&](int r) -> int64_t {
    if constexpr (WritesFloat(kMode)) {
      if (p.token_index) return p.token_index[row_begin + r];
    }
    return p.token_begin + row_begin + r;
  };
  const uint16_t* in_row0 = given ? nullptr : p.in + row_begin * p.in_stride + column * kDim + chan;
  const int in_stride = static_cast<int>(p.in_stride);
  const auto row_ptr = [&](int r) -> const uint16_t* {
    if (!given) return in_row0 + r * in_stride;
    const int64_t token = token_of(r);
    return p.given[which] + token / gl.batch_tokens * gl.batch_stride + token % gl.batch_tokens * gl.token_stride +
           head * gl.head_stride + chan;
  };
  PageCursor page;
  Bf16Lanes<kPerLane> ahead[kRowsAhead];  // rows r + 1 … r + kRowsAhead, as loaded
#pragma unroll
  for (int k = 0; k < kRowsAhead; ++k) {
    if (k < n_rows) ahead[k] = LoadBf16Lanes<kPerLane>(row_ptr(k));
  }
  for (int r = 0; r < n_rows; ++r) {
    float x[kPerLane];
    UnpackBf16(ahead[0], x);
#pragma unroll
    for (int k = 0; k + 1 < kRowsAhead; ++k) ahead[k] = ahead[k + 1];
    if (r + kRowsAhead < n_rows) ahead[kRowsAhead - 1] = LoadBf16Lanes<kPerLane>(row_ptr(r + kRowsAhead));
    const int64_t row = row_begin + r, token = token_of(r);

    // ── Bias, QK-norm, RoPE ─────────────────────────────────────────────────────────────────────
    if (p.bias) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) x[i] += bias[i];
    }
    if (norm) {
      float ss = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) ss += x[i] * x[i];
      const float r = 1.0f / sqrtf(WarpSum(ss) / static_cast<float>(kDim) + p.norm_eps);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], r), norm_w[i]);
    }
    if (kind != 2 && p.rope_layout != RopeLayout::kNone) ApplyRope(x, rope_buf[warp], lane, p, token);

    // ── Mode-specific tail ──────────────────────────────────────────────────────────────────────
    if constexpr (WritesFloat(kMode)) {
      float* out = p.out_float + row * kBlocks * head_cols + which * head_cols + hc;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) out[i] = x[i];
    } else if constexpr (kMode == RowMode::kQuery) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) x[i] = __fmul_rn(x[i], factor[i]);  // ×λ, sign
      if (rotate) WarpRotateForwardSigned(x, lane);
      StoreBf16(p.out_bf16 + row * p.out_stride + hc, x);
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) x[i] = DivideByReciprocal(x[i] - shift[i], factor[i], inv_factor[i]);
      if (rotate) WarpRotateForwardSigned(x, lane);
      page.Seek(p, head, which, token);
      StorePageRow(x, lane, page.format, static_cast<int>(token - page.begin), page.base);
    }
  }
}

template <int kDim>
Error LaunchForDim(RowMode mode, const RowEpilogueParams& p, cudaStream_t stream) {
  const int columns = ColumnBlocks(mode) * p.n_heads;
  const dim3 grid(static_cast<unsigned>((p.n_rows + kRowsPerWarp - 1) / kRowsPerWarp),
                  static_cast<unsigned>((columns + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const dim3 block(32 * kWarpsPerBlock);
  switch (mode) {
    case RowMode::kPackKv: RowEpilogueKernel<kDim, RowMode::kPackKv><<<grid, block, 0, stream>>>(p); break;
    case RowMode::kStats: RowEpilogueKernel<kDim, RowMode::kStats><<<grid, block, 0, stream>>>(p); break;
    case RowMode::kQuery: RowEpilogueKernel<kDim, RowMode::kQuery><<<grid, block, 0, stream>>>(p); break;
    case RowMode::kQuerySample:
      RowEpilogueKernel<kDim, RowMode::kQuerySample><<<grid, block, 0, stream>>>(p);
      break;
  }
  KVPACK_CUDA_RETURN_LAUNCH("row epilogue kernel");
  return Error::Ok();
}

__global__ void HalfReciprocalCheckKernel(int* mismatches) {
  const int h = blockIdx.x * blockDim.x + threadIdx.x;  // bits of a positive finite half: 1 … 0x7bff
  if (h < 1 || h >= 0x7c00) return;
  const float s = HalfBits(static_cast<uint16_t>(h));
  if (__float_as_uint(ReciprocalOfHalf(s)) != __float_as_uint(__frcp_rn(s))) atomicAdd(mismatches, 1);
}

// One warp per row (EncodeRowsOnDevice): lane l holds channels l·kPerLane …, as the row epilogue's.
template <PageFormat F, int kPerLane>
__global__ void EncodeRowsKernel(const float* rows, int64_t n_rows, uint8_t* pages) {
  constexpr int kDim = 32 * kPerLane;
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n_rows) return;
  float x[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) x[i] = rows[row * kDim + lane * kPerLane + i];
  uint8_t* page = pages + (row / kPageTokens) * PageBytes(F, kDim);
  DevicePageCodec<F>::template StoreRow<kPerLane>(x, lane, static_cast<int>(row % kPageTokens), page);
}

__global__ void GatherRowsKernel(const uint16_t* x, int64_t hidden, const int64_t* token_index, uint16_t* out) {
  const int64_t row = blockIdx.x;
  const uint4* src = reinterpret_cast<const uint4*>(x + token_index[row] * hidden);
  uint4* dst = reinterpret_cast<uint4*>(out + row * hidden);
  for (int64_t i = threadIdx.x; i < hidden / 8; i += blockDim.x) dst[i] = src[i];
}

// One block per head: kStatsGroups sample groups × d channels; group partials (double) are combined
// in a fixed order, so the result is deterministic.
constexpr int kStatsGroups = 8;

// λ of channel c from the head's channel spreads (spread[c] = m; K: sample range, V: RMS): the CPU
// reference's BalanceFromSpreads, the same operations in the same order. 1 when balancing is off or
// every spread is 0.
template <int kDim>
__device__ float BalanceFactor(const double* spread, double m, bool balance) {
  double widest = 0.0;
  for (int i = 0; i < kDim; ++i) widest = fmax(widest, spread[i]);
  if (!balance || !(widest > 0.0) || !isfinite(widest)) return 1.0f;
  double log_sum = 0.0;
  for (int i = 0; i < kDim; ++i) log_sum += log(sqrt(fmax(spread[i], kLambdaFloor * widest)));
  return static_cast<float>(sqrt(fmax(m, kLambdaFloor * widest)) / exp(log_sum / kDim));
}

template <int kDim>
__global__ void __launch_bounds__(kDim * kStatsGroups) KvStatsKernel(const float* kv, int64_t n_sample, int n_heads,
                                                                     bool smooth, bool balance, KvStatsOut out) {
  __shared__ double part[2][kStatsGroups][kDim];
  __shared__ double spread[2][kDim];  // K: max |k − μ_k|, V: RMS of v − μ_v
  const int c = threadIdx.x % kDim, group = threadIdx.x / kDim, head = blockIdx.x;
  const int64_t head_cols = static_cast<int64_t>(n_heads) * kDim;
  const int64_t stride = 2 * head_cols;
  const int64_t kc = static_cast<int64_t>(head) * kDim + c;
  double sum_k = 0.0, sum_v = 0.0;
  if (smooth) {
    for (int64_t r = group; r < n_sample; r += kStatsGroups) {
      sum_k += kv[r * stride + kc];
      sum_v += kv[r * stride + head_cols + kc];
    }
  }
  part[0][group][c] = sum_k, part[1][group][c] = sum_v;
  __syncthreads();
  double total_k = 0.0, total_v = 0.0;
  for (int g = 0; g < kStatsGroups; ++g) total_k += part[0][g][c], total_v += part[1][g][c];
  const float mk = smooth ? static_cast<float>(total_k / static_cast<double>(n_sample)) : 0.0f;
  const float mv = smooth ? static_cast<float>(total_v / static_cast<double>(n_sample)) : 0.0f;
  double m_k = 0.0, ss_v = 0.0;  // this group's max |k − μ_k| and Σ (v − μ_v)²
  for (int64_t r = group; r < n_sample; r += kStatsGroups) {
    m_k = fmax(m_k, fabs(static_cast<double>(kv[r * stride + kc]) - static_cast<double>(mk)));
    const double dv = static_cast<double>(kv[r * stride + head_cols + kc]) - static_cast<double>(mv);
    ss_v += dv * dv;
  }
  __syncthreads();
  part[0][group][c] = m_k, part[1][group][c] = ss_v;
  __syncthreads();
  double rms_v = 0.0;
  if (group == 0) {
    double total = 0.0;
    for (int g = 0; g < kStatsGroups; ++g) m_k = fmax(m_k, part[0][g][c]), total += part[1][g][c];
    rms_v = sqrt(total / static_cast<double>(n_sample));
    spread[0][c] = m_k, spread[1][c] = rms_v;
  }
  __syncthreads();
  if (group != 0) return;
  out.mu_k[kc] = mk;
  out.mu_v[kc] = mv;
  out.lambda[kc] = BalanceFactor<kDim>(spread[0], m_k, balance);
  out.lambda_v[kc] = BalanceFactor<kDim>(spread[1], rms_v, balance);
}

}  // namespace

void FillRopeTable(const RopeOptions& rope, RowEpilogueParams* params) {
  params->rope_layout = rope.layout;
  params->rope_axes = rope.n_axes;
  int pair = 0;
  for (int a = 0; a < rope.n_axes && rope.layout != RopeLayout::kNone; ++a) {
    for (int i = 0; i < rope.axis_dims[a] / 2 && pair < kMaxHeadDimGpu / 2; ++i, ++pair) {
      params->rope_inv_freq[pair] = static_cast<float>(
          std::pow(static_cast<double>(rope.theta), -2.0 * i / static_cast<double>(rope.axis_dims[a])));
      params->rope_axis_of_pair[pair] = static_cast<uint8_t>(a);
    }
  }
  params->rope_pairs = pair;
}

Error LaunchRowEpilogue(RowMode mode, const RowEpilogueParams& params, cudaStream_t stream) {
  if (params.n_rows == 0) return Error::Ok();
  if (params.head_dim == 128) return LaunchForDim<128>(mode, params, stream);
  if (params.head_dim == 64) return LaunchForDim<64>(mode, params, stream);
  return Unsupported("row epilogue: head_dim " + std::to_string(params.head_dim));
}

Error CountHalfReciprocalMismatches(int* mismatches) {
  int* device = nullptr;
  KVPACK_CUDA_RETURN(cudaMalloc(&device, sizeof(int)));
  cudaError_t status = cudaMemset(device, 0, sizeof(int));
  if (status == cudaSuccess) {
    HalfReciprocalCheckKernel<<<0x7c00 / 256, 256>>>(device);
    status = cudaMemcpy(mismatches, device, sizeof(int), cudaMemcpyDeviceToHost);
  }
  cudaFree(device);
  return CudaError(status, "half reciprocal check");
}

Error EncodeRowsOnDevice(PageFormat format, int head_dim, const float* rows, int64_t n_rows, uint8_t* pages) {
  if (head_dim != 64 && head_dim != 128) return Unsupported("row encoder check: head_dim " + std::to_string(head_dim));
  const uint64_t row_bytes = static_cast<uint64_t>(n_rows) * head_dim * sizeof(float);
  const uint64_t page_bytes = static_cast<uint64_t>((n_rows + kPageTokens - 1) / kPageTokens) * PageBytes(format, head_dim);
  float* device_rows = nullptr;
  uint8_t* device_pages = nullptr;
  cudaError_t status = cudaMalloc(&device_rows, row_bytes);
  if (status == cudaSuccess) status = cudaMalloc(&device_pages, page_bytes);
  if (status == cudaSuccess) status = cudaMemcpy(device_rows, rows, row_bytes, cudaMemcpyHostToDevice);
  if (status == cudaSuccess) status = cudaMemset(device_pages, 0, page_bytes);
  if (status == cudaSuccess && n_rows > 0) {
    constexpr int kWarps = 8;
    const unsigned blocks = static_cast<unsigned>((n_rows + kWarps - 1) / kWarps);
    DispatchFormat(format, [&](auto tag) {
      constexpr PageFormat F = decltype(tag)::kFormat;
      if (head_dim == 128) {
        EncodeRowsKernel<F, 4><<<blocks, 32 * kWarps>>>(device_rows, n_rows, device_pages);
      } else {
        EncodeRowsKernel<F, 2><<<blocks, 32 * kWarps>>>(device_rows, n_rows, device_pages);
      }
      return 0;
    });
    status = cudaGetLastError();
  }
  if (status == cudaSuccess) status = cudaMemcpy(pages, device_pages, page_bytes, cudaMemcpyDeviceToHost);
  cudaFree(device_rows);
  cudaFree(device_pages);
  return CudaError(status, "row encoder check");
}

Error LaunchGatherRows(const uint16_t* x, int64_t hidden, const int64_t* token_index, int64_t n, uint16_t* out,
                       cudaStream_t stream) {
  if (n == 0) return Error::Ok();
  GatherRowsKernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(x, hidden, token_index, out);
  KVPACK_CUDA_RETURN_LAUNCH("gather kernel");
  return Error::Ok();
}

Error LaunchKvStats(const float* kv, int64_t n_sample, int n_heads, int head_dim, bool smooth, bool balance,
                    const KvStatsOut& out, cudaStream_t stream) {
  if (head_dim == 128) {
    KvStatsKernel<128><<<n_heads, 128 * kStatsGroups, 0, stream>>>(kv, n_sample, n_heads, smooth, balance, out);
  } else if (head_dim == 64) {
    KvStatsKernel<64><<<n_heads, 64 * kStatsGroups, 0, stream>>>(kv, n_sample, n_heads, smooth, balance, out);
  } else {
    return Unsupported("stats: head_dim " + std::to_string(head_dim));
  }
  KVPACK_CUDA_RETURN_LAUNCH("stats kernel");
  return Error::Ok();
}

}  // namespace kvpack::cuda
