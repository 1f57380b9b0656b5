#include "kernels/cpu/estimate.h"

#include <algorithm>
#include <climits>

#include "kernels/cpu/layer.h"
#include "kernels/cpu/stats.h"
#include "kernels/transform_choice.h"

namespace kvpack::cpu {

std::array<double, kNumPageFormats> EstimateFromSample(const float* q, const float* k, const float* v, int64_t n,
                                                       const LayerShape& shape, const TransformOptions& transforms,
                                                       MmaPath mma, float softmax_scale, int n_threads) {
  std::array<double, kNumPageFormats> out{};
  if (!transforms.smooth && !transforms.balance) return out;
  TransformOptions t = transforms;
  t.stats_sample_tokens = static_cast<int>(std::min<int64_t>(n, INT32_MAX));  // the whole sample
  LayerShape sample_shape = shape;
  sample_shape.n_tokens = n;
  const int d = shape.head_dim;
  const int64_t hd = shape.HeadCols();
  const KvStats full = ComputeStats(k, v, sample_shape, t);
  for (int f = 0; f < kNumPageFormats; ++f) {
    KvStats stats = full;
    const PageFormat format = static_cast<PageFormat>(f);
    const TransformRecord record = ChooseTransforms(  // as an entry of this format alone would choose
        n, n, sample_shape, ChoiceTransforms(t, ResolveMmaPath(mma, format == PageFormat::kBf16, d, t.rotate)),
        softmax_scale,
        [&](int64_t i, int h, float* k_row, float* v_row) {
          const int64_t at = i * hd + static_cast<int64_t>(h) * d;
          std::copy(k + at, k + at + d, k_row);
          std::copy(v + at, v + at + d, v_row);
        },
        [&](int64_t i, int h, float* q_row) {
          const int64_t at = i * hd + static_cast<int64_t>(h) * d;
          std::copy(q + at, q + at + d, q_row);
        },
        [&](int64_t) { return format; }, &stats, n_threads);
    out[f] = EstimatedRelError(record.head_estimates.data(), shape.n_heads, format);
  }
  return out;
}

}  // namespace kvpack::cpu
