// "Will it fit on my GPU?": the longest single-layer sequence of one geometry (MiniMax H3 by default:
// x [N, 5376] bf16, W_qkv [21504, 5376], 56 heads × 128, RMSNorm on q and k, split-half RoPE on 96
// of the 128 dims) that fits on a card of a given size, for PyTorch (x·Wᵀ + SDPA cuDNN, a byte
// model) and for kvpack (the planner, with the backend's byte functions injected).
//
// Device bytes at N, with "other tensors already allocated" = 0:
//   PyTorch  = context + x + W + qkv (3A) + q, k after norm/RoPE (2A) + SDPA output (A)
//            + the [N, H·d] output copy (A) + softmax stats (H·N fp32) + cuDNN workspace
//     (A = N·H·d·2 bytes; v stays a view of qkv, so qkv lives to the end; norm and RoPE each return
//     a new tensor, the norm outputs die when RoPE's replace them; the SDPA output [1, H, N, d] is
//     copied to [N, H·d] by reshape while it is alive). Transients inside rms_norm/RoPE (fp32
//     upcasts of one of q, k: ≤ 2A while only 5A are held) stay under the 7A of the end.
//   kvpack   = 2 contexts (the caller's and kvpackd's) + x + W (the caller's) + the output [N, H·d]
//            (a CUDA IPC region of the caller; none in place) + kvpackd's pool: W's registered copy
//            (+ q/k norm weights) and the plan's peak (packed K/V + workspace + staged positions).
//   The planner is asked with capacity = card − everything outside the pool, so its chunk choice
//   and its K/V bytes are the daemon's own.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/layer_spec.h"
#include "server/core/planner.h"

namespace kvpack::tools {

inline constexpr uint64_t kGiB = 1ull << 30;
inline constexpr uint64_t kMiB = 1ull << 20;

struct FitGeometry {
  int hidden = 5376;
  int n_heads = 56;
  int head_dim = 128;
  int rope_axis_dims[3] = {32, 32, 32};  // split halves over the first 96 channels
  uint64_t HeadCols() const { return static_cast<uint64_t>(n_heads) * head_dim; }
  uint64_t WeightBytes() const { return 3ull * HeadCols() * hidden * 2; }
};

struct FitOptions {
  FitGeometry geometry;
  // CUDA context + libraries of one process (cuBLAS/cuDNN or cuBLASLt kernels, lazy loading on).
  uint64_t context_bytes = 512 * kMiB;
  // PyTorch's cuDNN SDPA forward workspace (small for the flash-style forward graph).
  uint64_t cudnn_workspace_bytes = 64 * kMiB;
};

// Named byte counts whose sum is a device total.
struct Breakdown {
  std::vector<std::pair<std::string, uint64_t>> parts;
  uint64_t Total() const;
  std::string ToString() const;  // "ctx 0.50 + x 1.52 + ... = 11.9 GiB"
};

// The token layout of H3's sequence scaled to n tokens: a leading text range (1,063 of 152,263),
// then a reference video and the generated video (halves of the rest). n ≥ 3.
struct TokenRanges {
  int64_t text = 0, reference = 0, generated = 0;
};
TokenRanges H3Ranges(int64_t n);

// Formats per range, best first (RangeRequest::allowed), and whether the output overwrites x.
struct KvpackMode {
  std::string name;
  std::vector<PageFormat> text, reference, generated;
  bool in_place = false;
};

Breakdown TorchBytes(int64_t n, const FitOptions& options);

struct KvpackFit {
  bool fits = false;
  std::string reason;  // when !fits: the planner's reason, or what is larger than the card
  Breakdown bytes;     // device bytes (the plan's floor when !fits)
  server::LayerPlan plan;
};
// The layer request kvpackd would receive for n tokens of `mode` (positions inline, staged).
server::LayerRequest KvpackRequest(int64_t n, const KvpackMode& mode, const FitGeometry& geometry);
KvpackFit KvpackBytes(int64_t n, uint64_t card_bytes, const KvpackMode& mode, const FitOptions& options,
                      const server::PlannerCosts& costs);

// The largest n in [0, max_n] with fits(n), fits(n + 1) false (0: not even 1 token; max_n when it
// still fits). REQUIRES: fits is monotone (true up to some n, false after) — device bytes grow
// with n for both models.
int64_t LongestFit(const std::function<bool(int64_t)>& fits, int64_t max_n);

}  // namespace kvpack::tools
