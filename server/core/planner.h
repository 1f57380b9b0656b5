// The planner: which format each range is stored in and which chunk sizes the layer streams with,
// so that the layer's peak pool bytes fit the capacity it may use. Pure and deterministic: no
// clock, no device, no global state; the backend's byte functions are injected.
//
// Preference, in order:
//   1. the highest precision each range allows (its first allowed format);
//   2. the largest chunks (Tp = Tq from kChunkSizes, clamped to N and to request.max_chunk).
// When the best formats do not fit even at the smallest chunk, ranges step down their allowed lists
// one step at a time, the step that saves the most bytes first (ties: lower range index), never
// below the last allowed format. When the floor (every range at its last format, smallest chunk)
// does not fit, the answer is RESOURCE_EXHAUSTED naming the numbers, and `floor` says what it was.
//
// Peak = PoolBytes(kv) + PoolBytes(workspace) + PoolBytes(io): exactly what the pool will count
// when the request allocates its K/V block, its workspace and its device I/O copies.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/layer_spec.h"
#include "server/core/layer_request.h"

namespace kvpack::server {

// Chunk sizes tried, largest first (tokens).
inline constexpr int64_t kChunkSizes[] = {16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64};

struct PlannerCosts {
  std::function<absl::Status(const LayerConfig&)> supported;  // null: everything is supported
  std::function<uint64_t(const LayerConfig&)> kv_bytes;
  std::function<uint64_t(const LayerConfig&)> workspace_bytes;
  std::function<uint64_t(const LayerConfig&, const TensorResidency&)> io_bytes;  // null: 0
  std::function<uint64_t(const LayerConfig&)> routing_bytes;  // part of workspace_bytes; null: 0
};

struct RangePlan {
  PageFormat format = PageFormat::kInt4;
  bool downgraded = false;
  int64_t tokens = 0;
  double estimated_rel_error = 0.0;  // the request's estimate for `format`; 0 without one
};

struct LayerPlan {
  std::vector<RangePlan> ranges;
  int64_t projection_chunk = 0;
  int64_t query_chunk = 0;
  uint64_t kv_bytes = 0;         // pool-rounded
  uint64_t workspace_bytes = 0;  // pool-rounded
  uint64_t io_bytes = 0;         // pool-rounded
  uint64_t routing_bytes = 0;    // of workspace_bytes, block-sparse routing's (unrounded; 0 with sparse off)
  uint64_t peak_bytes = 0;       // the sum
  int downgrades = 0;
  uint64_t capacity_bytes = 0;
  bool fits = false;
  std::string reason;            // when !fits
  LayerConfig config;            // the resolved config (formats and chunks filled in)
};

// Ranges with an error budget (RangeRequest::max_rel_error) first take AllowedForErrorBudget's list;
// a budget without request.estimate is INVALID_ARGUMENT naming the range.
// Validates `request` (INVALID_ARGUMENT naming the field; the backend's own rejection as it comes),
// then plans it into `capacity_bytes`. A plan that does not fit comes back with fits = false, the
// floor plan and a reason; PlanLayer never fails for memory (callers decide: Plan answers, runs
// return RESOURCE_EXHAUSTED with the reason).
absl::StatusOr<LayerPlan> PlanLayer(const LayerRequest& request, uint64_t capacity_bytes, const PlannerCosts& costs);

// Checks a request's shape, ranges and options without planning (shared with the service).
absl::Status ValidateLayerRequest(const LayerRequest& request);

}  // namespace kvpack::server
