// Proto ↔ domain conversion for the layer description and plans. Field names in error messages
// follow the proto (e.g. "header.ranges[2].allowed_formats[0]").
#pragma once

#include "absl/status/statusor.h"
#include "kvpack/v1/kvpack.pb.h"
#include "server/core/layer_request.h"
#include "server/core/planner.h"

namespace kvpack::server {

struct WeightsShape;  // registry.h

absl::StatusOr<PageFormat> FromProto(v1::Format format);
v1::Format ToProto(PageFormat format);

// The layer described by `header`. has_bias and qk_norm_weight_len come from the weights (or, for
// Plan without weights, from the request). Checks only what the proto adds (enums, sizes that do
// not fit the domain types); the planner validates the rest.
absl::StatusOr<LayerRequest> LayerRequestFromProto(const v1::LayerHeader& header, bool has_bias,
                                                   int qk_norm_weight_len);

// The pre-projected input of `header` (header.projected) into r->projected, with the rules of the
// proto: no weights handle, hidden 0 or H·d (set to H·d), no RoPE, no QK-norm, not in place.
// REQUIRES: r->shape, rope, qk_norm and in_place already converted.
absl::Status ProjectedFromProto(const v1::LayerHeader& header, LayerRequest* r);

// header.options.attention.sparse into *out (disabled when unset); INVALID_ARGUMENT naming the field.
absl::Status SparseFromProto(const v1::AttentionOptions& attention, SparseOptions* out);

// With sparse attention also routed_fraction_bound and routing_bytes (cpu/sparse_layer.h).
void PlanToProto(const LayerPlan& plan, v1::PlanResult* out);
void EstimateToProto(const ErrorEstimate& estimate, v1::ErrorEstimate* out);

// Largest PlanRequest.sample (tokens): the pre-pass sample of a layer is 1024 tokens by default.
inline constexpr int64_t kMaxPlanSampleTokens = 1024;

// Checks PlanRequest.sample against r's shape (INVALID_ARGUMENT naming the field), runs the per-head
// choice on it for every format (kernels/cpu/estimate.h) and sets r->estimate. Runs on the calling
// thread: ~0.2 s at H = 56, d = 128, 1024 tokens.
absl::Status EstimateFromSampleProto(const v1::QkvSample& sample, LayerRequest* r);

// Longest role and policy name accepted (bytes).
inline constexpr size_t kMaxRoleBytes = 64;

}  // namespace kvpack::server
