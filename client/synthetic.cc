#include "client/synthetic.h"

#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu/layer.h"

namespace kvpack::client {
namespace {

absl::StatusOr<v1::Format> ParseFormat(const std::string& s) {
  if (s == "int4") return v1::FORMAT_INT4;
  if (s == "int8") return v1::FORMAT_INT8;
  if (s == "bf16") return v1::FORMAT_BF16;
  return absl::InvalidArgumentError("format \"" + s + "\": expected int4, int8 or bf16");
}

}  // namespace

PageFormat ToPage(v1::Format f) {
  return f == v1::FORMAT_BF16 ? PageFormat::kBf16 : f == v1::FORMAT_INT8 ? PageFormat::kInt8 : PageFormat::kInt4;
}

absl::StatusOr<std::vector<SyntheticRange>> ParseRanges(const std::string& text, int64_t n_tokens) {
  std::vector<SyntheticRange> out;
  int64_t total = 0;
  for (const std::string& item : std::vector<std::string>(absl::StrSplit(text, ',', absl::SkipEmpty()))) {
    SyntheticRange r;
    std::vector<std::string> at = absl::StrSplit(item, '@');
    if (at.size() == 2 && !absl::SimpleAtoi(at[1], &r.seq_id)) return absl::InvalidArgumentError("bad seq id in " + item);
    std::vector<std::string> parts = absl::StrSplit(at[0], ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &r.tokens) || r.tokens <= 0) {
      return absl::InvalidArgumentError("range \"" + item + "\": expected LEN:FMT|FMT[@SEQ]");
    }
    for (const std::string& f : std::vector<std::string>(absl::StrSplit(parts[1], '|'))) {
      absl::StatusOr<v1::Format> format = ParseFormat(f);
      if (!format.ok()) return format.status();
      r.allowed.push_back(*format);
    }
    total += r.tokens;
    out.push_back(std::move(r));
  }
  if (total != n_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("ranges cover ", total, " tokens; --tokens is ", n_tokens));
  }
  return out;
}

SyntheticLayer MakeSyntheticLayer(const SyntheticSpec& spec_in) {
  SyntheticLayer L;
  L.spec = spec_in;
  SyntheticSpec& spec = L.spec;
  if (spec.ranges.empty()) spec.ranges.push_back({spec.n_tokens, 0, {v1::FORMAT_INT8, v1::FORMAT_INT4}});
  std::mt19937_64 rng(spec.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::student_t_distribution<float> heavy(3.0f);
  const int64_t N = spec.n_tokens;
  const int D = spec.hidden;
  const int64_t cols = 3ll * spec.n_heads * spec.head_dim;

  // Hidden states: per-channel offset, 1 in 32 channels an outlier (×20), Student-t noise.
  std::vector<float> offset(D), gain(D);
  for (int c = 0; c < D; ++c) {
    offset[c] = 0.5f * normal(rng);
    gain[c] = (c % 32 == 7) ? 20.0f : 1.0f;
  }
  L.x.resize(static_cast<size_t>(N) * D);
  for (int64_t t = 0; t < N; ++t) {
    for (int c = 0; c < D; ++c) L.x[t * D + c] = FloatToBf16(gain[c] * (offset[c] + 0.5f * heavy(rng)));
  }
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(D)) / 8.0f;
  L.w_qkv.resize(static_cast<size_t>(cols) * D);
  for (auto& w : L.w_qkv) w = FloatToBf16(w_scale * normal(rng));
  if (spec.bias) {
    L.bias.resize(cols);
    for (auto& b : L.bias) b = 0.1f * normal(rng);
  }
  if (spec.qk_norm) {
    L.q_norm.resize(spec.head_dim);
    L.k_norm.resize(spec.head_dim);
    for (auto& v : L.q_norm) v = 1.0f + 0.1f * normal(rng);
    for (auto& v : L.k_norm) v = 1.0f + 0.1f * normal(rng);
  }
  if (spec.rope) {
    L.positions.resize(N);
    int64_t begin = 0;
    for (const SyntheticRange& r : spec.ranges) {  // positions restart in every sequence's first range
      for (int64_t t = 0; t < r.tokens; ++t) L.positions[begin + t] = static_cast<float>(t);
      begin += r.tokens;
    }
  }

  v1::LayerHeader& h = L.header;
  h.mutable_shape()->set_n_tokens(N);
  h.mutable_shape()->set_hidden(D);
  h.mutable_shape()->set_n_heads(spec.n_heads);
  h.mutable_shape()->set_head_dim(spec.head_dim);
  int64_t begin = 0;
  for (const SyntheticRange& r : spec.ranges) {
    v1::TokenRange* tr = h.add_ranges();
    tr->set_begin(begin);
    tr->set_end(begin + r.tokens);
    tr->set_seq_id(r.seq_id);
    for (v1::Format f : r.allowed) tr->add_allowed_formats(f);
    begin += r.tokens;
  }
  v1::LayerOptions* o = h.mutable_options();
  o->mutable_attention()->set_causal(spec.causal);
  static_assert(static_cast<int>(MmaPath::kBf16) == v1::AttentionOptions::MMA_BF16 &&
                    static_cast<int>(MmaPath::kInt8) == v1::AttentionOptions::MMA_INT8,
                "MmaPath numbers the proto's Mma");
  o->mutable_attention()->set_mma(static_cast<v1::AttentionOptions::Mma>(spec.mma));
  if (spec.sparse.enabled) {
    v1::SparseOptions* s = o->mutable_attention()->mutable_sparse();
    if (spec.sparse.mode == SparseMode::kRelTau) {
      s->set_rel_tau(spec.sparse.rel_tau);
    } else {
      s->set_topk_ratio(spec.sparse.topk_ratio);
    }
    s->set_tail(spec.sparse.tail);
    s->set_sink_pages(spec.sparse.sink_pages);
    s->set_min_exact_pages(spec.sparse.min_exact_pages);
  }
  if (spec.rope) {
    o->mutable_rope()->set_layout(v1::RopeOptions::LAYOUT_SPLIT_HALVES);
    o->mutable_rope()->add_axis_dims(spec.head_dim);
  }
  o->mutable_qk_norm()->set_enabled(spec.qk_norm);
  return L;
}

WeightsData WeightsOf(const SyntheticLayer& L) {
  WeightsData w;
  w.hidden = L.spec.hidden;
  w.n_heads = L.spec.n_heads;
  w.head_dim = L.spec.head_dim;
  w.w_qkv = L.w_qkv.data();
  w.bias = L.bias.empty() ? nullptr : L.bias.data();
  w.q_norm = L.q_norm.empty() ? nullptr : L.q_norm.data();
  w.k_norm = L.k_norm.empty() ? nullptr : L.k_norm.data();
  w.norm_len = static_cast<int>(L.q_norm.size());
  return w;
}

absl::StatusOr<std::vector<uint16_t>> ReferenceOutput(const SyntheticLayer& L, const v1::PlanResult& plan,
                                                      bool choose_per_head) {
  const SyntheticSpec& spec = L.spec;
  LayerConfig config;
  config.shape = {spec.n_tokens, spec.hidden, spec.n_heads, spec.head_dim};
  if (plan.ranges_size() != static_cast<int>(spec.ranges.size())) {
    return absl::InvalidArgumentError("the plan's ranges do not match the layer's");
  }
  int64_t begin = 0;
  for (size_t i = 0; i < spec.ranges.size(); ++i) {
    config.ranges.push_back({begin, begin + spec.ranges[i].tokens, spec.ranges[i].seq_id,
                             ToPage(plan.ranges(static_cast<int>(i)).format())});
    begin += spec.ranges[i].tokens;
  }
  if (spec.rope) {
    config.rope.layout = RopeLayout::kSplitHalves;
    config.rope.n_axes = 1;
    config.rope.axis_dims[0] = spec.head_dim;
  }
  config.qk_norm.enabled = spec.qk_norm;
  config.qk_norm.weight_len = spec.qk_norm ? spec.head_dim : 0;
  config.attention.causal = spec.causal;
  config.attention.mma = spec.mma;
  config.attention.sparse = spec.sparse;
  config.has_bias = spec.bias;
  config.transforms.choose_per_head = choose_per_head;
  config.projection_chunk = plan.projection_chunk();
  config.query_chunk = plan.query_chunk();
  if (Error e = cpu::Supported(config); !e.ok()) return absl::InvalidArgumentError(e.message());
  std::vector<uint8_t> kv(cpu::KvBytes(config));
  std::vector<uint8_t> ws(cpu::WorkspaceBytes(config));
  std::vector<uint16_t> out(static_cast<size_t>(spec.n_tokens) * spec.n_heads * spec.head_dim);
  LayerTensors t;
  t.x = L.x.data();
  t.w_qkv = L.w_qkv.data();
  t.bias = spec.bias ? L.bias.data() : nullptr;
  t.q_norm_weight = spec.qk_norm ? L.q_norm.data() : nullptr;
  t.k_norm_weight = spec.qk_norm ? L.k_norm.data() : nullptr;
  t.positions = spec.rope ? L.positions.data() : nullptr;
  t.out = out.data();
  Error e = cpu::RunLayer(config, t, kv.data(), ws.data(), cpu::CpuOptions{}, nullptr);
  if (!e.ok()) return absl::InternalError(e.message());
  return out;
}

Comparison Compare(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  Comparison c;
  double num = 0, den = 0;
  c.identical = got == want;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double a = Bf16ToFloat(got[i]), b = Bf16ToFloat(want[i]);
    c.max_abs = std::max(c.max_abs, std::fabs(a - b));
    num += (a - b) * (a - b);
    den += b * b;
  }
  c.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return c;
}

}  // namespace kvpack::client
