#include "kernels/cpu/quality.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/pack.h"
#include "kernels/cpu/sparse_attention.h"
#include "kernels/cpu/stats.h"

namespace kvpack::cpu {
namespace {

constexpr int kFactorRank = 8;
constexpr double kStudentNu = 4.0;
constexpr int kCalibrationQueries = 64;
constexpr int kCalibrationKeys = 256;

// Unit-variance Student-t sample.
double StudentT(std::mt19937_64& rng) {
  std::student_t_distribution<double> t(kStudentNu);
  return t(rng) / std::sqrt(kStudentNu / (kStudentNu - 2.0));
}

struct ChannelModel {
  std::vector<double> offset, sigma;
};

ChannelModel MakeChannels(std::mt19937_64& rng, int d, int n_outliers, double outlier_scale) {
  std::normal_distribution<double> normal(0.0, 1.0);
  ChannelModel m;
  m.offset.resize(d);
  m.sigma.resize(d);
  for (int c = 0; c < d; ++c) {
    m.offset[c] = 1.5 * normal(rng);
    m.sigma[c] = std::exp(0.3 * normal(rng));
  }
  std::vector<int> channels(d);
  for (int c = 0; c < d; ++c) channels[c] = c;
  std::shuffle(channels.begin(), channels.end(), rng);
  for (int i = 0; i < std::min(n_outliers, d); ++i) {
    m.offset[channels[i]] *= outlier_scale;
    m.sigma[channels[i]] *= outlier_scale;
  }
  return m;
}

// Fills rows [n, H, d] of head h from the channel model with heavy-tailed low-rank structure.
void FillStructured(std::mt19937_64& rng, const ChannelModel& m, int64_t n, int heads, int h, int d,
                    std::vector<float>* out) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> basis(static_cast<size_t>(kFactorRank) * d);
  for (double& b : basis) b = normal(rng) / std::sqrt(static_cast<double>(kFactorRank));
  std::vector<double> f(kFactorRank);
  for (int64_t t = 0; t < n; ++t) {
    for (double& x : f) x = normal(rng);
    float* row = out->data() + (t * heads + h) * d;
    for (int c = 0; c < d; ++c) {
      double low_rank = 0.0;
      for (int r = 0; r < kFactorRank; ++r) low_rank += f[r] * basis[r * d + c];
      const double z = 0.6 * low_rank + 0.8 * StudentT(rng);
      row[c] = static_cast<float>(m.offset[c] + m.sigma[c] * z);
    }
  }
}

double Norm(const std::vector<double>& x) {
  double s = 0.0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}


// Scales q rows of head h so that the mean over sampled queries of the std over sampled keys of
// scale·q·k is kLogitStd (a temperature typical of trained heads).
void CalibrateTemperature(const SyntheticOptions& o, int h, double scale, SyntheticData* data) {
  CalibrateLogitStd(data, o.n_q, o.n_k, o.n_heads, h, o.head_dim, scale, kLogitStd, kCalibrationQueries,
                    kCalibrationKeys);
}

// The kSinks edit of head h (quality.h): sink keys that take `mass` of every query's attention,
// with V rows near zero. k_offset are the head's K channel offsets, v_sigma its V channel spreads.
void AddSinks(std::mt19937_64& rng, const SyntheticOptions& o, int h, double scale, double mass,
              const std::vector<double>& k_offset, const std::vector<double>& v_sigma, SyntheticData* data) {
  std::normal_distribution<double> normal(0.0, 1.0);
  const int heads = o.n_heads;
  const int d = o.head_dim;
  std::vector<double> u(d);
  for (double& x : u) x = normal(rng);
  const double nu = Norm(u);
  for (double& x : u) x /= nu;
  std::vector<double> norms(o.n_q);
  for (int64_t t = 0; t < o.n_q; ++t) {
    const float* row = data->q.data() + (t * heads + h) * d;
    double s = 0.0;
    for (int c = 0; c < d; ++c) s += static_cast<double>(row[c]) * row[c];
    norms[t] = std::sqrt(s);
  }
  std::nth_element(norms.begin(), norms.begin() + o.n_q / 2, norms.end());
  const double a = 0.5 * norms[o.n_q / 2];
  for (int64_t t = 0; t < o.n_q; ++t) {
    float* row = data->q.data() + (t * heads + h) * d;
    for (int c = 0; c < d; ++c) row[c] = static_cast<float>(row[c] + a * u[c]);
  }
  // Lead Δ of a sink's logit: n_sink·e^Δ / (n_sink·e^Δ + N·E[e^l]) = mass, E[e^l] = e^{σ²/2}.
  const int n_sink = static_cast<int>(std::min<int64_t>(kSinkTokens, o.n_k));
  const double lead = std::log(mass / (1.0 - mass) * static_cast<double>(o.n_k) *
                               std::exp(0.5 * kLogitStd * kLogitStd) / n_sink);
  const double b = a > 0.0 ? lead / (scale * a) : 0.0;
  std::uniform_int_distribution<int64_t> pick(1, std::max<int64_t>(o.n_k - 1, 1));
  for (int i = 0; i < n_sink; ++i) {
    const int64_t t = i == 0 ? 0 : pick(rng);
    float* k = data->k.data() + (t * heads + h) * d;
    float* v = data->v.data() + (t * heads + h) * d;
    for (int c = 0; c < d; ++c) {
      k[c] = static_cast<float>(k_offset[c] + b * u[c]);
      v[c] = static_cast<float>(kSinkValueScale * v_sigma[c] * normal(rng));
    }
  }
}

// The kQkNorm edit of head h's rows [n, H, d]: RMS-normalised, times a per-channel gain.
void NormalizeRows(std::mt19937_64& rng, int64_t n, int heads, int h, int d, std::vector<float>* rows) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> gain(d);
  for (double& g : gain) g = std::exp(0.2 * normal(rng));
  for (int64_t t = 0; t < n; ++t) {
    float* row = rows->data() + (t * heads + h) * d;
    double s = 0.0;
    for (int c = 0; c < d; ++c) s += static_cast<double>(row[c]) * row[c];
    const double inv_rms = 1.0 / std::sqrt(s / d + 1e-6);
    for (int c = 0; c < d; ++c) row[c] = static_cast<float>(row[c] * inv_rms * gain[c]);
  }
}

}  // namespace

bool ParseSyntheticKind(const std::string& name, SyntheticKind* kind) {
  for (SyntheticKind k : {SyntheticKind::kOutliers, SyntheticKind::kSinks, SyntheticKind::kQkNorm}) {
    if (name == SyntheticKindName(k)) return *kind = k, true;
  }
  return false;
}

const char* SyntheticKindName(SyntheticKind kind) {
  switch (kind) {
    case SyntheticKind::kOutliers: return "outliers";
    case SyntheticKind::kSinks: return "sinks";
    case SyntheticKind::kQkNorm: return "qknorm";
  }
  return "?";
}

SyntheticData MakeSyntheticData(const SyntheticOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int heads = o.n_heads;
  const int d = o.head_dim;
  SyntheticData data;
  data.k.resize(static_cast<size_t>(o.n_k) * heads * d);
  data.v.resize(data.k.size());
  data.q.resize(static_cast<size_t>(o.n_q) * heads * d);
  const double scale = o.softmax_scale > 0.0f ? o.softmax_scale : 1.0 / std::sqrt(static_cast<double>(d));
  for (int h = 0; h < heads; ++h) {
    const ChannelModel km = MakeChannels(rng, d, kOutlierChannelsK, o.outlier_scale);
    const ChannelModel vm = MakeChannels(rng, d, kOutlierChannelsV, o.outlier_scale);
    FillStructured(rng, km, o.n_k, heads, h, d, &data.k);
    FillStructured(rng, vm, o.n_k, heads, h, d, &data.v);
    std::vector<double> q_sigma(d);
    for (double& s : q_sigma) s = std::exp(0.3 * normal(rng));
    std::uniform_int_distribution<int64_t> pick(0, o.n_k - 1);
    std::vector<double> aligned(d), noise(d);
    for (int64_t t = 0; t < o.n_q; ++t) {
      const float* key = data.k.data() + (pick(rng) * heads + h) * d;
      for (int c = 0; c < d; ++c) {
        aligned[c] = key[c] - km.offset[c];
        noise[c] = q_sigma[c] * normal(rng);
      }
      const double na = Norm(aligned), nn = Norm(noise);
      float* row = data.q.data() + (t * heads + h) * d;
      for (int c = 0; c < d; ++c) row[c] = static_cast<float>(0.5 * aligned[c] / na + 0.5 * noise[c] / nn);
    }
    CalibrateTemperature(o, h, scale, &data);
    if (o.kind == SyntheticKind::kSinks && h % 4 != 3) {
      const double mass = kSinkMassMin + (kSinkMassMax - kSinkMassMin) * (h % 4) / 2.0;
      AddSinks(rng, o, h, scale, mass, km.offset, vm.sigma, &data);
    } else if (o.kind == SyntheticKind::kQkNorm) {
      NormalizeRows(rng, o.n_q, heads, h, d, &data.q);
      NormalizeRows(rng, o.n_k, heads, h, d, &data.k);
      CalibrateTemperature(o, h, scale, &data);
    }
  }
  return data;
}

QualityResult CompareOutputs(const double* reference, const float* out, int64_t n_q, int n_heads, int head_dim) {
  QualityResult r;
  r.head_rel_l2.assign(n_heads, 0.0);
  r.head_cosine.assign(n_heads, 0.0);
  std::vector<double> head_err(n_heads, 0.0), head_ref(n_heads, 0.0);
  double cos_sum = 0.0;
  for (int64_t t = 0; t < n_q; ++t) {
    for (int h = 0; h < n_heads; ++h) {
      const double* a = reference + (t * n_heads + h) * head_dim;
      const float* b = out + (t * n_heads + h) * head_dim;
      double dot = 0.0, aa = 0.0, bb = 0.0, err = 0.0;
      for (int c = 0; c < head_dim; ++c) {
        dot += a[c] * b[c];
        aa += a[c] * a[c];
        bb += static_cast<double>(b[c]) * b[c];
        err += (a[c] - b[c]) * (a[c] - b[c]);
      }
      const double cosine = aa > 0.0 && bb > 0.0 ? dot / std::sqrt(aa * bb) : (aa == bb ? 1.0 : 0.0);
      r.head_cosine[h] += cosine;
      cos_sum += cosine;
      head_err[h] += err;
      head_ref[h] += aa;
    }
  }
  double err_all = 0.0, ref_all = 0.0;
  for (int h = 0; h < n_heads; ++h) {
    r.head_rel_l2[h] = head_ref[h] > 0.0 ? std::sqrt(head_err[h] / head_ref[h]) : std::sqrt(head_err[h]);
    r.head_cosine[h] /= std::max<int64_t>(n_q, 1);
    err_all += head_err[h];
    ref_all += head_ref[h];
  }
  for (int h = 0; h < n_heads; ++h) {
    if (r.head_cosine[h] < r.head_cosine[r.worst_head]) r.worst_head = h;
  }
  r.worst_head_cosine = n_heads > 0 ? r.head_cosine[r.worst_head] : 0.0;
  r.rel_l2 = ref_all > 0.0 ? std::sqrt(err_all / ref_all) : std::sqrt(err_all);
  r.cosine = cos_sum / std::max<int64_t>(n_q * n_heads, 1);
  return r;
}

Error AttendPackedFloat(const float* q, int64_t n_q, const float* k, const float* v, int64_t n_k, int n_heads,
                        int head_dim, PageFormat format, const TransformOptions& transforms,
                        const AttentionOptions& attention, const CpuOptions& options, float* out,
                        double* bits_per_value, TransformRecord* record, SparseReport* sparse_report,
                        float* bf16_path_out) {
  LayerShape shape;
  shape.n_tokens = n_k;
  shape.hidden = n_heads * head_dim;
  shape.n_heads = n_heads;
  shape.head_dim = head_dim;
  if (Error e = ValidateShape(shape, false); !e.ok()) return e;
  const std::vector<TokenRange> ranges = {{0, n_k, 0, format}};
  if (Error e = ValidateRanges(n_k, ranges); !e.ok()) return e;
  const KvLayout layout = PlanKvLayout(shape, ranges);
  std::vector<uint8_t> block(layout.total_bytes);
  KvStats stats = ComputeStats(k, v, shape, transforms);
  TransformRecord chosen = FixedTransformRecord(shape, transforms);
  if (transforms.smooth || transforms.balance) {
    const int64_t hd = shape.HeadCols();
    const int64_t s = StatsSampleCount(n_k, transforms);
    const MmaPath mma = ResolveMmaPath(attention.mma, format == PageFormat::kBf16, head_dim, transforms.rotate);
    chosen = ChooseTransforms(
        s, n_q, shape, ChoiceTransforms(transforms, mma), attention.softmax_scale,
        [&](int64_t i, int h, float* k_row, float* v_row) {
          const int64_t at = StatsSampleToken(i, n_k, s) * hd + static_cast<int64_t>(h) * head_dim;
          std::copy(k + at, k + at + head_dim, k_row);
          std::copy(v + at, v + at + head_dim, v_row);
        },
        [&](int64_t i, int h, float* q_row) {
          const int64_t at = i * hd + static_cast<int64_t>(h) * head_dim;
          std::copy(q + at, q + at + head_dim, q_row);
        },
        [&](int64_t) { return format; }, &stats, options.n_threads);
  }
  if (Error e = PackKv(k, v, shape, ranges, stats, transforms, block.data(), options, &chosen); !e.ok()) return e;
  if (record != nullptr) *record = chosen;
  const KvEntryView view = MakeKvView(layout, shape, block.data(), transforms);
  QueryBlock queries;
  queries.q = q;
  queries.n_q = n_q;
  std::vector<int64_t> last(static_cast<size_t>(n_q), n_k - 1);  // positions only matter when causal
  if (attention.sparse.enabled && n_q == n_k) {
    for (int64_t i = 0; i < n_q; ++i) last[i] = i;  // self-attention: the query blocks are the layer's
  }
  queries.positions = last.data();
  if (bits_per_value != nullptr) {
    *bits_per_value = 8.0 * static_cast<double>(layout.page_bytes) / (2.0 * n_k * n_heads * head_dim);
  }
  if (bf16_path_out != nullptr) {
    AttentionOptions exact = attention;
    exact.mma = MmaPath::kBf16;
    const Error e = attention.sparse.enabled
                        ? SparseAttendFloat(view, queries, exact, ranges, bf16_path_out, options, nullptr)
                        : AttendFloat(view, queries, exact, bf16_path_out, options);
    if (!e.ok()) return e;
  }
  if (attention.sparse.enabled) return SparseAttendFloat(view, queries, attention, ranges, out, options, sparse_report);
  return AttendFloat(view, queries, attention, out, options);
}

void CalibrateLogitStd(SyntheticData* data, int64_t n_q, int64_t n_k, int heads, int h, int d, double scale,
                       double logit_std, int64_t calibration_queries, int64_t calibration_keys) {
  const int64_t nq = std::min(n_q, calibration_queries);
  const int64_t nk = std::min(n_k, calibration_keys);
  double mean_std = 0.0;
  for (int64_t i = 0; i < nq; ++i) {
    const float* q = data->q.data() + ((i * n_q / nq) * heads + h) * d;
    double s1 = 0.0, s2 = 0.0;
    for (int64_t j = 0; j < nk; ++j) {
      const float* k = data->k.data() + ((j * n_k / nk) * heads + h) * d;
      double s = 0.0;
      for (int c = 0; c < d; ++c) s += static_cast<double>(q[c]) * k[c];
      s *= scale;
      s1 += s;
      s2 += s * s;
    }
    const double mean = s1 / nk;
    mean_std += std::sqrt(std::max(s2 / nk - mean * mean, 0.0));
  }
  mean_std /= std::max<int64_t>(nq, 1);
  const double g = mean_std > 0.0 ? logit_std / mean_std : 1.0;
  for (int64_t t = 0; t < n_q; ++t) {
    float* row = data->q.data() + (t * heads + h) * d;
    for (int c = 0; c < d; ++c) row[c] = static_cast<float>(row[c] * g);
  }
}

}  // namespace kvpack::cpu
