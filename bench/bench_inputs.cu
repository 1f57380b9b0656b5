#include "bench/bench_inputs.h"

#include "kernels/format.h"

namespace kvpack::bench {
namespace {

constexpr uint64_t kM32 = 0xffffffffull;

__device__ __forceinline__ float Uniform(uint64_t stream, uint64_t i) {
  uint64_t h = ((i + stream * 0x9E3779Bull) * 0x2545F491ull) & kM32;
  h ^= h >> 16;
  h = (h * 0x3B9ACA07ull) & kM32;
  h ^= h >> 15;
  h = (h * 0x2C1B3C6Dull) & kM32;
  h ^= h >> 16;
  return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

__global__ void FillX(uint16_t* x, int64_t n, int64_t hidden) {
  const int64_t total = n * hidden;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = i % hidden;
    const float mean = __fmul_rn(0.8f, __fsub_rn(__fmul_rn(2.0f, Uniform(1, j)), 1.0f));
    const float u = Uniform(2, i);
    float v = __fadd_rn(mean, __fmul_rn(1.7f, __fsub_rn(__fmul_rn(2.0f, u), 1.0f)));
    if (u > 0.9990234375f) v = __fadd_rn(v, 6.0f);  // 1023/1024, exact in fp32
    x[i] = FloatToBf16(v);
  }
}

__global__ void FillW(uint16_t* w, int64_t rows, int64_t hidden, int64_t head_cols) {
  const int64_t total = rows * hidden;
  const float base = 1.7320508f / sqrtf(static_cast<float>(hidden));
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / hidden;
    const float s = (r >= head_cols && r % 29 == 5) ? __fmul_rn(base, 20.0f) : base;
    w[i] = FloatToBf16(__fmul_rn(__fsub_rn(__fmul_rn(2.0f, Uniform(3, i)), 1.0f), s));
  }
}

}  // namespace

cudaError_t FillInputs(uint16_t* x, int64_t n, int64_t hidden, uint16_t* w, int64_t rows, int64_t head_cols,
                       cudaStream_t stream) {
  FillX<<<4096, 256, 0, stream>>>(x, n, hidden);
  FillW<<<4096, 256, 0, stream>>>(w, rows, hidden, head_cols);
  return cudaGetLastError();
}

}  // namespace kvpack::bench
