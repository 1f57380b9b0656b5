// What one attention layer is, in the terms every backend shares: shapes, token ranges, options,
// tensor pointers, and the view of a packed K/V entry that the attention kernels read.
//
// Plain C++ (usable from .cu files, the planner and the service). Units: tokens, channels, bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/mma_path.h"

namespace kvpack {

// ── Shapes and ranges ───────────────────────────────────────────────────────────────────────────

struct LayerShape {
  int64_t n_tokens = 0;  // N: rows of x, queries and keys (self-attention over the packed sequence)
  int hidden = 0;        // D: columns of x
  int n_heads = 0;       // H
  int head_dim = 0;      // d; H·d need not equal D (then the output cannot overwrite x)

  int64_t QkvCols() const { return 3ll * n_heads * head_dim; }
  int64_t HeadCols() const { return static_cast<int64_t>(n_heads) * head_dim; }
};

// A half-open token interval [begin, end) stored in one format. Ranges must tile [0, N) exactly, in
// order, with no gaps or overlaps. The planner resolves a caller's list of allowed formats into the
// one `format` here.
struct TokenRange {
  int64_t begin = 0;
  int64_t end = 0;
  int32_t seq_id = 0;  // a query attends only to keys with the same seq_id
  PageFormat format = PageFormat::kInt4;
  // Block-sparse attention (AttentionOptions::sparse) only: the range's key pages are never pooled,
  // and its queries attend to every visible page exactly.
  bool always_attend = false;
  bool attend_densely = false;
};
inline constexpr int kMaxRanges = 256;  // PageDesc::range_index is 8 bits

// ── Options ─────────────────────────────────────────────────────────────────────────────────────

enum class RopeLayout : uint8_t {
  kNone = 0,
  kInterleaved = 1,  // pairs (2i, 2i+1) of the rotary channels
  kSplitHalves = 2,  // pairs (i, i + R/2), R the rotary channel count (GPT-NeoX "rotate_half")
};

// Rotary embedding on up to three position axes (t, h, w). The rotary channels are the first
// R = Σ axis_dims channels of each head; pair j of them (in the layout's pairing) belongs to the
// axis whose section holds j (sections of axis_dims[a]/2 pairs, in axis order), and turns by
// positions[token, a] · theta^(−2i/axis_dims[a]), i its index inside the section.
struct RopeOptions {
  RopeLayout layout = RopeLayout::kNone;
  float theta = 10000.0f;
  int n_axes = 0;                  // 1..3 when layout != kNone
  int axis_dims[3] = {0, 0, 0};    // each even, Σ ≤ head_dim
};

// Per-head RMS norm of q and k: x · rsqrt(mean(x²) + eps) · w, applied before RoPE.
struct QkNormOptions {
  bool enabled = false;
  float eps = 1e-6f;
  int weight_len = 0;  // head_dim (one weight vector for all heads) or n_heads·head_dim
};

// The format's three exact transforms (format.h). Each can be switched off for tests and comparison.
struct TransformOptions {
  bool rotate = true;
  bool smooth = true;
  bool balance = true;                     // channel balancing of K (λ) and of V (λ_v) together
  uint64_t seed = 0x6b7670616b763031ull;  // rotation signs; stored with the entry
  int stats_sample_tokens = 1024;          // strided pre-pass sample for μ, λ and λ_v
  // Each head keeps the subset of the transforms above that a small attention on its sample
  // estimates best (transform_choice.h); off: every head uses the set above.
  bool choose_per_head = true;
  // With choose_per_head and rotate: whether the choice may also store a head's q and k (plain K) or
  // its V (plain V) without R. Layers leave them on; ChoiceTransforms turns plain K off on the INT8
  // MMA path, which quantizes q per row and needs R to spread q's outlier channels.
  bool choose_plain_k = true;
  bool choose_plain_v = true;
};

// Block-sparse attention over the packed pages (cpu/sparse_attention.h): per (query block — the ≤ 128
// queries of a page pair —, head) some key pages are attended exactly, every other visible page contributes one pooled term.
enum class SparseMode : uint8_t {
  kTopK = 0,    // ceil(topk_ratio · visible pages), at least 1, by centroid · mean-key score
  kRelTau = 1,  // pages whose score ≥ row max − rel_tau · std of the row's scores
};
struct SparseOptions {
  bool enabled = false;
  SparseMode mode = SparseMode::kTopK;
  float topk_ratio = 0.2f;   // (0, 1]
  float rel_tau = 0.0f;      // finite, ≥ 0
  bool tail = true;          // pooled term of every visible page not attended exactly
  int sink_pages = 0;        // leading pages of the entry always exact; 0..kMaxSinkPages
  int min_exact_pages = 0;   // floor of exact pages per (query block, head); 0..kMaxMinExactPages
};
inline constexpr int kMaxSinkPages = 1024;
inline constexpr int kMaxMinExactPages = 1 << 20;

struct AttentionOptions {
  float softmax_scale = 0.0f;  // 0 means 1/√head_dim
  bool causal = false;         // key position ≤ query position (token index), within a sequence
  MmaPath mma = MmaPath::kAuto;  // tensor-core arithmetic of the attention (mma_path.h)
  SparseOptions sparse;
};

// Tallies of a block-sparse call (AttentionOptions::sparse; cpu/sparse_attention.h): the routed fraction is
// exact_pages / visible_pages over its (query block, head) pairs.
struct SparseReport {
  int64_t visible_pages = 0;  // Σ over (block, head) of pages the block sees
  int64_t exact_pages = 0;    // Σ of pages attended exactly
  int64_t pooled_pages = 0;   // Σ of pages pooled (0 with the tail off)
  double RoutedFraction() const { return visible_pages > 0 ? double(exact_pages) / double(visible_pages) : 0.0; }
};

// OK when sparse is off or every field is in range; the message names the field.
Error ValidateSparse(const SparseOptions& sparse);

// Where pre-projected Q, K and V rows sit (LayerConfig::projected): element c of head h of token t
// is at element offset Offset(t, h) + c of each of LayerTensors::q, k, v (bf16). Tokens come in
// blocks of batch_tokens (a batch element), so both a [N, H·d] row layout with any row stride and a
// [B, H, N/B, d] head-major layout are described without copying:
//   token-major  token_stride = row stride, head_stride = d,      batch_tokens = N, batch_stride = 0
//   head-major   token_stride = d,          head_stride = M·d,    batch_tokens = M, batch_stride = H·M·d
// Strides are in elements and non-negative; head_dim channels of one row are contiguous.
struct ProjectedLayout {
  bool enabled = false;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
  int64_t batch_tokens = 0;  // ≥ 1 when enabled
  int64_t batch_stride = 0;

  int64_t Offset(int64_t token, int head) const {
    return token / batch_tokens * batch_stride + token % batch_tokens * token_stride + head * head_stride;
  }
  // Elements one tensor spans: the last element of the last token's last head, plus one.
  int64_t SpanElements(const LayerShape& shape) const;
};
// ValidateProjected's bound on SpanElements: 2^44 bf16 elements (32 TiB), far above any tensor a
// host holds and far enough below 2^63 that byte counts (×2) and offsets never wrap.
inline constexpr int64_t kMaxProjectedSpanElements = int64_t{1} << 44;

// ── Tensors ─────────────────────────────────────────────────────────────────────────────────────

// Per-(head, channel) statistics, each [n_heads · head_dim] floats. With smoothing off μ is zero;
// with balancing off λ and λ_v are one. Callers may pass their own (e.g. the previous diffusion
// step's); λ and λ_v must then be finite and positive.
struct KvStats {
  std::vector<float> mu_k;
  std::vector<float> mu_v;
  std::vector<float> lambda;    // K balancing: K stored as (k − μ_k)/λ, q multiplied by λ
  std::vector<float> lambda_v;  // V balancing: V stored as (v − μ_v)/λ_v, the output multiplied by λ_v
  // Empty, or n_heads per-head flags of the choice that made the tables: their kHeadPlainK / V bits
  // (transform_choice.h, format v3) go with the tables, which no longer express a head's rotation.
  std::vector<uint32_t> head_flags;
};

// Inputs and output of one layer. Pointers are host or device memory as the backend requires.
// Ownership stays with the caller. Weights use nn.Linear's layout: qkv = x · Wᵀ, W rows [q | k | v],
// each block n_heads·head_dim rows, head-major (row h·d + c is channel c of head h).
struct LayerTensors {
  const uint16_t* x = nullptr;              // bf16 [N, D]
  const uint16_t* w_qkv = nullptr;          // bf16 [3·H·d, D]
  const float* bias = nullptr;              // [3·H·d] or null
  const float* q_norm_weight = nullptr;     // [QkNormOptions::weight_len] or null
  const float* k_norm_weight = nullptr;     // [QkNormOptions::weight_len] or null
  const float* positions = nullptr;         // [N, RopeOptions::n_axes] or null without RoPE
  uint16_t* out = nullptr;                  // bf16 [N, H·d]; may equal x when D == H·d (in place)
  // With LayerConfig::projected instead of x and the weights: rows placed by projected.Offset.
  const uint16_t* q = nullptr;
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
};

// Called by the layer drivers (cpu/layer.h, cuda/layer.h) before each chunk of work: the statistics
// pre-pass, every projection chunk, every query chunk. A non-OK Error stops the call with that
// error. It is how a caller cancels between chunks, and how concurrent calls on one GPU take turns
// chunk by chunk (it may block until the call's turn comes). Empty: no hook.
using ChunkGate = std::function<Error()>;
// A gate that stops the call with kCancelled once `cancelled()` returns true.
ChunkGate CancelGate(std::function<bool()> cancelled);

// ── Packed entry as kernels see it ──────────────────────────────────────────────────────────────

// Plain pointers into one memory space (host for the CPU backend, device for CUDA). Page p of
// head h: K at pool + k_offsets[h·n_pages + p], V at pool + v_offsets[h·n_pages + p].
struct KvEntryView {
  int n_heads = 0;
  int head_dim = 0;
  int64_t n_tokens = 0;
  int n_pages = 0;
  const PageDesc* pages = nullptr;     // [n_pages], shared by all heads
  const uint8_t* pool = nullptr;
  const uint64_t* k_offsets = nullptr; // [n_heads · n_pages]
  const uint64_t* v_offsets = nullptr; // [n_heads · n_pages]
  const float* mu_k = nullptr;         // [n_heads · head_dim]
  const float* mu_v = nullptr;         // [n_heads · head_dim]
  const float* lambda = nullptr;       // [n_heads · head_dim]  K balancing
  const float* lambda_v = nullptr;     // [n_heads · head_dim]  V balancing
  const uint32_t* head_flags = nullptr; // [n_heads] HeadTransformFlag bits (transform_choice.h); kernels read the plain bits (HeadRotatesK / V)
  const float* head_estimates = nullptr;  // [n_heads · kHeadEstimateFields] (KvLayout); kernels ignore it
  uint64_t seed = 0;
  bool rotate = true;
};

// ── One layer, and the memory its backend needs ────────────────────────────────────────────────

// Everything about one layer except its tensors. Backends answer the three questions of STYLE.md
// about it: Supported(config), KvBytes/WorkspaceBytes(config), RunLayer(config, tensors, memory).
struct LayerConfig {
  LayerShape shape;
  std::vector<TokenRange> ranges;        // tile [0, N); one format each
  RopeOptions rope;
  QkNormOptions qk_norm;
  TransformOptions transforms;
  AttentionOptions attention;
  bool has_bias = false;
  int64_t projection_chunk = 4096;       // Tp: tokens per streamed K/V projection chunk
  int64_t query_chunk = 4096;            // Tq: tokens per query chunk (Q projected, attended, written)
  bool in_place = false;                 // tensors.out == tensors.x (needs hidden == H·d)
  // Pre-projected input: tensors.q/k/v instead of x and weights. No GEMM runs; bias, QK-norm and
  // RoPE must be off (the caller applied them), in_place must be false; hidden is unused.
  ProjectedLayout projected;
  const KvStats* stats = nullptr;        // caller's μ, λ, λ_v; null → the strided pre-pass computes them
};

// Where a packed entry's pieces sit inside its one memory block (KvLayout::total_bytes long): all K
// pages head-major (head 0 pages 0..P−1, head 1, …), then all V pages likewise, then the tables the
// kernels read (PageDesc[P], k_offsets[H·P], v_offsets[H·P], μ_k, μ_v, λ, λ_v as float[H·d] each),
// then (format v2) the per-head record of the transform choice: head_flags uint32[H] and
// head_estimates float[H·kHeadEstimateFields]. Pages sit at 128-byte aligned offsets; tables at
// 256-byte aligned offsets.
struct KvLayout {
  std::vector<PageDesc> pages;
  std::vector<uint64_t> k_offsets;  // [H·P] byte offsets from the block start
  std::vector<uint64_t> v_offsets;  // [H·P]
  uint64_t page_bytes = 0;          // bytes of all K and V pages
  uint64_t pages_offset = 0;
  uint64_t k_offsets_offset = 0;
  uint64_t v_offsets_offset = 0;
  uint64_t mu_k_offset = 0;
  uint64_t mu_v_offset = 0;
  uint64_t lambda_offset = 0;
  uint64_t lambda_v_offset = 0;
  uint64_t head_flags_offset = 0;
  uint64_t head_estimates_offset = 0;
  uint64_t total_bytes = 0;
};

// Per head in the head_estimates table: the estimate's squared error of the sampled outputs with
// every sampled key in format f (index = PageFormat), then the squared norm of the exact sampled
// outputs. All zero when the estimate did not run (no queries in the sample, or caller's stats).
inline constexpr int kHeadEstimateFields = kNumPageFormats + 1;

// REQUIRES: ValidateShape and ValidateRanges passed.
KvLayout PlanKvLayout(const LayerShape& shape, const std::vector<TokenRange>& ranges);

// PlanKvLayout(shape, ranges).total_bytes without building the per-page tables: O(ranges), for the
// planner's many questions (the full layout of an H3-sized entry holds 56 · 2 · 2380 offsets).
uint64_t KvLayoutBytes(const LayerShape& shape, const std::vector<TokenRange>& ranges);

// PlanKvLayout(shape, ranges) without the per-page vectors (pages, k_offsets, v_offsets empty):
// the table offsets and total_bytes in O(ranges).
KvLayout PlanKvTables(const LayerShape& shape, const std::vector<TokenRange>& ranges);

// Copies the page table and offsets (not the stats) into a host image of the block's table part:
// `tables` points at block offset layout.pages_offset and spans up to layout.mu_k_offset.
void WriteKvTables(const KvLayout& layout, uint8_t* tables);

// A view of a block laid out by `layout` at `block` (host or device address).
KvEntryView MakeKvView(const KvLayout& layout, const LayerShape& shape, const uint8_t* block,
                       const TransformOptions& transforms);

// ── Shared host-side helpers (layer_spec.cc) ────────────────────────────────────────────────────

// The MMA path of a layer of `config` on a kernel that has every path (mma_path.h ResolveMmaPath over
// config.attention.mma, its ranges' formats, head_dim and rotation), dense or sparse.
MmaPath ConfigMmaPath(const LayerConfig& config);

// The transforms the per-head choice runs with: `transforms`, with choose_plain_k off where the
// attention takes the INT8 MMA path (`resolved`, ResolveMmaPath), whose per-row q quantization needs R.
TransformOptions ChoiceTransforms(const TransformOptions& transforms, MmaPath resolved);
// The same for a layer: its transforms and ConfigMmaPath.
TransformOptions ChoiceTransforms(const LayerConfig& config);

// Pages of the token layout: each range split into ceil(len/64) pages, the last one partial.
std::vector<PageDesc> BuildPageLayout(const std::vector<TokenRange>& ranges);

// Checks that ranges tile [0, n_tokens) in order, are at most kMaxRanges, and name known formats.
// The message names the first bad range by index and field ("ranges[2].begin = 90 overlaps ...").
Error ValidateRanges(int64_t n_tokens, const std::vector<TokenRange>& ranges);

// Checks shapes: positive sizes, head_dim a power of two in [16, 256] (or {64, 128} when
// for_gpu), hidden > 0.
Error ValidateShape(const LayerShape& shape, bool for_gpu);

// Checks RoPE and QK-norm options against head_dim / n_heads.
Error ValidateRope(const RopeOptions& rope, int head_dim);
Error ValidateQkNorm(const QkNormOptions& norm, const LayerShape& shape);

// With config.projected.enabled: bias, QK-norm, RoPE and in_place off, strides that keep heads and
// tokens apart (token-major rows hold H·d values; head-major blocks hold M rows). OK otherwise.
Error ValidateProjected(const LayerConfig& config);

}  // namespace kvpack
