// Seeded inputs that bench/torch_baseline.py regenerates bit for bit: every value is a function of
// (seed, index) through a 32-bit integer hash computed with 64-bit products below 2^62 (the same
// arithmetic in torch int64), then fp32 → bf16 with round to nearest even.
//
//   u(seed, i)  = Hash32(seed · 2^32-ish mix + i) / 2^32 ∈ [0, 1)
//   x[t, j]     = mean_j + 1.7 · (2u − 1) + (u > 1023/1024 ? 6 : 0)          mean_j = 0.8 · (2u' − 1)
//   W[r, j]     = (2u − 1) · √3 / √D · (20 for K/V rows with r % 29 == 5, else 1)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvpack::bench {

// x [n, hidden] and w [rows, hidden] (rows = 3·H·d), bf16, on `stream`.
cudaError_t FillInputs(uint16_t* x, int64_t n, int64_t hidden, uint16_t* w, int64_t rows, int64_t head_cols,
                       cudaStream_t stream);

}  // namespace kvpack::bench
