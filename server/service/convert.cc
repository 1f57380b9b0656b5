#include "server/service/convert.h"

#include <algorithm>
#include <cstring>
#include <vector>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/estimate.h"
#include "kernels/cpu/sparse_layer.h"
#include "server/core/policy.h"

namespace kvpack::server {

absl::StatusOr<PageFormat> FromProto(v1::Format format) {
  switch (format) {
    case v1::FORMAT_INT4: return PageFormat::kInt4;
    case v1::FORMAT_INT8: return PageFormat::kInt8;
    case v1::FORMAT_BF16: return PageFormat::kBf16;
    default: return absl::InvalidArgumentError(absl::StrCat("format ", static_cast<int>(format), " is not known"));
  }
}

v1::Format ToProto(PageFormat format) {
  switch (format) {
    case PageFormat::kInt4: return v1::FORMAT_INT4;
    case PageFormat::kInt8: return v1::FORMAT_INT8;
    case PageFormat::kBf16: return v1::FORMAT_BF16;
  }
  return v1::FORMAT_UNSPECIFIED;
}

absl::StatusOr<LayerRequest> LayerRequestFromProto(const v1::LayerHeader& header, bool has_bias,
                                                   int qk_norm_weight_len) {
  LayerRequest r;
  const v1::LayerShape& shape = header.shape();
  r.shape.n_tokens = shape.n_tokens();
  r.shape.hidden = shape.hidden();
  r.shape.n_heads = shape.n_heads();
  r.shape.head_dim = shape.head_dim();
  if (header.ranges_size() > kMaxRanges) {
    return absl::InvalidArgumentError(absl::StrCat("header.ranges: ", header.ranges_size(), " ranges, at most ",
                                                   kMaxRanges, " allowed"));
  }
  r.ranges.reserve(header.ranges_size());
  for (int i = 0; i < header.ranges_size(); ++i) {
    const v1::TokenRange& in = header.ranges(i);
    RangeRequest range;
    range.begin = in.begin();
    range.end = in.end();
    range.seq_id = in.seq_id();
    if (in.allowed_formats_size() > kNumPageFormats) {
      return absl::InvalidArgumentError(absl::StrCat("header.ranges[", i, "].allowed_formats: at most ",
                                                     kNumPageFormats, " formats"));
    }
    for (int j = 0; j < in.allowed_formats_size(); ++j) {
      absl::StatusOr<PageFormat> f = FromProto(in.allowed_formats(j));
      if (!f.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("header.ranges[", i, "].allowed_formats[", j, "]: ", f.status().message()));
      }
      range.allowed.push_back(*f);
    }
    range.max_rel_error = in.max_rel_error();
    if (!range.allowed.empty() && range.max_rel_error != 0.0) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.ranges[", i, "].max_rel_error: give allowed_formats or max_rel_error, not both"));
    }
    if (!(range.max_rel_error >= 0.0) || !std::isfinite(range.max_rel_error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.ranges[", i, "].max_rel_error = ", range.max_rel_error, " must be finite and >= 0"));
    }
    if (in.role().size() > kMaxRoleBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.ranges[", i, "].role: longer than ", kMaxRoleBytes, " bytes"));
    }
    if (!in.role().empty() && !IsRangeRole(in.role())) {
      return absl::InvalidArgumentError(absl::StrCat("header.ranges[", i, "].role: '", in.role(),
                                                     "' is not a role (text, reference, audio, generated)"));
    }
    range.role = in.role();
    range.always_attend = in.always_attend();
    range.attend_densely = in.attend_densely();
    if ((range.always_attend || range.attend_densely) && !header.options().attention().has_sparse()) {
      return absl::InvalidArgumentError(absl::StrCat("header.ranges[", i, "].", range.always_attend ? "always_attend" : "attend_densely",
                                                     ": needs header.options.attention.sparse"));
    }
    range.precision_given = !range.allowed.empty() || range.max_rel_error != 0.0;
    if (range.allowed.empty()) range.allowed.push_back(PageFormat::kInt4);
    r.ranges.push_back(std::move(range));
  }
  if (header.has_estimated_rel_error()) {
    const v1::ErrorEstimate& e = header.estimated_rel_error();
    const double values[kNumPageFormats] = {e.int4(), e.int8(), e.bf16()};  // PageFormat order
    for (int f = 0; f < kNumPageFormats; ++f) {
      if (!(values[f] >= 0.0) || !std::isfinite(values[f])) {
        return absl::InvalidArgumentError("header.estimated_rel_error: every field must be finite and >= 0");
      }
      r.estimate.rel_error[f] = values[f];
    }
    r.estimate.present = true;
  }
  if (header.policy().size() > kMaxRoleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("header.policy: longer than ", kMaxRoleBytes, " bytes"));
  }
  r.policy = header.policy();
  if (header.block_index() < 0) return absl::InvalidArgumentError("header.block_index must be >= 0");
  if (!std::isfinite(header.timestep())) return absl::InvalidArgumentError("header.timestep must be finite");
  r.block_index = header.block_index();
  r.timestep = header.timestep();

  const v1::LayerOptions& options = header.options();
  const v1::RopeOptions& rope = options.rope();
  switch (rope.layout()) {
    case v1::RopeOptions::LAYOUT_NONE: r.rope.layout = RopeLayout::kNone; break;
    case v1::RopeOptions::LAYOUT_INTERLEAVED: r.rope.layout = RopeLayout::kInterleaved; break;
    case v1::RopeOptions::LAYOUT_SPLIT_HALVES: r.rope.layout = RopeLayout::kSplitHalves; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("header.options.rope.layout = ", rope.layout(), " is not known"));
  }
  if (r.rope.layout != RopeLayout::kNone) {
    if (rope.axis_dims_size() < 1 || rope.axis_dims_size() > 3) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.options.rope.axis_dims: ", rope.axis_dims_size(), " axes, expected 1 to 3"));
    }
    r.rope.n_axes = rope.axis_dims_size();
    for (int a = 0; a < r.rope.n_axes; ++a) r.rope.axis_dims[a] = rope.axis_dims(a);
    if (rope.theta() != 0.0f) r.rope.theta = rope.theta();
  }
  r.qk_norm.enabled = options.qk_norm().enabled();
  if (options.qk_norm().eps() != 0.0f) r.qk_norm.eps = options.qk_norm().eps();
  r.qk_norm.weight_len = qk_norm_weight_len;
  const v1::TransformOptions& t = options.transforms();
  if (t.has_rotate()) r.transforms.rotate = t.rotate();
  if (t.has_smooth()) r.transforms.smooth = t.smooth();
  if (t.has_balance()) r.transforms.balance = t.balance();
  if (t.has_choose_per_head()) r.transforms.choose_per_head = t.choose_per_head();
  if (t.seed() != 0) r.transforms.seed = t.seed();
  if (t.stats_sample_tokens() < 0) {
    return absl::InvalidArgumentError("header.options.transforms.stats_sample_tokens must not be negative");
  }
  if (t.stats_sample_tokens() != 0) r.transforms.stats_sample_tokens = t.stats_sample_tokens();
  r.attention.causal = options.attention().causal();
  r.attention.softmax_scale = options.attention().softmax_scale();
  if (!(r.attention.softmax_scale >= 0.0f) || r.attention.softmax_scale == std::numeric_limits<float>::infinity()) {
    return absl::InvalidArgumentError("header.options.attention.softmax_scale must be finite and not negative");
  }
  if (absl::Status s = SparseFromProto(options.attention(), &r.attention.sparse); !s.ok()) return s;
  switch (options.attention().mma()) {
    case v1::AttentionOptions::MMA_AUTO: r.attention.mma = MmaPath::kAuto; break;
    case v1::AttentionOptions::MMA_BF16: r.attention.mma = MmaPath::kBf16; break;
    case v1::AttentionOptions::MMA_INT8: r.attention.mma = MmaPath::kInt8; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("header.options.attention.mma = ", options.attention().mma(), " is not known"));
  }
  r.has_bias = has_bias;
  r.in_place = header.output().mode() == v1::OUTPUT_IN_PLACE;
  if (header.input_case() == v1::LayerHeader::kProjected) {
    if (absl::Status s = ProjectedFromProto(header, &r); !s.ok()) return s;
  }
  return r;
}

absl::Status SparseFromProto(const v1::AttentionOptions& attention, SparseOptions* out) {
  *out = SparseOptions{};
  if (!attention.has_sparse()) return absl::OkStatus();
  const v1::SparseOptions& s = attention.sparse();
  out->enabled = true;
  switch (s.routing_case()) {
    case v1::SparseOptions::kRelTau:
      out->mode = SparseMode::kRelTau;
      out->rel_tau = s.rel_tau();
      break;
    case v1::SparseOptions::kTopkRatio: out->topk_ratio = s.topk_ratio(); break;
    default: break;  // top-k at the default ratio
  }
  if (s.has_tail()) out->tail = s.tail();
  out->sink_pages = s.sink_pages();
  out->min_exact_pages = s.min_exact_pages();
  if (Error e = ValidateSparse(*out); !e.ok()) return absl::InvalidArgumentError("header.options." + e.message());
  return absl::OkStatus();
}

absl::Status ProjectedFromProto(const v1::LayerHeader& header, LayerRequest* r) {
  const v1::ProjectedQkv& p = header.projected();
  const int64_t hd = r->shape.HeadCols();
  if (!header.weights_handle().empty()) {
    return absl::InvalidArgumentError("header.weights_handle: must be empty with header.projected (no projection runs)");
  }
  if (r->shape.hidden != 0 && r->shape.hidden != hd) {
    return absl::InvalidArgumentError(absl::StrCat("header.shape.hidden = ", r->shape.hidden,
                                                   ": with header.projected it must be 0 or n_heads * head_dim = ", hd));
  }
  if (r->rope.layout != RopeLayout::kNone) {
    return absl::InvalidArgumentError("header.options.rope: must be unset with header.projected (apply RoPE to q and k before sending them)");
  }
  if (r->qk_norm.enabled) {
    return absl::InvalidArgumentError("header.options.qk_norm.enabled: must be false with header.projected (normalise q and k before sending them)");
  }
  if (r->in_place) {
    return absl::InvalidArgumentError("header.output.mode: OUTPUT_IN_PLACE needs x; with header.projected use OUTPUT_INLINE or OUTPUT_REGION");
  }
  r->shape.hidden = static_cast<int>(hd);
  r->has_bias = false;
  r->qk_norm.weight_len = 0;
  ProjectedLayout& layout = r->projected;
  layout.enabled = true;
  const int64_t n = r->shape.n_tokens, d = r->shape.head_dim;
  // The strides below are products of client integers: bound the factors first so none wraps
  // (ValidateProjected bounds the whole span later).
  if (n <= 0 || n > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("header.shape.n_tokens = ", n, " must be in [1, 2^31)"));
  }
  if (d <= 0 || d > kMaxHeadDimCpu || r->shape.n_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("header.shape: n_heads = ", r->shape.n_heads, ", head_dim = ", d,
                                                   " must be positive (head_dim at most ", kMaxHeadDimCpu, ")"));
  }
  switch (p.layout()) {
    case v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR: {
      const int64_t stride = p.row_stride() == 0 ? hd : p.row_stride();
      if (stride < hd) {
        return absl::InvalidArgumentError(absl::StrCat("header.projected.row_stride = ", p.row_stride(),
                                                       " is below n_heads * head_dim = ", hd));
      }
      if (p.batch() != 0 && p.batch() != 1) {
        return absl::InvalidArgumentError(absl::StrCat("header.projected.batch = ", p.batch(),
                                                       ": token-major rows need no batch (set 0)"));
      }
      layout.token_stride = stride;
      layout.head_stride = d;
      layout.batch_tokens = std::max<int64_t>(n, 1);
      layout.batch_stride = 0;
      return absl::OkStatus();
    }
    case v1::ProjectedQkv::LAYOUT_HEAD_MAJOR: {
      const int64_t batch = p.batch() == 0 ? 1 : p.batch();
      if (batch < 1 || n % batch != 0) {
        return absl::InvalidArgumentError(absl::StrCat("header.projected.batch = ", p.batch(),
                                                       " must be positive and divide n_tokens = ", n));
      }
      if (p.row_stride() != 0 && p.row_stride() != d) {
        return absl::InvalidArgumentError(absl::StrCat("header.projected.row_stride = ", p.row_stride(),
                                                       ": head-major rows are contiguous (set 0)"));
      }
      const int64_t m = n / batch;
      if (r->shape.n_heads > kMaxProjectedSpanElements / (m * d)) {
        return absl::InvalidArgumentError(absl::StrCat("header.shape.n_heads = ", r->shape.n_heads,
                                                       ": the head-major tensor would span more than ",
                                                       kMaxProjectedSpanElements, " elements"));
      }
      layout.token_stride = d;
      layout.head_stride = m * d;
      layout.batch_tokens = std::max<int64_t>(m, 1);
      layout.batch_stride = static_cast<int64_t>(r->shape.n_heads) * m * d;
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("header.projected.layout = ", p.layout(),
                                                     ": expected LAYOUT_TOKEN_MAJOR or LAYOUT_HEAD_MAJOR"));
  }
}

void PlanToProto(const LayerPlan& plan, v1::PlanResult* out) {
  for (const RangePlan& r : plan.ranges) {
    v1::RangePlan* p = out->add_ranges();
    p->set_format(ToProto(r.format));
    p->set_downgraded(r.downgraded);
    p->set_tokens(r.tokens);
    p->set_estimated_rel_error(r.estimated_rel_error);
  }
  out->set_projection_chunk(plan.projection_chunk);
  out->set_query_chunk(plan.query_chunk);
  out->set_kv_bytes(plan.kv_bytes);
  out->set_workspace_bytes(plan.workspace_bytes);
  out->set_io_bytes(plan.io_bytes);
  out->set_predicted_peak_bytes(plan.peak_bytes);
  out->set_downgrades(plan.downgrades);
  out->set_capacity_bytes(plan.capacity_bytes);
  if (plan.config.attention.sparse.enabled) {
    out->set_routed_fraction_bound(cpu::RoutedFractionBound(plan.config));
    out->set_routing_bytes(plan.routing_bytes);  // the backend's own (cpu/sparse_layer.h, cuda/sparse.h)
  }
}

absl::Status EstimateFromSampleProto(const v1::QkvSample& sample, LayerRequest* r) {
  const int64_t n = sample.n_tokens();
  if (n < 1 || n > kMaxPlanSampleTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("sample.n_tokens = ", n, ": expected 1 to ", kMaxPlanSampleTokens));
  }
  const uint64_t want = static_cast<uint64_t>(n) * static_cast<uint64_t>(r->shape.HeadCols()) * sizeof(float);
  const struct {
    const std::string* bytes;
    const char* name;
  } parts[] = {{&sample.q(), "sample.q"}, {&sample.k(), "sample.k"}, {&sample.v(), "sample.v"}};
  if (want == 0) return absl::InvalidArgumentError("sample: holds no token (n_tokens, n_heads and head_dim must be positive)");
  std::vector<float> values[3];
  for (int i = 0; i < 3; ++i) {
    if (parts[i].bytes->size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(parts[i].name, ": ", parts[i].bytes->size(),
                                                     " bytes, expected n_tokens * n_heads * head_dim * 4 = ", want));
    }
    values[i].resize(want / sizeof(float));
    memcpy(values[i].data(), parts[i].bytes->data(), want);
    for (float x : values[i]) {
      if (!std::isfinite(x)) return absl::InvalidArgumentError(absl::StrCat(parts[i].name, ": holds a non-finite value"));
    }
  }
  const std::array<double, kNumPageFormats> e = cpu::EstimateFromSample(
      values[0].data(), values[1].data(), values[2].data(), n, r->shape, r->transforms, r->attention.mma,
      r->attention.softmax_scale, 0);
  r->estimate = ErrorEstimate{};
  for (int f = 0; f < kNumPageFormats; ++f) {
    r->estimate.rel_error[f] = e[f];
    r->estimate.present = r->estimate.present || e[f] > 0.0;
  }
  return absl::OkStatus();
}

void EstimateToProto(const ErrorEstimate& e, v1::ErrorEstimate* out) {
  out->set_int4(e.rel_error[static_cast<int>(PageFormat::kInt4)]);
  out->set_int8(e.rel_error[static_cast<int>(PageFormat::kInt8)]);
  out->set_bf16(e.rel_error[static_cast<int>(PageFormat::kBf16)]);
}

}  // namespace kvpack::server
