#include "server/core/planner.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/core/error_status.h"
#include "server/core/pool.h"

namespace kvpack::server {

LayerConfig MakeLayerConfig(const LayerRequest& request, const std::vector<PageFormat>& formats,
                            int64_t projection_chunk, int64_t query_chunk) {
  LayerConfig config;
  config.shape = request.shape;
  config.ranges.reserve(request.ranges.size());
  for (size_t i = 0; i < request.ranges.size(); ++i) {
    const RangeRequest& r = request.ranges[i];
    config.ranges.push_back(TokenRange{r.begin, r.end, r.seq_id, formats[i], r.always_attend, r.attend_densely});
  }
  config.rope = request.rope;
  config.qk_norm = request.qk_norm;
  config.transforms = request.transforms;
  config.attention = request.attention;
  config.has_bias = request.has_bias;
  config.in_place = request.in_place;
  config.projected = request.projected;
  config.projection_chunk = projection_chunk;
  config.query_chunk = query_chunk;
  return config;
}

std::vector<PageFormat> AllowedForErrorBudget(double max_rel_error, const ErrorEstimate& estimate) {
  constexpr PageFormat kCheapestFirst[] = {PageFormat::kInt4, PageFormat::kInt8, PageFormat::kBf16};
  int chosen = kNumPageFormats - 1;
  for (int i = 0; i < kNumPageFormats; ++i) {
    if (estimate.rel_error[static_cast<int>(kCheapestFirst[i])] <= max_rel_error) {
      chosen = i;
      break;
    }
  }
  std::vector<PageFormat> allowed;
  for (int i = chosen; i >= 0; --i) allowed.push_back(kCheapestFirst[i]);
  return allowed;
}

namespace {

// `request` with every error budget replaced by its allowed list.
absl::StatusOr<LayerRequest> ResolveErrorBudgets(const LayerRequest& request) {
  LayerRequest resolved = request;
  for (size_t i = 0; i < resolved.ranges.size(); ++i) {
    RangeRequest& r = resolved.ranges[i];
    if (r.max_rel_error == 0.0) continue;
    if (!(r.max_rel_error > 0.0) || !std::isfinite(r.max_rel_error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranges[", i, "].max_rel_error = ", r.max_rel_error, " must be a positive finite number"));
    }
    if (!request.estimate.present) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ranges[", i, "].max_rel_error needs an error estimate: send a sample with Plan, or pass the "
          "estimated_rel_error of an earlier result of this layer"));
    }
    r.allowed = AllowedForErrorBudget(r.max_rel_error, request.estimate);
  }
  return resolved;
}

}  // namespace

absl::Status ValidateLayerRequest(const LayerRequest& request) {
  if (absl::Status s = ToStatus(ValidateShape(request.shape, /*for_gpu=*/false)); !s.ok()) return s;
  std::vector<TokenRange> first;
  first.reserve(request.ranges.size());
  for (size_t i = 0; i < request.ranges.size(); ++i) {
    const RangeRequest& r = request.ranges[i];
    if (r.allowed.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("ranges[", i, "].allowed_formats: empty"));
    }
    for (size_t j = 0; j < r.allowed.size(); ++j) {
      if (!IsValidPageFormat(static_cast<int>(r.allowed[j]))) {
        return absl::InvalidArgumentError(absl::StrCat("ranges[", i, "].allowed_formats[", j, "] = ",
                                                       static_cast<int>(r.allowed[j]), " is not a known format"));
      }
    }
    first.push_back(TokenRange{r.begin, r.end, r.seq_id, r.allowed.front()});
  }
  if (absl::Status s = ToStatus(ValidateRanges(request.shape.n_tokens, first)); !s.ok()) return s;
  if (absl::Status s = ToStatus(ValidateRope(request.rope, request.shape.head_dim)); !s.ok()) return s;
  if (absl::Status s = ToStatus(ValidateQkNorm(request.qk_norm, request.shape)); !s.ok()) return s;
  if (request.projected.enabled) {
    LayerConfig config;
    config.shape = request.shape;
    config.rope = request.rope;
    config.qk_norm = request.qk_norm;
    config.has_bias = request.has_bias;
    config.in_place = request.in_place;
    config.projected = request.projected;
    if (absl::Status s = ToStatus(ValidateProjected(config)); !s.ok()) return s;
  }
  if (request.in_place && request.shape.hidden != request.shape.HeadCols()) {
    return absl::InvalidArgumentError(absl::StrCat("output.mode: in place needs hidden (", request.shape.hidden,
                                                   ") == n_heads * head_dim (", request.shape.HeadCols(), ")"));
  }
  return absl::OkStatus();
}

namespace {

struct Evaluation {
  uint64_t kv = 0, workspace = 0, io = 0;
  uint64_t peak() const { return kv + workspace + io; }
};

class Evaluator {
 public:
  Evaluator(const LayerRequest& request, const PlannerCosts& costs) : request_(request), costs_(costs) {}

  // K/V bytes depend on the formats only, so they are computed once per format assignment (the
  // backend's KvBytes lays out every page of every head: ~0.5 ms at N = 152k, H = 56), or set from
  // an estimate by SetKv.
  Evaluation Evaluate(const std::vector<PageFormat>& formats, int64_t chunk) {
    const LayerConfig config = MakeLayerConfig(request_, formats, chunk, chunk);
    if (formats != kv_formats_ || !kv_valid_) SetKv(formats, costs_.kv_bytes(config));
    Evaluation e;
    e.kv = PoolBytes(kv_raw_);
    e.workspace = PoolBytes(costs_.workspace_bytes(config));
    e.io = costs_.io_bytes ? PoolBytes(costs_.io_bytes(config, request_.resident)) : 0;
    return e;
  }

  void SetKv(const std::vector<PageFormat>& formats, uint64_t raw_bytes) {
    kv_formats_ = formats;
    kv_raw_ = raw_bytes;
    kv_valid_ = true;
  }
  uint64_t kv_raw() const { return kv_raw_; }

 private:
  const LayerRequest& request_;
  const PlannerCosts& costs_;
  std::vector<PageFormat> kv_formats_;
  uint64_t kv_raw_ = 0;
  bool kv_valid_ = false;
};

// Page bytes saved by storing range `r` in `to` instead of `from`, per head and per K or V.
int64_t PageSaving(const RangeRequest& r, PageFormat from, PageFormat to, int head_dim) {
  const int64_t pages = (r.end - r.begin + kPageTokens - 1) / kPageTokens;
  return pages * (static_cast<int64_t>(PageBytes(from, head_dim)) - PageBytes(to, head_dim));
}

}  // namespace

absl::StatusOr<LayerPlan> PlanLayer(const LayerRequest& original, uint64_t capacity_bytes, const PlannerCosts& costs) {
  absl::StatusOr<LayerRequest> resolved = ResolveErrorBudgets(original);
  if (!resolved.ok()) return resolved.status();
  const LayerRequest& request = *resolved;
  if (absl::Status s = ValidateLayerRequest(request); !s.ok()) return s;
  const size_t n_ranges = request.ranges.size();
  std::vector<size_t> step(n_ranges, 0);  // index into each range's allowed list
  std::vector<PageFormat> formats(n_ranges);
  const auto sync_formats = [&] {
    for (size_t i = 0; i < n_ranges; ++i) formats[i] = request.ranges[i].allowed[step[i]];
  };
  sync_formats();

  // Chunk candidates: kChunkSizes clamped to N, deduplicated, largest first.
  std::vector<int64_t> chunks;
  for (int64_t c : kChunkSizes) {
    if (request.max_chunk > 0 && c > request.max_chunk && c != kChunkSizes[std::size(kChunkSizes) - 1]) continue;
    const int64_t clamped = std::min<int64_t>(c, request.shape.n_tokens);
    if (chunks.empty() || chunks.back() != clamped) chunks.push_back(clamped);
  }
  const int64_t smallest = chunks.back();

  if (costs.supported) {
    if (absl::Status s = costs.supported(MakeLayerConfig(request, formats, smallest, smallest)); !s.ok()) return s;
  }
  Evaluator evaluator(request, costs);

  // 1. Step formats down until the smallest chunk fits (or every range is at its floor). Page sizes
  // are multiples of the 128-byte page alignment (format.h), so a step changes the K/V block of
  // PlanKvLayout by exactly 2·H·pages·ΔPageBytes: the steps use that arithmetic, and the backend's
  // KvBytes is asked once more at the end to confirm it. Should the backend disagree, the loop goes
  // on asking it at every step.
  Evaluation at_smallest = evaluator.Evaluate(formats, smallest);
  const int64_t heads_kv = 2ll * request.shape.n_heads;
  bool arithmetic = true;
  bool stepped = false;
  for (;;) {
    while (at_smallest.peak() > capacity_bytes) {
      size_t best = n_ranges;
      int64_t best_saving = 0;
      for (size_t i = 0; i < n_ranges; ++i) {
        if (step[i] + 1 >= request.ranges[i].allowed.size()) continue;
        const int64_t saving =
            PageSaving(request.ranges[i], formats[i], request.ranges[i].allowed[step[i] + 1], request.shape.head_dim);
        if (best == n_ranges || saving > best_saving) {
          best = i;
          best_saving = saving;
        }
      }
      if (best == n_ranges) break;  // at the floor
      ++step[best];
      stepped = true;
      sync_formats();
      if (arithmetic) {
        evaluator.SetKv(formats, evaluator.kv_raw() - static_cast<uint64_t>(best_saving * heads_kv));
      }
      at_smallest = evaluator.Evaluate(formats, smallest);
    }
    if (!arithmetic || !stepped) break;
    const uint64_t estimate = evaluator.kv_raw();
    const uint64_t actual = costs.kv_bytes(MakeLayerConfig(request, formats, smallest, smallest));
    if (actual == estimate) break;
    arithmetic = false;
    evaluator.SetKv(formats, actual);
    at_smallest = evaluator.Evaluate(formats, smallest);
  }

  LayerPlan plan;
  plan.capacity_bytes = capacity_bytes;
  plan.ranges.resize(n_ranges);
  for (size_t i = 0; i < n_ranges; ++i) {
    plan.ranges[i].format = formats[i];
    plan.ranges[i].downgraded = step[i] > 0;
    plan.ranges[i].tokens = request.ranges[i].end - request.ranges[i].begin;
    if (request.estimate.present) {
      plan.ranges[i].estimated_rel_error = request.estimate.rel_error[static_cast<int>(formats[i])];
    }
  }
  plan.downgrades = 0;
  for (size_t i = 0; i < n_ranges; ++i) plan.downgrades += step[i] > 0 ? 1 : 0;

  // 2. The largest chunk that fits with these formats.
  Evaluation chosen = at_smallest;
  int64_t chunk = smallest;
  if (at_smallest.peak() <= capacity_bytes) {
    for (int64_t c : chunks) {
      const Evaluation e = c == smallest ? at_smallest : evaluator.Evaluate(formats, c);
      if (e.peak() <= capacity_bytes) {
        chosen = e;
        chunk = c;
        break;
      }
    }
    plan.fits = true;
  } else {
    plan.fits = false;
    plan.reason = absl::StrCat("the floor plan (every range at its last allowed format, chunks of ", smallest,
                               " tokens) needs ", at_smallest.peak(), " bytes (K/V ", at_smallest.kv, ", workspace ",
                               at_smallest.workspace, ", I/O ", at_smallest.io, ") but only ", capacity_bytes,
                               " bytes are available to this request");
  }
  plan.projection_chunk = chunk;
  plan.query_chunk = chunk;
  plan.kv_bytes = chosen.kv;
  plan.workspace_bytes = chosen.workspace;
  plan.io_bytes = chosen.io;
  plan.peak_bytes = chosen.peak();
  plan.config = MakeLayerConfig(request, formats, chunk, chunk);
  if (costs.routing_bytes) plan.routing_bytes = costs.routing_bytes(plan.config);
  return plan;
}

}  // namespace kvpack::server
