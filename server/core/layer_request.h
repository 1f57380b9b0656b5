// A layer as a caller asks for it, before planning: ranges carry a list of allowed formats (best
// first) rather than one format. The planner resolves it into a kernels LayerConfig.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/layer_spec.h"

namespace kvpack::server {

struct RangeRequest {
  int64_t begin = 0;
  int64_t end = 0;
  int32_t seq_id = 0;
  std::vector<PageFormat> allowed;  // best first; never empty after conversion
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
};

// The kernels' config of `request` with one format per range and the given chunk sizes.
LayerConfig MakeLayerConfig(const LayerRequest& request, const std::vector<PageFormat>& formats,
                            int64_t projection_chunk, int64_t query_chunk);

}  // namespace kvpack::server
