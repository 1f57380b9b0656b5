// Test helper: small synthetic layers (seeded, structured, never zeros) and their registration.
#pragma once

#include <string>
#include <vector>

#include "client/client.h"
#include "client/synthetic.h"

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

inline client::WeightsData WeightsOf(const client::SyntheticLayer& L) {
  client::WeightsData w;
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

inline client::LayerData DataOf(const client::SyntheticLayer& L, std::vector<uint16_t>* out) {
  out->assign(L.out_bytes() / 2, 0);
  return client::LayerData{L.x.data(), L.positions.empty() ? nullptr : L.positions.data(), out->data(), L.out_bytes()};
}

}  // namespace kvpack::testing
