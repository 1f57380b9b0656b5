#include "kernels/cpu/stats.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/layer.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/format.h"

namespace kvpack::cpu {

int64_t StatsSampleCount(int64_t n_tokens, const TransformOptions& transforms) {
  return std::min<int64_t>(n_tokens, std::max(transforms.stats_sample_tokens, 1));
}

namespace {

// λ of one head from its channels' spreads m_c (stats.h: the sample range for K, the RMS for V);
// spread[] is overwritten. Leaves lambda untouched (ones) when every spread is 0 or one is not finite.
void BalanceFromSpreads(double* spread, int d, float* lambda) {
  double widest = 0.0;
  for (int c = 0; c < d; ++c) widest = std::max(widest, spread[c]);
  if (!(widest > 0.0) || !std::isfinite(widest)) return;  // λ stays 1
  double log_sum = 0.0;
  for (int c = 0; c < d; ++c) {
    spread[c] = std::sqrt(std::max(spread[c], kLambdaFloor * widest));
    log_sum += std::log(spread[c]);
  }
  const double geo_mean = std::exp(log_sum / d);
  for (int c = 0; c < d; ++c) lambda[c] = static_cast<float>(spread[c] / geo_mean);
}

}  // namespace

KvStats StatsFromSample(int64_t n_sample, const LayerShape& shape, const TransformOptions& transforms,
                        const SampleRowFn& row, int n_threads) {
  const int d = shape.head_dim;
  const int64_t hd = shape.HeadCols();
  KvStats stats;
  stats.mu_k.assign(hd, 0.0f);
  stats.mu_v.assign(hd, 0.0f);
  stats.lambda.assign(hd, 1.0f);
  stats.lambda_v.assign(hd, 1.0f);
  if (!transforms.smooth && !transforms.balance) return stats;

  ParallelFor(n_threads, shape.n_heads, [&](int64_t h) {
    float k[kMaxHeadDimCpu], v[kMaxHeadDimCpu];
    double sum_k[kMaxHeadDimCpu] = {}, sum_v[kMaxHeadDimCpu] = {};
    double range_k[kMaxHeadDimCpu] = {}, rms_v[kMaxHeadDimCpu] = {};
    float* mu_k = stats.mu_k.data() + h * d;
    float* mu_v = stats.mu_v.data() + h * d;
    if (transforms.smooth) {
      for (int64_t i = 0; i < n_sample; ++i) {
        row(i, static_cast<int>(h), k, v);
        for (int c = 0; c < d; ++c) sum_k[c] += k[c], sum_v[c] += v[c];
      }
      for (int c = 0; c < d; ++c) {
        mu_k[c] = static_cast<float>(sum_k[c] / static_cast<double>(n_sample));
        mu_v[c] = static_cast<float>(sum_v[c] / static_cast<double>(n_sample));
      }
    }
    if (!transforms.balance) return;
    for (int64_t i = 0; i < n_sample; ++i) {
      row(i, static_cast<int>(h), k, v);
      for (int c = 0; c < d; ++c) {
        range_k[c] = std::max(range_k[c], std::fabs(static_cast<double>(k[c]) - mu_k[c]));
        const double dv = static_cast<double>(v[c]) - mu_v[c];
        rms_v[c] += dv * dv;  // sum of squares until the division below
      }
    }
    for (int c = 0; c < d; ++c) rms_v[c] = std::sqrt(rms_v[c] / static_cast<double>(n_sample));
    BalanceFromSpreads(range_k, d, stats.lambda.data() + h * d);
    BalanceFromSpreads(rms_v, d, stats.lambda_v.data() + h * d);
  });
  return stats;
}

TransformRecord FixedTransformRecord(const LayerShape& shape, const TransformOptions& transforms) {
  TransformRecord r;
  r.head_flags.assign(shape.n_heads, FixedHeadFlags(transforms));
  r.head_estimates.assign(static_cast<size_t>(shape.n_heads) * kHeadEstimateFields, 0.0f);
  return r;
}

TransformRecord ChooseTransforms(int64_t n_sample, int64_t n_queries, const LayerShape& shape,
                                 const TransformOptions& transforms, float softmax_scale, const SampleRowFn& row,
                                 const QueryRowFn& query, const std::function<PageFormat(int64_t i)>& format_of,
                                 KvStats* stats, int n_threads) {
  TransformRecord r = FixedTransformRecord(shape, transforms);
  const int d = shape.head_dim;
  const int64_t n_keys = EstimateKeyCount(n_sample);
  const int64_t n_q = query ? std::min<int64_t>(n_queries, kEstimateQueries) : 0;
  std::vector<PageFormat> formats(n_keys);
  for (int64_t j = 0; j < n_keys; ++j) formats[j] = format_of(EstimateKeyIndex(j, n_sample));
  ParallelFor(n_threads, shape.n_heads, [&](int64_t h) {
    std::vector<float> q(static_cast<size_t>(n_q) * d), k(static_cast<size_t>(n_keys) * d), v(k.size());
    for (int64_t j = 0; j < n_keys; ++j) row(EstimateKeyIndex(j, n_sample), static_cast<int>(h), &k[j * d], &v[j * d]);
    for (int64_t i = 0; i < n_q; ++i) query(i * n_queries / n_q, static_cast<int>(h), &q[i * d]);
    HeadSample sample;
    sample.head_dim = d;
    sample.n_keys = n_keys;
    sample.n_queries = n_q;
    sample.q = q.data(), sample.k = k.data(), sample.v = v.data();
    sample.formats = formats.data();
    const int64_t at = h * d;
    const HeadTables tables{stats->mu_k.data() + at, stats->mu_v.data() + at, stats->lambda.data() + at,
                            stats->lambda_v.data() + at};
    const HeadChoice choice = ChooseHeadTransforms(sample, transforms, softmax_scale, tables);
    r.head_flags[h] = choice.flags;
    float* e = r.head_estimates.data() + h * kHeadEstimateFields;
    for (int f = 0; f < kNumPageFormats; ++f) e[f] = static_cast<float>(choice.by_format[f].err);
    e[kNumPageFormats] = static_cast<float>(choice.by_format[0].ref);
  });
  return r;
}

KvStats ComputeStats(const float* k, const float* v, const LayerShape& shape, const TransformOptions& transforms) {
  const int64_t n = shape.n_tokens;
  const int64_t s = StatsSampleCount(n, transforms);
  const int d = shape.head_dim;
  const int64_t hd = shape.HeadCols();
  return StatsFromSample(
      s, shape, transforms,
      [&](int64_t i, int h, float* k_row, float* v_row) {
        const int64_t offset = StatsSampleToken(i, n, s) * hd + static_cast<int64_t>(h) * d;
        std::copy(k + offset, k + offset + d, k_row);
        std::copy(v + offset, v + offset + d, v_row);
      },
      0);
}

}  // namespace kvpack::cpu
