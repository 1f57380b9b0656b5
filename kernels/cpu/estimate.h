// The layer's error estimate from a caller's sample of Q, K and V (PlanRequest.sample): the per-head
// choice of the pre-pass (kernels/transform_choice.h) run on the sample once per format, every key
// in that format, so that an error budget can be resolved before the layer runs.
//
// Host-only; allocates O(H·d) tables plus the choice's per-head buffers. Cost: three choices, about
// 3 · 24 · 32 · min(n, 512) · d multiply-adds per head (≈ 0.15 s for H = 56, d = 128 on one core).
#pragma once

#include <array>
#include <cstdint>

#include "kernels/layer_spec.h"
#include "kernels/mma_path.h"

namespace kvpack::cpu {

// q, k, v: float [n, H, d] (after QK-norm and RoPE). Entry f: EstimatedRelError of the chosen
// tables with every key in format f (0 when smoothing and balancing are both off: nothing runs),
// choosing among the candidates the layer itself would: `mma` is the layer's requested MMA path, and
// where an entry of format f resolves it to INT8 (mma_path.h) q·k stays rotated (ChoiceTransforms).
std::array<double, kNumPageFormats> EstimateFromSample(const float* q, const float* k, const float* v, int64_t n,
                                                       const LayerShape& shape, const TransformOptions& transforms,
                                                       MmaPath mma, float softmax_scale, int n_threads);

}  // namespace kvpack::cpu
