#include "tools/fit_table/fit_table.h"

#include <cstdio>

#include "server/core/pool.h"

namespace kvpack::tools {

uint64_t Breakdown::Total() const {
  uint64_t total = 0;
  for (const auto& [name, bytes] : parts) total += bytes;
  return total;
}

std::string Breakdown::ToString() const {
  std::string text;
  char buf[64];
  for (const auto& [name, bytes] : parts) {
    std::snprintf(buf, sizeof(buf), "%s%s %.2f", text.empty() ? "" : " + ", name.c_str(),
                  static_cast<double>(bytes) / kGiB);
    text += buf;
  }
  std::snprintf(buf, sizeof(buf), " = %.2f GiB", static_cast<double>(Total()) / kGiB);
  return text + buf;
}

TokenRanges H3Ranges(int64_t n) {
  // H3's 152,263 tokens: 1,063 of text, then two videos of 21 frames × 45 × 80 latent patches
  // (75,600 each): the reference and the generated one.
  constexpr int64_t kH3Tokens = 152263, kH3Text = 1063;
  TokenRanges r;
  if (n < 3) {
    r.generated = n;
    return r;
  }
  r.text = std::max<int64_t>(1, (n * kH3Text + kH3Tokens / 2) / kH3Tokens);
  r.reference = (n - r.text) / 2;
  r.generated = n - r.text - r.reference;
  return r;
}

Breakdown TorchBytes(int64_t n, const FitOptions& o) {
  const FitGeometry& g = o.geometry;
  const uint64_t a = static_cast<uint64_t>(n) * g.HeadCols() * 2;  // one [N, H·d] bf16 tensor
  Breakdown b;
  b.parts = {{"ctx", o.context_bytes},
             {"x", static_cast<uint64_t>(n) * g.hidden * 2},
             {"W", g.WeightBytes()},
             {"qkv", 3 * a},
             {"q,k normed+roped", 2 * a},
             {"sdpa out", a},
             {"out copy", a},
             {"lse", static_cast<uint64_t>(n) * g.n_heads * 4},
             {"cudnn ws", o.cudnn_workspace_bytes}};
  return b;
}

server::LayerRequest KvpackRequest(int64_t n, const KvpackMode& mode, const FitGeometry& g) {
  server::LayerRequest r;
  r.shape = LayerShape{n, g.hidden, g.n_heads, g.head_dim};
  const TokenRanges t = H3Ranges(n);
  int64_t begin = 0;
  const std::pair<int64_t, const std::vector<PageFormat>*> parts[] = {
      {t.text, &mode.text}, {t.reference, &mode.reference}, {t.generated, &mode.generated}};
  for (const auto& [tokens, allowed] : parts) {
    if (tokens == 0) continue;
    server::RangeRequest range;
    range.begin = begin;
    range.end = begin + tokens;
    range.allowed = *allowed;
    r.ranges.push_back(range);
    begin += tokens;
  }
  r.rope.layout = RopeLayout::kSplitHalves;
  r.rope.n_axes = 3;
  for (int a = 0; a < 3; ++a) r.rope.axis_dims[a] = g.rope_axis_dims[a];
  r.qk_norm.enabled = true;
  r.qk_norm.weight_len = g.head_dim;
  r.in_place = mode.in_place;
  r.resident.x = true;    // a CUDA IPC region of the caller
  r.resident.out = true;  // likewise (or x itself, in place)
  return r;               // positions travel inline: kvpackd stages them in its pool
}

KvpackFit KvpackBytes(int64_t n, uint64_t card_bytes, const KvpackMode& mode, const FitOptions& o,
                      const server::PlannerCosts& costs) {
  const FitGeometry& g = o.geometry;
  KvpackFit fit;
  Breakdown& b = fit.bytes;
  b.parts = {{"2 ctx", 2 * o.context_bytes},
             {"x", static_cast<uint64_t>(n) * g.hidden * 2},
             {"W", g.WeightBytes()}};
  if (!mode.in_place) b.parts.push_back({"out", static_cast<uint64_t>(n) * g.HeadCols() * 2});
  // kvpackd's registered copy of W and the two norm weights (RegisterWeights, one pool lease).
  b.parts.push_back({"pool W", server::PoolBytes(g.WeightBytes() + 2ull * g.head_dim * 4)});
  const uint64_t outside = b.Total();
  const uint64_t capacity = outside < card_bytes ? card_bytes - outside : 0;
  absl::StatusOr<server::LayerPlan> plan = server::PlanLayer(KvpackRequest(n, mode, g), capacity, costs);
  if (!plan.ok()) {
    fit.reason = std::string(plan.status().message());
    return fit;
  }
  fit.plan = *plan;
  b.parts.push_back({"kv", plan->kv_bytes});
  b.parts.push_back({"ws", plan->workspace_bytes});
  b.parts.push_back({"io", plan->io_bytes});
  fit.fits = plan->fits && outside < card_bytes;
  if (!fit.fits) fit.reason = plan->fits ? "the tensors outside the pool fill the card" : plan->reason;
  return fit;
}

int64_t LongestFit(const std::function<bool(int64_t)>& fits, int64_t max_n) {
  if (max_n < 1 || !fits(1)) return 0;
  if (fits(max_n)) return max_n;
  int64_t lo = 1, hi = max_n;  // fits(lo), !fits(hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace kvpack::tools
