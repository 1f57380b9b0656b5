// Streamed QKV projection on the CPU: one token row of x times a block of W's rows.
//
// qkv = x · Wᵀ (nn.Linear layout: W is [3·H·d, D], row j is output column j). Each output element is
// an fp32 dot product over D in a FIXED order, then rounded to bf16 as a GEMM into a bf16 workspace
// would be. The order: eight partial sums, lane l accumulating x[i]·w[i] for i ≡ l (mod 8) in
// increasing i, then combined as ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)). The result of an element
// therefore depends only on its row of x and its row of W, never on the chunk it was computed in,
// which is what makes every projection_chunk / query_chunk size give bit-identical layers.
#pragma once

#include <cstdint>

namespace kvpack::cpu {

// fp32 dot product of two bf16 vectors of length n, in the fixed order above.
float DotBf16(const uint16_t* a, const uint16_t* b, int n);

// out[j] = bf16(x_row · W[col_begin + j]) for j < n_cols. x_row has `hidden` bf16 values; W rows are
// `hidden` long and contiguous. Single-threaded; callers parallelise over rows.
void ProjectRow(const uint16_t* x_row, const uint16_t* w, int hidden, int64_t col_begin, int64_t n_cols,
                uint16_t* out);

}  // namespace kvpack::cpu
