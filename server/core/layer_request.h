// A layer as a caller asks for it, before planning: ranges carry a list of allowed formats (best
// first) rather than one format. The planner resolves it into a kernels LayerConfig.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/layer_spec.h"

namespace kvpack::server {

struct RangeRequest {
  int64_t begin = 0;
  int64_t end = 0;
  int32_t seq_id = 0;
  std::vector<PageFormat> allowed;  // best first; never empty after conversion
  // Error budget instead of a list (> 0): the planner stores the range in the cheapest format whose
  // estimated relative error (LayerRequest::estimate) is at most this, allowing only cheaper ones
  // below it for the VRAM budget. 0: `allowed` decides.
  double max_rel_error = 0.0;
  std::string role;             // "text", "reference", "audio", "generated" or "" (policies)
  bool precision_given = true;  // false: the caller named no formats and no budget (a policy may fill them)
  bool always_attend = false;   // block-sparse attention: TokenRange::always_attend
  bool attend_densely = false;  // block-sparse attention: TokenRange::attend_densely
};

// Tokens [begin, end) of sequence seq_id in the given formats, best first; the rest as defaulted.
inline RangeRequest MakeRange(int64_t begin, int64_t end, int32_t seq_id, std::vector<PageFormat> allowed) {
  RangeRequest range;
  range.begin = begin;
  range.end = end;
  range.seq_id = seq_id;
  range.allowed = std::move(allowed);
  return range;
}

// Estimated relative L2 error of the layer's output with every key in format f (index PageFormat),
// from the per-head choice's sample estimate (kernels/transform_choice.h EstimatedRelError).
struct ErrorEstimate {
  bool present = false;
  double rel_error[kNumPageFormats] = {0.0, 0.0, 0.0};
};

// Which tensors of a request already sit in the backend's memory (CUDA IPC regions on the GPU
// backend). The others are host memory that a GPU backend stages through the pool (IoBytes).
struct TensorResidency {
  bool x = false;
  bool positions = false;
  bool out = false;
  bool q = false;  // pre-projected input (LayerRequest::projected)
  bool k = false;
  bool v = false;
};

struct LayerRequest {
  LayerShape shape;
  std::vector<RangeRequest> ranges;
  RopeOptions rope;
  QkNormOptions qk_norm;
  TransformOptions transforms;
  AttentionOptions attention;
  bool has_bias = false;
  bool in_place = false;
  // Pre-projected Q/K/V instead of x and weights (kernels/layer_spec.h); shape.hidden is then
  // n_heads·head_dim.
  ProjectedLayout projected;
  TensorResidency resident;
  int64_t max_chunk = 0;  // cap on Tp and Tq (tokens); 0: none. Smaller chunks cancel sooner.
  // The estimate error budgets are resolved against (from a client's sample through Plan, or the
  // result of an earlier run of the layer); RangePlan reports it for each range's format.
  ErrorEstimate estimate;
  // Precision policy (server/core/policy.h): name ("" none), block index and diffusion timestep.
  std::string policy;
  int block_index = 0;
  double timestep = 0.0;
};

// The allowed list an error budget resolves to (RangeRequest::max_rel_error): the cheapest format
// (INT4, then INT8, then BF16) whose estimate is ≤ max_rel_error — BF16 when none is — followed by
// the cheaper formats, which the VRAM budget may still fall to (reported as downgrades).
std::vector<PageFormat> AllowedForErrorBudget(double max_rel_error, const ErrorEstimate& estimate);

// The kernels' config of `request` with one format per range and the given chunk sizes.
LayerConfig MakeLayerConfig(const LayerRequest& request, const std::vector<PageFormat>& formats,
                            int64_t projection_chunk, int64_t query_chunk);

}  // namespace kvpack::server
