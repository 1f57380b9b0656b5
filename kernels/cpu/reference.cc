// ReferenceAttention (layer.h): naive two-pass softmax attention in double precision over
// unquantized K and V — no transforms, no quantization, the accuracy yardstick. Masks as in
// attention.h (sequence ids; causal on key token index ≤ query position); a query that sees no key
// gets zeros. Parallel over queries; each (query, head) is computed independently in a fixed order.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/layer.h"
#include "kernels/cpu/thread_pool.h"

namespace kvpack::cpu {

void ReferenceAttention(const QueryBlock& queries, const float* k, const float* v, const int32_t* key_seq_ids,
                        int64_t n_k, int n_heads, int head_dim, const AttentionOptions& attention, double* out) {
  const int d = head_dim;
  const double scale = attention.softmax_scale > 0.0f ? static_cast<double>(attention.softmax_scale)
                                                      : 1.0 / std::sqrt(static_cast<double>(d));
  ParallelFor(0, queries.n_q, [&](int64_t t) {
    const int32_t seq = queries.seq_ids ? queries.seq_ids[t] : 0;
    const int64_t pos = queries.positions ? queries.positions[t] : t;
    std::vector<double> score(static_cast<size_t>(n_k));
    for (int h = 0; h < n_heads; ++h) {
      const float* q = queries.q + (t * n_heads + h) * d;
      double best = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n_k; ++j) {
        const bool visible = (key_seq_ids ? key_seq_ids[j] : 0) == seq && (!attention.causal || j <= pos);
        if (!visible) {
          score[j] = -std::numeric_limits<double>::infinity();
          continue;
        }
        const float* kr = k + (j * n_heads + h) * d;
        double s = 0.0;
        for (int c = 0; c < d; ++c) s += static_cast<double>(q[c]) * kr[c];
        score[j] = s * scale;
        best = std::max(best, score[j]);
      }
      double* o = out + (t * n_heads + h) * d;
      std::fill(o, o + d, 0.0);
      if (best == -std::numeric_limits<double>::infinity()) continue;
      double sum = 0.0;
      for (int64_t j = 0; j < n_k; ++j) {
        if (score[j] == -std::numeric_limits<double>::infinity()) continue;
        const double e = std::exp(score[j] - best);
        sum += e;
        const float* vr = v + (j * n_heads + h) * d;
        for (int c = 0; c < d; ++c) o[c] += e * vr[c];
      }
      for (int c = 0; c < d; ++c) o[c] /= sum;
    }
  });
}

}  // namespace kvpack::cpu
