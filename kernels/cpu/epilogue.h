// The fp32 epilogue of one (token, head) row of d channels, in the order the layer applies it:
//
//   value = bf16 projection (read as fp32)
//     → + bias                         (LayerTensors::bias, when has_bias)
//     → QK-norm (q and k only)         x · 1/sqrt(mean(x²) + eps) · w
//     → RoPE (q and k only)            pairs of the first R = Σ axis_dims channels turn by pos·freq
//     → stored form:
//         K:  (k − μ_k) / λ  → R·  → quantized into its page (format.h)
//         V:  (v − μ_v) / λ_v → R· → quantized into its page
//         Q:  q ⊙ λ          → R·  → rounded to bf16 (the GPU keeps Q as bf16 too)
//
// Arithmetic, so that the CUDA epilogue can mirror it:
//   QK-norm: mean(x²) summed in fp32 in channel order, divided by d; scale = 1/sqrtf(mean + eps)
//            (correctly rounded sqrt and division), then x·scale·w left to right.
//   RoPE:    pair j of the rotary channels (interleaved: channels 2j, 2j+1; split halves: j, j+R/2)
//            belongs to axis a whose section [s_a, s_a + axis_dims[a]/2) holds j; i = j − s_a;
//            inv_freq = float(theta^(−2i/axis_dims[a])) computed in double, angle = pos · inv_freq
//            in fp32 (pos = positions[token·n_axes + a]), c = cosf(angle), s = sinf(angle);
//            (x0, x1) ← (x0·c − x1·s, x0·s + x1·c). Channels ≥ R are untouched.
// All functions are pure, single-row and allocation-free; REQUIRES d ≤ kMaxHeadDimCpu.
#pragma once

#include <cstdint>

#include "kernels/layer_spec.h"

namespace kvpack::cpu {

// Which of the three projections a row belongs to.
enum class Proj { kQ = 0, kK = 1, kV = 2 };

// Parameters of the epilogue shared by all rows of a layer (host pointers, may be null when the
// option is off).
struct EpilogueParams {
  int n_heads = 0;
  int head_dim = 0;
  const float* bias = nullptr;           // [3·H·d] or null
  const float* q_norm_weight = nullptr;  // null unless qk_norm.enabled
  const float* k_norm_weight = nullptr;
  QkNormOptions qk_norm;
  RopeOptions rope;
  const float* positions = nullptr;      // [N, rope.n_axes] or null
};

EpilogueParams MakeEpilogueParams(const LayerConfig& config, const LayerTensors& tensors);

// x[d] ← x · 1/sqrt(mean(x²) + eps) · w, w of length d (already offset to the head when per-head).
void ApplyQkNorm(float* x, int d, const float* w, float eps);

// Rotary embedding of one row at `position` (n_axes values).
void ApplyRope(float* x, int d, const RopeOptions& rope, const float* position);

// Bias, QK-norm and RoPE of one row. `row` holds the d bf16 projection values of (token, head) for
// projection `proj`; x receives the fp32 result.
void EpilogueRow(const EpilogueParams& p, Proj proj, int64_t token, int head, const uint16_t* row, float* x);

// Stored forms. x is the epilogued row (d floats); mu and lambda are the head's d entries.
// K: x ← R·((x − μ)/λ); V: x ← R·((x − μ)/λ_v); Q: x ← R·(x ⊙ λ), then each value rounded to bf16.
void ToStoredK(float* x, int d, const float* mu, const float* lambda, bool rotate, uint64_t seed);
void ToStoredV(float* x, int d, const float* mu, const float* lambda_v, bool rotate, uint64_t seed);
void ToStoredQ(float* x, int d, const float* lambda, bool rotate, uint64_t seed);

}  // namespace kvpack::cpu
