// Seeded synthetic layers for `kvpack run|bench` and the integration tests: hidden states with the
// structure real activations have (per-channel offsets, a few outlier channels 20× larger, heavy
// tails), weights, and the CPU reference of the layer computed locally for comparison.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "kernels/layer_spec.h"
#include "kvpack/v1/kvpack.pb.h"

namespace kvpack::client {

struct SyntheticRange {
  int64_t tokens = 0;
  int32_t seq_id = 0;
  std::vector<v1::Format> allowed;  // best first
};

struct SyntheticSpec {
  int64_t n_tokens = 1000;
  int hidden = 256;
  int n_heads = 4;
  int head_dim = 64;
  std::vector<SyntheticRange> ranges;  // empty: one range of every token, int8 then int4
  bool causal = false;
  MmaPath mma = MmaPath::kAuto;  // --mma auto|bf16|int8
  bool rope = false;         // 1-axis split-halves RoPE over all channels
  bool qk_norm = false;
  SparseOptions sparse;      // block-sparse attention when enabled (header and reference)
  bool bias = false;
  uint64_t seed = 1;
};

// The page format of a wire format (FORMAT_UNSPECIFIED and unknown values: INT4, the default).
PageFormat ToPage(v1::Format f);

// "LEN:FMT|FMT[@SEQ],…", e.g. "64:bf16,448:int8|int4@1". LENs must sum to n_tokens.
absl::StatusOr<std::vector<SyntheticRange>> ParseRanges(const std::string& text, int64_t n_tokens);

struct SyntheticLayer {
  SyntheticSpec spec;
  std::vector<uint16_t> x;          // bf16 [N, D]
  std::vector<uint16_t> w_qkv;      // bf16 [3·H·d, D]
  std::vector<float> bias;          // [3·H·d] or empty
  std::vector<float> q_norm, k_norm;
  std::vector<float> positions;     // [N] or empty
  v1::LayerHeader header;           // shape, ranges, options; no weights handle, tensors unset

  uint64_t out_bytes() const { return static_cast<uint64_t>(spec.n_tokens) * spec.n_heads * spec.head_dim * 2; }
};

SyntheticLayer MakeSyntheticLayer(const SyntheticSpec& spec);

// The layer's weights as RegisterWeights takes them (pointers into `layer`, which must outlive them).
WeightsData WeightsOf(const SyntheticLayer& layer);

// The layer run locally by the CPU reference with the formats and chunk sizes of `plan`.
// choose_per_head as the daemon's request asked (TransformOptions; both backends choose per head
// by default).
absl::StatusOr<std::vector<uint16_t>> ReferenceOutput(const SyntheticLayer& layer, const v1::PlanResult& plan,
                                                      bool choose_per_head = true);

struct Comparison {
  double max_abs = 0;
  double rel_l2 = 0;
  bool identical = false;
};
Comparison Compare(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want);

}  // namespace kvpack::client
