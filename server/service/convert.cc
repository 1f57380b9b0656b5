#include "server/service/convert.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

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
    if (range.allowed.empty()) range.allowed.push_back(PageFormat::kInt4);
    r.ranges.push_back(std::move(range));
  }

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
  r.has_bias = has_bias;
  r.in_place = header.output().mode() == v1::OUTPUT_IN_PLACE;
  if (header.input_case() == v1::LayerHeader::kProjected) {
    if (absl::Status s = ProjectedFromProto(header, &r); !s.ok()) return s;
  }
  return r;
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
  }
  out->set_projection_chunk(plan.projection_chunk);
  out->set_query_chunk(plan.query_chunk);
  out->set_kv_bytes(plan.kv_bytes);
  out->set_workspace_bytes(plan.workspace_bytes);
  out->set_io_bytes(plan.io_bytes);
  out->set_predicted_peak_bytes(plan.peak_bytes);
  out->set_downgrades(plan.downgrades);
  out->set_capacity_bytes(plan.capacity_bytes);
}

}  // namespace kvpack::server
