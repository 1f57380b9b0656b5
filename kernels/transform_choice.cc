#include "kernels/transform_choice.h"

#include <algorithm>
#include <cmath>

#include "kernels/rotation.h"
#include "kernels/transform_select.h"

namespace kvpack {
namespace {

// The rows a candidate stores with, derived from the full tables (every allowed transform on).
struct CandidateRows {
  std::vector<float> mu_k, lambda, mu_v, lambda_v;
};

CandidateRows RowsOf(const ChoiceCandidate& c, const HeadTables& full, int d) {
  CandidateRows r;
  r.mu_k.resize(d);
  r.lambda.resize(d);
  r.mu_v.resize(d);
  r.lambda_v.resize(d);
  for (int i = 0; i < d; ++i) {
    r.mu_k[i] = c.MuK(full.mu_k, i);
    r.lambda[i] = c.Lambda(full.lambda, i);
    r.mu_v[i] = c.MuV(full.mu_v, i);
    r.lambda_v[i] = c.LambdaV(full.lambda_v, i);
  }
  return r;
}

// Rows through their stored form (StoredRowOf), each in its own format or all in `format_override`.
std::vector<float> StoredRows(const float* rows, int64_t n, int d, const float* mu, const float* lambda, bool rotate,
                              uint64_t seed, const PageFormat* formats, const PageFormat* format_override) {
  std::vector<float> out(static_cast<size_t>(n) * d);
  for (int64_t j = 0; j < n; ++j) {
    StoredRowOf(rows + j * d, d, mu, lambda, rotate, seed, format_override ? *format_override : formats[j],
                out.data() + j * d);
  }
  return out;
}

// Softmax probabilities [n_q, n_k] of scale·q·k in double. Each dot runs over c in order, as a plain
// loop would; K is read transposed so that the loop over keys is the inner one (independent sums,
// vectorised) instead of one dependent chain per dot: the same values, ~10x sooner.
std::vector<double> Probabilities(const float* q, int64_t n_q, const float* k, int64_t n_k, int d, double scale) {
  std::vector<double> p(static_cast<size_t>(n_q) * n_k);
  std::vector<double> kt(static_cast<size_t>(d) * n_k);  // [d, n_k]
  for (int64_t j = 0; j < n_k; ++j) {
    for (int c = 0; c < d; ++c) kt[c * n_k + j] = k[j * d + c];
  }
  for (int64_t i = 0; i < n_q; ++i) {
    double* row = p.data() + i * n_k;
    std::fill(row, row + n_k, 0.0);
    for (int c = 0; c < d; ++c) {
      const double qc = q[i * d + c];
      const double* kc = kt.data() + c * n_k;
      for (int64_t j = 0; j < n_k; ++j) row[j] += qc * kc[j];
    }
    double mx = -HUGE_VAL;
    for (int64_t j = 0; j < n_k; ++j) {
      row[j] *= scale;
      mx = std::max(mx, row[j]);
    }
    double sum = 0.0;
    for (int64_t j = 0; j < n_k; ++j) sum += (row[j] = ChoiceExp(row[j] - mx));
    for (int64_t j = 0; j < n_k; ++j) row[j] /= sum;
  }
  return p;
}

// o_i = λ_v ⊙ Rᵀ(Σ_j p_ij v_j) + μ_v for stored values v (rotate false, μ 0, λ 1: plain Σ p v);
// returns the squared distance to ref [n_q, d] and ref's squared norm.
ErrorSums OutputError(const std::vector<double>& p, int64_t n_q, const float* v, int64_t n_k, int d, const float* mu,
                      const float* lambda_v, bool rotate, uint64_t seed, const std::vector<double>& ref) {
  ErrorSums e;
  double acc[kMaxHeadDimCpu];
  float o[kMaxHeadDimCpu];
  for (int64_t i = 0; i < n_q; ++i) {
    std::fill(acc, acc + d, 0.0);
    for (int64_t j = 0; j < n_k; ++j) {
      const double pj = p[i * n_k + j];
      for (int c = 0; c < d; ++c) acc[c] += pj * v[j * d + c];
    }
    for (int c = 0; c < d; ++c) o[c] = static_cast<float>(acc[c]);
    double err = 0.0, norm = 0.0;
    QueryErrorOf(o, d, mu, lambda_v, rotate, seed, ref.data() + i * d, &err, &norm);
    AddQueryError(err, norm, &e);
  }
  return e;
}

// Everything one head's evaluation shares: the exact reference, the queries, and what candidates
// have in common. The choice evaluates ~15 (K side, V side, format) combinations made of 3 K sides
// and 6 V sides: each side's stored rows (and a K side's probabilities) are computed once per format
// and reused: with the transposed dot product and -O3 (CMakeLists.txt) 17 instead of 35 ms per head at
// d = 128 on one core of the CI machine, the same values as computing each anew.
class HeadEstimator {
 public:
  HeadEstimator(const HeadSample& s, const TransformOptions& t, float softmax_scale, const HeadTables& full)
      : s_(s), t_(t), d_(s.head_dim), full_(full), zeros_(s.head_dim, 0.0f), ones_(s.head_dim, 1.0f) {
    scale_ = EstimateSoftmaxScale(softmax_scale, d_);
    p_ref_ = Probabilities(s.q, s.n_queries, s.k, s.n_keys, d_, scale_);
    ref_.assign(static_cast<size_t>(s.n_queries) * d_, 0.0);
    for (int64_t i = 0; i < s.n_queries; ++i) {
      for (int64_t j = 0; j < s.n_keys; ++j) {
        const double pj = p_ref_[i * s.n_keys + j];
        for (int c = 0; c < d_; ++c) ref_[i * d_ + c] += pj * s.v[j * d_ + c];
      }
    }
    // A format override equal to every sampled key's own format is the same as none.
    uniform_ = s.n_keys > 0 ? static_cast<int>(s.formats[0]) : -1;
    for (int64_t j = 1; j < s.n_keys && uniform_ >= 0; ++j) {
      if (s.formats[j] != s.formats[0]) uniform_ = -1;
    }
  }

  // The evaluator of SelectHeadTransforms (transform_select.h); f = −1: each key in its own range's
  // format, else every key in PageFormat f.
  ErrorSums KOnly(const ChoiceCandidate& c) {
    return OutputError(KProbabilities(c, nullptr), s_.n_queries, s_.v, s_.n_keys, d_, zeros_.data(), ones_.data(),
                       false, 0, ref_);
  }
  ErrorSums VOnly(const ChoiceCandidate& c) { return VError(p_ref_, c, nullptr); }
  ErrorSums Both(const ChoiceCandidate& c, int f) {
    const PageFormat format = static_cast<PageFormat>(f < 0 ? 0 : f);
    return Both(c, f < 0 ? nullptr : &format);
  }
  ErrorSums Both(const ChoiceCandidate& c, const PageFormat* format) {
    return VError(KProbabilities(c, format), c, format);
  }

  // Any rows (EstimateHeadError), nothing cached.
  ErrorSums BothOfRows(const CandidateRows& rows, uint32_t flags, const PageFormat* format) const {
    const bool rotate_k = HeadRotatesK(t_.rotate, &flags, 0), rotate_v = HeadRotatesV(t_.rotate, &flags, 0);
    const std::vector<double> p = Probabilities(StoredQueries(rows, rotate_k).data(), s_.n_queries,
                                                StoredRows(s_.k, s_.n_keys, d_, rows.mu_k.data(), rows.lambda.data(),
                                                           rotate_k, t_.seed, s_.formats, format)
                                                    .data(),
                                                s_.n_keys, d_, scale_);
    const std::vector<float> v = StoredRows(s_.v, s_.n_keys, d_, rows.mu_v.data(), rows.lambda_v.data(), rotate_v,
                                            t_.seed, s_.formats, format);
    return OutputError(p, s_.n_queries, v.data(), s_.n_keys, d_, rows.mu_v.data(), rows.lambda_v.data(), rotate_v,
                       t_.seed, ref_);
  }

 private:
  static constexpr int kKSides = 8, kVSides = 12, kFormatKeys = kNumPageFormats + 1;

  int FormatKey(const PageFormat* format) const {
    if (format == nullptr || static_cast<int>(*format) == uniform_) return 0;
    return 1 + static_cast<int>(*format);
  }
  static int KSide(const ChoiceCandidate& c) {
    return (c.smooth_k ? 1 : 0) | (c.balance_k ? 2 : 0) | (c.plain_k ? 4 : 0);
  }
  static int VSide(const ChoiceCandidate& c) {
    return c.v_smooth_halves * 2 + (c.balance_v ? 1 : 0) + (c.plain_v ? 6 : 0);
  }

  // q as the layer stores it: ⊙ λ, R (unless plain), bf16.
  std::vector<float> StoredQueries(const CandidateRows& rows, bool rotate) const {
    std::vector<float> q(static_cast<size_t>(s_.n_queries) * d_);
    for (int64_t i = 0; i < s_.n_queries; ++i) {
      StoredQueryOf(s_.q + i * d_, d_, rows.lambda.data(), rotate, t_.seed, q.data() + i * d_);
    }
    return q;
  }

  // Probabilities through the candidate's K side.
  const std::vector<double>& KProbabilities(const ChoiceCandidate& c, const PageFormat* format) {
    std::vector<double>& p = k_probs_[KSide(c)][FormatKey(format)];
    if (p.empty()) {
      const CandidateRows rows = RowsOf(c, full_, d_);
      const bool rotate = c.RotatesK(t_.rotate);
      const std::vector<float> k = StoredRows(s_.k, s_.n_keys, d_, rows.mu_k.data(), rows.lambda.data(), rotate,
                                              t_.seed, s_.formats, FormatKey(format) == 0 ? nullptr : format);
      p = Probabilities(StoredQueries(rows, rotate).data(), s_.n_queries, k.data(), s_.n_keys, d_, scale_);
    }
    return p;
  }

  ErrorSums VError(const std::vector<double>& p, const ChoiceCandidate& c, const PageFormat* format) {
    const CandidateRows rows = RowsOf(c, full_, d_);
    std::vector<float>& v = stored_v_[VSide(c)][FormatKey(format)];
    if (v.empty()) {
      v = StoredRows(s_.v, s_.n_keys, d_, rows.mu_v.data(), rows.lambda_v.data(), c.RotatesV(t_.rotate), t_.seed,
                     s_.formats, FormatKey(format) == 0 ? nullptr : format);
    }
    return OutputError(p, s_.n_queries, v.data(), s_.n_keys, d_, rows.mu_v.data(), rows.lambda_v.data(),
                       c.RotatesV(t_.rotate), t_.seed, ref_);
  }

  const HeadSample& s_;
  const TransformOptions& t_;
  const int d_;
  const HeadTables full_;
  double scale_ = 1.0;
  int uniform_ = -1;  // the format of every sampled key, or -1
  std::vector<float> zeros_, ones_;
  std::vector<double> p_ref_, ref_;
  std::vector<double> k_probs_[kKSides][kFormatKeys];
  std::vector<float> stored_v_[kVSides][kFormatKeys];
};

bool HasQueries(const HeadSample& s) { return s.q != nullptr && s.n_queries > 0 && s.n_keys > 0; }

void WriteRows(const CandidateRows& rows, const HeadTables& tables) {
  std::copy(rows.mu_k.begin(), rows.mu_k.end(), tables.mu_k);
  std::copy(rows.lambda.begin(), rows.lambda.end(), tables.lambda);
  std::copy(rows.mu_v.begin(), rows.mu_v.end(), tables.mu_v);
  std::copy(rows.lambda_v.begin(), rows.lambda_v.end(), tables.lambda_v);
}

}  // namespace

int64_t EstimateKeyCount(int64_t n_sample) { return std::min<int64_t>(n_sample, kEstimateKeys); }
int64_t EstimateQueryCount(int64_t n_sample) { return std::min<int64_t>(n_sample, kEstimateQueries); }

double ErrorSums::Rel() const { return ref > 0.0 ? std::sqrt(err / ref) : std::sqrt(err); }

double EstimatedRelError(const float* head_estimates, int n_heads, PageFormat format) {
  double err = 0.0, ref = 0.0;
  for (int h = 0; h < n_heads; ++h) {
    err += head_estimates[h * kHeadEstimateFields + static_cast<int>(format)];
    ref += head_estimates[h * kHeadEstimateFields + kNumPageFormats];
  }
  return ref > 0.0 ? std::sqrt(err / ref) : 0.0;
}

uint32_t FixedHeadFlags(const TransformOptions& t) { return FixedFlagsOf(t); }

uint32_t CallerStatsHeadFlags(const TransformOptions& t, const KvStats& stats, int h) {
  const uint32_t plain = t.rotate && !stats.head_flags.empty() ? stats.head_flags[h] & (kHeadPlainK | kHeadPlainV) : 0u;
  return FixedFlagsOf(t) | plain;
}

HeadChoice ChooseHeadTransforms(const HeadSample& sample, const TransformOptions& transforms, float softmax_scale,
                                const HeadTables& tables) {
  HeadChoice choice;
  choice.flags = FixedHeadFlags(transforms);
  if (!HasQueries(sample)) return choice;
  HeadEstimator est(sample, transforms, softmax_scale, tables);
  if (!transforms.choose_per_head) {
    const ChoiceCandidate fixed = FixedCandidate(transforms);
    choice.naive = est.Both(ChoiceCandidate{}, -1);
    choice.chosen = est.Both(fixed, -1);
    for (int f = 0; f < kNumPageFormats; ++f) choice.by_format[f] = est.Both(fixed, f);
    return choice;
  }
  ChoiceCandidate kept;
  choice = SelectHeadTransforms(est, transforms, &kept);
  WriteRows(RowsOf(kept, tables, sample.head_dim), tables);
  return choice;
}

ErrorSums EstimateHeadError(const HeadSample& sample, const TransformOptions& transforms, float softmax_scale,
                            const HeadTables& tables, uint32_t flags, PageFormat format) {
  if (!HasQueries(sample)) return {};
  const int d = sample.head_dim;
  HeadEstimator est(sample, transforms, softmax_scale, tables);
  CandidateRows rows;
  rows.mu_k.assign(tables.mu_k, tables.mu_k + d);
  rows.lambda.assign(tables.lambda, tables.lambda + d);
  rows.mu_v.assign(tables.mu_v, tables.mu_v + d);
  rows.lambda_v.assign(tables.lambda_v, tables.lambda_v + d);
  return est.BothOfRows(rows, flags, &format);
}

}  // namespace kvpack
