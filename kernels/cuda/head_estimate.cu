// The per-head transform choice on the GPU (head_choice.h): one CTA per head runs the shared decision
// (transform_select.h SelectHeadTransforms) with an evaluator whose sums run in the host evaluator's
// order — one thread per sum, each sum sequential — through the same row arithmetic (StoredRowOf and
// StoredQueryOf a warp per row below, QueryErrorOf as it is) and ChoiceExp. Built with --fmad=false (CMakeLists.txt): with
// contraction a·b + c would round once instead of twice and the estimates would drift from the host's
// by an ulp, which can flip a choice between near-equal candidates.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/head_choice.h"
#include "kernels/transform_select.h"

namespace kvpack::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxDim = 128;  // head_dim 64 or 128 on the GPU
constexpr int kQPitch = kMaxDim + 1;

// ── Stored rows, a warp per row ─────────────────────────────────────────────────────────────────
// transform_select.h's StoredRowOf / StoredQueryOf with the row spread over a warp: lane l holds
// channels l, l + 32, l + 64, l + 96 (d = 128; the first two for d = 64) in registers. One thread per
// row kept x[256] and codes[512] in local memory, which Nsight Compute put at 43% of the kernel's
// time (bench/RESULTS.md, session 9). Every value is the same arithmetic on the same operands as the
// host's: the element-wise steps are; each Walsh–Hadamard butterfly is a + b on the lower channel and
// a − b on the upper one whichever lane computes it; and the row's min, max and max|x| are the same
// in any order (a signed zero aside, which changes no decoded value).
constexpr int kLanePer = kMaxDim / 32;  // channels per lane

struct WarpRow {
  float x[kLanePer];
  int per = 0;  // d / 32
  int lane = 0;
  __device__ int Channel(int t) const { return lane + 32 * t; }
};

// x ← R · x (rotation.h RotateForward): signs, the butterflies for len = 1 … d/2, then 1/√d.
__device__ void WarpRotateForward(WarpRow& r, int d, uint64_t seed) {
#pragma unroll
  for (int t = 0; t < kLanePer; ++t) {
    if (t < r.per) r.x[t] *= RotationSign(seed, r.Channel(t));
  }
  for (int len = 1; len < 32 && len < d; len <<= 1) {  // partner channel in lane ^ len
    const bool upper = r.lane & len;
#pragma unroll
    for (int t = 0; t < kLanePer; ++t) {
      const float other = __shfl_xor_sync(0xffffffffu, r.x[t], len);
      if (t < r.per) r.x[t] = upper ? other - r.x[t] : r.x[t] + other;
    }
  }
#pragma unroll
  for (int step = 1; step < kLanePer; step <<= 1) {  // len = 32·step: partner in x[t + step]
    if (step >= r.per) break;
#pragma unroll
    for (int t = 0; t < kLanePer; ++t) {
      if (t + step < r.per && !(t & step)) {
        const float a = r.x[t], b = r.x[t + step];
        r.x[t] = a + b;
        r.x[t + step] = a - b;
      }
    }
  }
  const float norm = 1.0f / sqrtf(static_cast<float>(d));
#pragma unroll
  for (int t = 0; t < kLanePer; ++t) {
    if (t < r.per) r.x[t] *= norm;
  }
}

__device__ float WarpMin(float v) {
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o < v ? o : v;
  }
  return v;
}
__device__ uint32_t WarpSumU32(uint32_t v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ float WarpMax(float v) {
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

// StoredRowOf: (row − μ) / λ, rotated, through `format`'s encoder and decoder, into out [d].
__device__ void WarpStoredRow(const float* row, int d, const float* mu, const float* lambda, bool rotate,
                              uint64_t seed, PageFormat format, int lane, float* out) {
  WarpRow r;
  r.per = d / 32;
  r.lane = lane;
#pragma unroll
  for (int t = 0; t < kLanePer; ++t) {
    const int c = r.Channel(t);
    if (t < r.per) r.x[t] = (row[c] - mu[c]) / lambda[c];
  }
  if (rotate) WarpRotateForward(r, d, seed);
  switch (format) {
    case PageFormat::kInt4: {  // EncodeRowInt4 + DecodeRowInt4
      float mn = r.x[0], mx = r.x[0];
#pragma unroll
      for (int t = 1; t < kLanePer; ++t) {
        if (t < r.per) mn = r.x[t] < mn ? r.x[t] : mn, mx = r.x[t] > mx ? r.x[t] : mx;
      }
      mn = WarpMin(mn);
      mx = WarpMax(mx);
      // format.h's search, each candidate's error an integer warp sum (the same total as the host's loop).
      const Int4RowMeta m = ChooseInt4Row<Int4ScalarArith>(mn, mx, [&](float lo, float scale, float inv, float unit) {
        uint32_t err = 0;
#pragma unroll
        for (int t = 0; t < kLanePer; ++t) {
          if (t < r.per) err += Int4ErrorUnits(r.x[t], lo, scale, Int4Code(r.x[t], lo, inv), unit);
        }
        return WarpSumU32(err);
      });
      const float scale = HalfToFloat(m.scale);
      const float lo = HalfToFloat(m.lo);
      const float inv = Int4ScalarArith::Reciprocal(scale);
#pragma unroll
      for (int t = 0; t < kLanePer; ++t) {
        if (t < r.per) out[r.Channel(t)] = lo + static_cast<float>(Int4Code(r.x[t], lo, inv)) * scale;
      }
      break;
    }
    case PageFormat::kInt8: {  // EncodeRowInt8 + DecodeRowInt8
      float amax = 0.0f;
#pragma unroll
      for (int t = 0; t < kLanePer; ++t) {
        if (t < r.per) amax = fabsf(r.x[t]) > amax ? fabsf(r.x[t]) : amax;
      }
      amax = WarpMax(amax);
      const float scale = HalfToFloat(RowScaleToHalf(ClampToHalfRange(amax / 127.0f), amax));
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
#pragma unroll
      for (int t = 0; t < kLanePer; ++t) {
        if (t >= r.per) continue;
        float c = rintf(r.x[t] * inv);
        c = c < -127.0f ? -127.0f : (c > 127.0f ? 127.0f : c);
        out[r.Channel(t)] = static_cast<float>(static_cast<int8_t>(c)) * scale;
      }
      break;
    }
    case PageFormat::kBf16:
#pragma unroll
      for (int t = 0; t < kLanePer; ++t) {
        if (t < r.per) out[r.Channel(t)] = Bf16ToFloat(FloatToBf16(r.x[t]));
      }
      break;
  }
}

// StoredQueryOf: q ⊙ λ, rotated, rounded to bf16, into out [d].
__device__ void WarpStoredQuery(const float* q, int d, const float* lambda, bool rotate, uint64_t seed, int lane,
                                float* out) {
  WarpRow r;
  r.per = d / 32;
  r.lane = lane;
#pragma unroll
  for (int t = 0; t < kLanePer; ++t) {
    if (t < r.per) r.x[t] = q[r.Channel(t)] * lambda[r.Channel(t)];
  }
  if (rotate) WarpRotateForward(r, d, seed);
#pragma unroll
  for (int t = 0; t < kLanePer; ++t) {
    if (t < r.per) out[r.Channel(t)] = Bf16ToFloat(FloatToBf16(r.x[t]));
  }
}

// Channel rows in shared memory: the candidate's μ_k, λ, μ_v, λ_v, then zeros and ones.
enum RowIndex { kMuK = 0, kLambda, kMuV, kLambdaV, kZeros, kOnes, kRowCount };

// One head's evaluator: every method is called by all threads of the CTA and returns the same value
// to each (through shared memory).
struct DeviceEstimator {
  HeadEstimateArgs a;
  int head = 0;
  float* rows = nullptr;     // shared [kRowCount][kMaxDim]
  ErrorSums* result = nullptr;  // shared
  double* row_max = nullptr;    // shared [n_q]
  double* row_sum = nullptr;    // shared [n_q]
  float* q_tile = nullptr;      // shared [n_q][kQPitch]
  HeadEstimateScratch s;        // this head's global scratch

  __device__ const float* Q() const { return a.queries + static_cast<int64_t>(head) * a.d; }
  __device__ const float* K() const { return a.keys + static_cast<int64_t>(head) * a.d; }
  __device__ const float* V() const { return a.keys + a.kv_stride / 2 + static_cast<int64_t>(head) * a.d; }
  __device__ const float* Full(uint64_t offset) const {
    return reinterpret_cast<const float*>(a.kv + offset) + static_cast<int64_t>(head) * a.d;
  }
  __device__ const float* Row(int r) const { return rows + r * kMaxDim; }

  __device__ void SetRows(const ChoiceCandidate& c) {
    __syncthreads();
    const float* mu_k = Full(a.mu_k_offset);
    const float* lambda = Full(a.lambda_offset);
    const float* mu_v = Full(a.mu_v_offset);
    const float* lambda_v = Full(a.lambda_v_offset);
    for (int i = threadIdx.x; i < a.d; i += blockDim.x) {
      rows[kMuK * kMaxDim + i] = c.MuK(mu_k, i);
      rows[kLambda * kMaxDim + i] = c.Lambda(lambda, i);
      rows[kMuV * kMaxDim + i] = c.MuV(mu_v, i);
      rows[kLambdaV * kMaxDim + i] = c.LambdaV(lambda_v, i);
    }
    __syncthreads();
  }

  // Stored rows of K or V (source rows kv_stride apart) into out [n_k, d]; f < 0: each key's own format.
  __device__ void StoredRows(const float* src, const float* mu, const float* lambda, bool rotate, int f, float* out) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int j = warp; j < a.n_k; j += kThreads / 32) {
      const PageFormat format = static_cast<PageFormat>(f < 0 ? a.formats[j] : f);
      WarpStoredRow(src + j * a.kv_stride, a.d, mu, lambda, rotate, a.seed, format, lane, out + j * a.d);
    }
    __syncthreads();
  }

  // Softmax probabilities [n_q, n_k] of scale·q·k (queries q_stride apart, keys k_stride apart). The
  // queries go to shared memory (pitch d + 1: lane i reads row i without bank conflicts); warp w takes
  // keys w, w + 8, …, four at a time, lane i query i: each key row is one broadcast read per channel,
  // and four independent sums hide the adds' latency. Each dot still runs over c in order.
  __device__ void Probabilities(const float* q, int64_t q_stride, const float* k, int64_t k_stride, double* p) {
    for (int idx = threadIdx.x; idx < a.n_q * a.d; idx += blockDim.x) {
      q_tile[(idx / a.d) * kQPitch + idx % a.d] = q[(idx / a.d) * q_stride + idx % a.d];
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr int kWarps = kThreads / 32, kKeys = 4;
    if (lane < a.n_q) {
      const float* qi = q_tile + lane * kQPitch;
      for (int j0 = warp * kKeys; j0 < a.n_k; j0 += kWarps * kKeys) {
        const int keys = a.n_k - j0 < kKeys ? a.n_k - j0 : kKeys;
        const float* kj[kKeys];
        for (int u = 0; u < kKeys; ++u) kj[u] = k + (j0 + (u < keys ? u : 0)) * k_stride;
        double dot[kKeys] = {0.0, 0.0, 0.0, 0.0};
        for (int c = 0; c < a.d; ++c) {
          const double qc = qi[c];
#pragma unroll
          for (int u = 0; u < kKeys; ++u) dot[u] += qc * kj[u][c];
        }
        for (int u = 0; u < keys; ++u) p[lane * a.n_k + j0 + u] = dot[u] * a.scale;
      }
    }
    const int n = a.n_q * a.n_k;
    __syncthreads();
    // Row maxima and sums, a warp per query: lanes read 32 consecutive entries at a time; the maximum
    // is exact in any order, the sum is lane 0's, adding the 32 in key order (shuffled to it).
    for (int i = warp; i < a.n_q; i += kWarps) {
      double mx = -INFINITY;
      for (int j = lane; j < a.n_k; j += 32) mx = fmax(mx, p[i * a.n_k + j]);
      for (int off = 16; off > 0; off >>= 1) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      if (lane == 0) row_max[i] = mx;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < n; idx += blockDim.x) p[idx] = ChoiceExp(p[idx] - row_max[idx / a.n_k]);
    __syncthreads();
    for (int i = warp; i < a.n_q; i += kWarps) {
      double sum = 0.0;
      for (int j0 = 0; j0 < a.n_k; j0 += 32) {
        const double mine = j0 + lane < a.n_k ? p[i * a.n_k + j0 + lane] : 0.0;
        const int count = a.n_k - j0 < 32 ? a.n_k - j0 : 32;
        for (int l = 0; l < count; ++l) {
          const double e = __shfl_sync(0xffffffffu, mine, l);
          if (lane == 0) sum += e;
        }
      }
      if (lane == 0) row_sum[i] = sum;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < n; idx += blockDim.x) p[idx] /= row_sum[idx / a.n_k];
    __syncthreads();
  }

  // Σ_j p_ij v_j per (query, channel), each in key order, into `sums` (double) or `rounded` (float):
  // thread t takes channel t mod d of four queries at once (one read of v_jc for four independent sums).
  __device__ void PvRows(const double* p, const float* v, int64_t v_stride, double* sums, float* rounded) {
    constexpr int kQueries = 4;
    const int groups = (a.n_q + kQueries - 1) / kQueries;
    for (int idx = threadIdx.x; idx < groups * a.d; idx += blockDim.x) {
      const int i0 = (idx / a.d) * kQueries, c = idx % a.d;
      const int rows = a.n_q - i0 < kQueries ? a.n_q - i0 : kQueries;
      const double* pi[kQueries];
      for (int u = 0; u < kQueries; ++u) pi[u] = p + (i0 + (u < rows ? u : 0)) * a.n_k;
      double acc[kQueries] = {0.0, 0.0, 0.0, 0.0};
      for (int j = 0; j < a.n_k; ++j) {
        const float vjc = v[j * v_stride + c];
#pragma unroll
        for (int u = 0; u < kQueries; ++u) acc[u] += pi[u][j] * vjc;
      }
      for (int u = 0; u < rows; ++u) {
        if (sums) sums[(i0 + u) * a.d + c] = acc[u];
        if (rounded) rounded[(i0 + u) * a.d + c] = static_cast<float>(acc[u]);
      }
    }
    __syncthreads();
  }

  // Σ_j p_ij v_j per (query, channel) in key order (values v_stride apart), rounded to float into
  // s.o; then each query's error against the reference; the totals in query order.
  __device__ ErrorSums OutputError(const double* p, const float* v, int64_t v_stride, const float* mu,
                                   const float* lambda_v, bool rotate) {
    PvRows(p, v, v_stride, nullptr, s.o);
    __syncthreads();
    for (int i = threadIdx.x; i < a.n_q; i += blockDim.x) {
      QueryErrorOf(s.o + i * a.d, a.d, mu, lambda_v, rotate, a.seed, s.ref + i * a.d, &s.query_error[2 * i],
                   &s.query_error[2 * i + 1]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      ErrorSums e;
      for (int i = 0; i < a.n_q; ++i) AddQueryError(s.query_error[2 * i], s.query_error[2 * i + 1], &e);
      *result = e;
    }
    __syncthreads();
    const ErrorSums e = *result;
    __syncthreads();
    return e;
  }

  // The exact reference: probabilities of the unquantized rows and Σ_j p_ij v_j in double.
  __device__ void Reference() {
    Probabilities(Q(), a.q_stride, K(), a.kv_stride, s.p_ref);
    PvRows(s.p_ref, V(), a.kv_stride, s.ref, nullptr);
    __syncthreads();
  }

  // Probabilities through the candidate's K side (rows already set; q and k through R if `rotate`) into s.p.
  __device__ void KProbabilities(int f, bool rotate) {
    for (int i = threadIdx.x / 32; i < a.n_q; i += kThreads / 32) {
      WarpStoredQuery(Q() + i * a.q_stride, a.d, Row(kLambda), rotate, a.seed, threadIdx.x % 32, s.q + i * a.d);
    }
    StoredRows(K(), Row(kMuK), Row(kLambda), rotate, f, s.k);  // its barrier also publishes s.q
    Probabilities(s.q, a.d, s.k, a.d, s.p);
  }

  // The evaluator of SelectHeadTransforms.
  __device__ ErrorSums KOnly(const ChoiceCandidate& c) {
    SetRows(c);
    KProbabilities(-1, c.RotatesK(a.rotate));
    return OutputError(s.p, V(), a.kv_stride, Row(kZeros), Row(kOnes), false);
  }
  __device__ ErrorSums VOnly(const ChoiceCandidate& c) {
    SetRows(c);
    StoredRows(V(), Row(kMuV), Row(kLambdaV), c.RotatesV(a.rotate), -1, s.v);
    return OutputError(s.p_ref, s.v, a.d, Row(kMuV), Row(kLambdaV), c.RotatesV(a.rotate));
  }
  __device__ ErrorSums Both(const ChoiceCandidate& c, int f) {
    SetRows(c);
    KProbabilities(f, c.RotatesK(a.rotate));
    StoredRows(V(), Row(kMuV), Row(kLambdaV), c.RotatesV(a.rotate), f, s.v);
    return OutputError(s.p, s.v, a.d, Row(kMuV), Row(kLambdaV), c.RotatesV(a.rotate));
  }
};

__global__ void __launch_bounds__(kThreads) HeadEstimateKernel(const HeadEstimateArgs a) {
  __shared__ float rows[kRowCount * kMaxDim];
  __shared__ ErrorSums result;
  __shared__ double row_max[kEstimateQueries], row_sum[kEstimateQueries];
  __shared__ float q_tile[kEstimateQueries * kQPitch];
  DeviceEstimator est;
  est.a = a;
  est.head = blockIdx.x;
  est.rows = rows;
  est.result = &result;
  est.row_max = row_max;
  est.row_sum = row_sum;
  est.q_tile = q_tile;
  est.s = HeadScratchOf(a, blockIdx.x);
  for (int i = threadIdx.x; i < kMaxDim; i += blockDim.x) rows[kZeros * kMaxDim + i] = 0.0f, rows[kOnes * kMaxDim + i] = 1.0f;
  est.Reference();

  ChoiceCandidate kept;
  const HeadChoice choice = SelectHeadTransforms(est, a.transforms, &kept);

  // The kept set's rows into the entry's tables (every read of them is behind the last barrier),
  // its flags and estimates into the per-head record.
  float* mu_k = reinterpret_cast<float*>(a.kv + a.mu_k_offset) + static_cast<int64_t>(est.head) * a.d;
  float* lambda = reinterpret_cast<float*>(a.kv + a.lambda_offset) + static_cast<int64_t>(est.head) * a.d;
  float* mu_v = reinterpret_cast<float*>(a.kv + a.mu_v_offset) + static_cast<int64_t>(est.head) * a.d;
  float* lambda_v = reinterpret_cast<float*>(a.kv + a.lambda_v_offset) + static_cast<int64_t>(est.head) * a.d;
  for (int c = threadIdx.x; c < a.d; c += blockDim.x) {
    mu_k[c] = kept.MuK(mu_k, c);
    lambda[c] = kept.Lambda(lambda, c);
    mu_v[c] = kept.MuV(mu_v, c);
    lambda_v[c] = kept.LambdaV(lambda_v, c);
  }
  if (threadIdx.x == 0) {
    reinterpret_cast<uint32_t*>(a.kv + a.head_flags_offset)[est.head] = choice.flags;
    float* e = reinterpret_cast<float*>(a.kv + a.head_estimates_offset) + est.head * kHeadEstimateFields;
    for (int f = 0; f < kNumPageFormats; ++f) e[f] = static_cast<float>(choice.by_format[f].err);
    e[kNumPageFormats] = static_cast<float>(choice.by_format[0].ref);
  }
}

}  // namespace

Error LaunchHeadEstimate(const HeadEstimateArgs& args, int n_heads, cudaStream_t stream) {
  if (args.d != 64 && args.d != 128) return Unsupported("per-head choice: head_dim must be 64 or 128");
  if (args.n_q < 1 || args.n_q > kEstimateQueries || args.n_k < 1 || args.n_k > kEstimateKeys) {
    return InvalidArgument("per-head choice: sample of " + std::to_string(args.n_q) + " queries and " +
                           std::to_string(args.n_k) + " keys");
  }
  if (n_heads <= 0) return Error::Ok();
  HeadEstimateKernel<<<n_heads, kThreads, 0, stream>>>(args);
  KVPACK_CUDA_RETURN_LAUNCH("per-head transform estimate");
  return Error::Ok();
}

}  // namespace kvpack::cuda
