// Test helper: small synthetic layers (seeded, structured, never zeros) and their registration.
#pragma once

#include <string>
#include <vector>

#include "client/client.h"
#include "client/synthetic.h"
#include "kernels/cpu/layer.h"
#include "server/core/pool.h"

namespace kvpack::testing {

// N = 300 tokens in three ranges of odd lengths, D = 128, H = 2, d = 64: a layer runs in ~0.1 s.
inline client::SyntheticSpec SmallSpec(uint64_t seed = 7) {
  client::SyntheticSpec s;
  s.n_tokens = 300;
  s.hidden = 128;
  s.n_heads = 2;
  s.head_dim = 64;
  s.ranges = {{77, 0, {v1::FORMAT_BF16}}, {150, 0, {v1::FORMAT_INT8, v1::FORMAT_INT4}}, {73, 1, {v1::FORMAT_INT4}}};
  s.causal = true;
  s.rope = true;
  s.bias = true;
  s.qk_norm = true;
  s.seed = seed;
  return s;
}

// A layer of 3000 tokens in chunks of 256 (--max_chunk_tokens=256): ~0.5 s on one CPU thread, long
// enough to be caught mid-way (cancel_test.cc, layer_regions_call_test.cc, lane_test.cc).
inline client::SyntheticSpec LongSpec() {
  client::SyntheticSpec s = SmallSpec(31);
  s.n_tokens = 3000;
  s.ranges = {{3000, 0, {v1::FORMAT_INT4}}};
  return s;
}

using client::WeightsOf;

inline client::LayerData DataOf(const client::SyntheticLayer& L, std::vector<uint16_t>* out) {
  out->assign(L.out_bytes() / 2, 0);
  return client::LayerData{L.x.data(), L.positions.empty() ? nullptr : L.positions.data(), out->data(), L.out_bytes()};
}

inline uint64_t WeightsPoolBytes(const client::SyntheticLayer& L) {
  return server::PoolBytes(L.w_qkv.size() * 2 + L.bias.size() * 4 + 2 * L.q_norm.size() * 4);
}

// Pool bytes of a layer at its first allowed formats and one chunk of all tokens (what the planner
// picks when the budget is roomy): K/V block plus CPU workspace.
inline uint64_t LayerPeakBytes(const client::SyntheticLayer& L, int64_t max_chunk = 16384) {
  LayerConfig config;
  config.shape = {L.spec.n_tokens, L.spec.hidden, L.spec.n_heads, L.spec.head_dim};
  int64_t begin = 0;
  for (const auto& r : L.spec.ranges) {
    config.ranges.push_back({begin, begin + r.tokens, r.seq_id, client::ToPage(r.allowed[0])});
    begin += r.tokens;
  }
  if (L.spec.rope) {
    config.rope.layout = RopeLayout::kSplitHalves;
    config.rope.n_axes = 1;
    config.rope.axis_dims[0] = L.spec.head_dim;
  }
  config.qk_norm.enabled = L.spec.qk_norm;
  config.qk_norm.weight_len = L.spec.qk_norm ? L.spec.head_dim : 0;
  config.has_bias = L.spec.bias;
  config.attention.causal = L.spec.causal;
  config.projection_chunk = config.query_chunk = std::min<int64_t>(L.spec.n_tokens, max_chunk);
  return server::PoolBytes(cpu::KvBytes(config)) + server::PoolBytes(cpu::WorkspaceBytes(config));
}

}  // namespace kvpack::testing
