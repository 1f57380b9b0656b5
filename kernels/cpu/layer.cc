// The layer driver: validation, workspace accounting, and the three phases of layer.h.
#include "kernels/cpu/layer.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/epilogue.h"
#include "kernels/cpu/pack.h"
#include "kernels/cpu/projection.h"
#include "kernels/cpu/sparse_layer.h"
#include "kernels/cpu/stats.h"
#include "kernels/cpu/thread_pool.h"

namespace kvpack::cpu {
namespace {

constexpr uint64_t kBf16Bytes = 2;

bool NeedsSamplePass(const LayerConfig& config) {
  return config.stats == nullptr && (config.transforms.smooth || config.transforms.balance);
}

Error CheckStats(const KvStats& stats, const LayerShape& shape) {
  const size_t hd = static_cast<size_t>(shape.HeadCols());
  const struct {
    const std::vector<float>* values;
    const char* name;
  } fields[] = {{&stats.mu_k, "stats.mu_k"},
                {&stats.mu_v, "stats.mu_v"},
                {&stats.lambda, "stats.lambda"},
                {&stats.lambda_v, "stats.lambda_v"}};
  for (const auto& f : fields) {
    if (f.values->size() != hd) {
      return InvalidArgument(std::string(f.name) + " has " + std::to_string(f.values->size()) +
                             " entries, expected n_heads * head_dim = " + std::to_string(hd));
    }
    for (float x : *f.values) {
      if (!std::isfinite(x)) return InvalidArgument(std::string(f.name) + " holds a non-finite value");
    }
  }
  for (int i = 2; i < 4; ++i) {  // λ and λ_v divide the stored rows
    for (float x : *fields[i].values) {
      if (!(x > 0.0f)) return InvalidArgument(std::string(fields[i].name) + " holds a value that is not positive");
    }
  }
  if (!stats.head_flags.empty() && stats.head_flags.size() != static_cast<size_t>(shape.n_heads)) {
    return InvalidArgument("stats.head_flags has " + std::to_string(stats.head_flags.size()) +
                           " entries, expected 0 or n_heads = " + std::to_string(shape.n_heads));
  }
  return Error::Ok();
}

Error CheckTensors(const LayerConfig& config, const LayerTensors& t, bool needs_out) {
  if (config.projected.enabled) {
    if (needs_out ? t.q == nullptr : (t.k == nullptr || t.v == nullptr)) {
      return InvalidArgument(needs_out ? "tensors.q is null" : "tensors.k / tensors.v are null");
    }
  } else {
    if (t.x == nullptr) return InvalidArgument("tensors.x is null");
    if (t.w_qkv == nullptr) return InvalidArgument("tensors.w_qkv is null");
  }
  if (config.has_bias && t.bias == nullptr) return InvalidArgument("tensors.bias is null but has_bias is set");
  if (config.qk_norm.enabled && (t.q_norm_weight == nullptr || t.k_norm_weight == nullptr)) {
    return InvalidArgument("tensors.q_norm_weight / k_norm_weight are null but qk_norm.enabled is set");
  }
  if (config.rope.layout != RopeLayout::kNone && t.positions == nullptr) {
    return InvalidArgument("tensors.positions is null but rope.layout is set");
  }
  if (needs_out) {
    if (t.out == nullptr) return InvalidArgument("tensors.out is null");
    if (config.in_place && t.out != t.x) return InvalidArgument("in_place is set but tensors.out != tensors.x");
  }
  return Error::Ok();
}

// The gate's verdict before a chunk of `where`, which the error names.
Error PassGate(const ChunkGate& gate, const char* where) {
  if (!gate) return Error::Ok();
  Error e = gate();
  if (e.ok()) return e;
  return Error(e.code(), e.message() + " (stopped before a chunk of " + where + ")");
}

// The bf16 K and V rows of (token, head): in the projection workspace, or in the caller's tensors.
struct RowPair {
  const uint16_t* k;
  const uint16_t* v;
};
RowPair WorkspaceRows(const uint16_t* ws_row, int64_t hd, int h, int d) {
  const uint16_t* k = ws_row + static_cast<int64_t>(h) * d;
  return {k, k + hd};
}
RowPair GivenRows(const LayerTensors& t, const ProjectedLayout& layout, int64_t token, int h) {
  const int64_t at = layout.Offset(token, h);
  return {t.k + at, t.v + at};
}

// Columns of one sampled token in the pre-pass workspace: Q (when the per-head choice needs
// queries), then K, then V.
int64_t SampleCols(const LayerConfig& config) {
  return (config.transforms.choose_per_head ? 3 : 2) * config.shape.HeadCols();
}

// With projected input the pre-pass and the K/V chunks read the caller's rows: no projection
// workspace, only the queries in stored form.
uint64_t SampleBytes(const LayerConfig& config) {
  if (!NeedsSamplePass(config) || config.projected.enabled) return 0;
  return static_cast<uint64_t>(StatsSampleCount(config.shape.n_tokens, config.transforms)) * SampleCols(config) *
         kBf16Bytes;
}
uint64_t ProjectionBytes(const LayerConfig& config) {
  if (config.projected.enabled) return 0;
  return static_cast<uint64_t>(std::min(config.projection_chunk, config.shape.n_tokens)) *
         (2 * config.shape.HeadCols()) * kBf16Bytes;
}
uint64_t QueryBytes(const LayerConfig& config) {
  const int64_t rows = config.attention.sparse.enabled ? SparseQueryRows(config)
                                                       : std::min(config.query_chunk, config.shape.n_tokens);
  return static_cast<uint64_t>(rows) * config.shape.HeadCols() * kBf16Bytes;
}

}  // namespace

// ── The three questions ─────────────────────────────────────────────────────────────────────────

Error Supported(const LayerConfig& config) {
  const LayerShape& shape = config.shape;
  if (Error e = ValidateShape(shape, false); !e.ok()) return e;
  if (Error e = ValidateRanges(shape.n_tokens, config.ranges); !e.ok()) return e;
  if (Error e = ValidateRope(config.rope, shape.head_dim); !e.ok()) return e;
  if (Error e = ValidateQkNorm(config.qk_norm, shape); !e.ok()) return e;
  if (Error e = ValidateProjected(config); !e.ok()) return e;
  if (config.projection_chunk <= 0) {
    return InvalidArgument("projection_chunk = " + std::to_string(config.projection_chunk) + " must be positive");
  }
  if (config.query_chunk <= 0) {
    return InvalidArgument("query_chunk = " + std::to_string(config.query_chunk) + " must be positive");
  }
  if (config.in_place && shape.hidden != shape.HeadCols()) {
    return InvalidArgument("in_place needs hidden (" + std::to_string(shape.hidden) + ") == n_heads * head_dim (" +
                           std::to_string(shape.HeadCols()) + ")");
  }
  if (!std::isfinite(config.attention.softmax_scale) || config.attention.softmax_scale < 0.0f) {
    return InvalidArgument("attention.softmax_scale must be finite and >= 0 (0 means 1/sqrt(head_dim))");
  }
  if (Error e = ValidateSparse(config.attention.sparse); !e.ok()) return e;
  if (config.stats != nullptr) {
    if (Error e = CheckStats(*config.stats, shape); !e.ok()) return e;
  } else if (NeedsSamplePass(config) && config.transforms.stats_sample_tokens <= 0) {
    return InvalidArgument("transforms.stats_sample_tokens = " + std::to_string(config.transforms.stats_sample_tokens) +
                           " must be positive when smoothing or balancing computes its own statistics");
  }
  return Error::Ok();
}

uint64_t KvBytes(const LayerConfig& config) {
  if (!Supported(config).ok()) return 0;
  return KvLayoutBytes(config.shape, config.ranges);
}

uint64_t WorkspaceBytes(const LayerConfig& config) {
  if (!Supported(config).ok()) return 0;
  return std::max({SampleBytes(config), ProjectionBytes(config), QueryBytes(config) + RoutingBytes(config)});
}

// ── Phases ──────────────────────────────────────────────────────────────────────────────────────

Error ProjectKv(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
                const CpuOptions& options, const ChunkGate& gate) {
  // Preconditions.
  if (Error e = Supported(config); !e.ok()) return e;
  if (Error e = CheckTensors(config, tensors, false); !e.ok()) return e;
  if (kv == nullptr || workspace == nullptr) return InvalidArgument("kv and workspace must not be null");
  const LayerShape& shape = config.shape;
  const int64_t n = shape.n_tokens;
  const int d = shape.head_dim;
  const int hidden = shape.hidden;
  const int64_t hd = shape.HeadCols();
  const int threads = ResolveThreadCount(options.n_threads);
  const EpilogueParams epilogue = MakeEpilogueParams(config, tensors);
  const ProjectedLayout& projected = config.projected;
  uint16_t* ws = reinterpret_cast<uint16_t*>(workspace);  // bf16 [rows, 2·H·d]: K columns, then V

  // Statistics pre-pass: project the sampled tokens' Q, K and V (bf16 [S, 3·H·d] in the workspace;
  // [S, 2·H·d] without the per-head choice), two passes of the epilogue per head for the statistics
  // (StatsFromSample), then the per-head choice on the same rows (ChooseTransforms).
  KvStats stats;
  TransformRecord record = FixedTransformRecord(shape, config.transforms);
  if (config.stats != nullptr) {
    stats = *config.stats;
    for (int h = 0; h < shape.n_heads; ++h) record.head_flags[h] = CallerStatsHeadFlags(config.transforms, stats, h);
  } else if (NeedsSamplePass(config)) {
    const int64_t s = StatsSampleCount(n, config.transforms);
    const int64_t cols = SampleCols(config);
    const int64_t q_cols = cols - 2 * hd;  // Q columns before K (0 without the choice)
    if (!projected.enabled) {
      ParallelFor(threads, s, [&](int64_t i) {
        const int64_t t = StatsSampleToken(i, n, s);
        ProjectRow(tensors.x + t * hidden, tensors.w_qkv, hidden, hd - q_cols, cols, ws + i * cols);
      });
    }
    const SampleRowFn kv_row = [&](int64_t i, int h, float* k_row, float* v_row) {
      const int64_t t = StatsSampleToken(i, n, s);
      const RowPair rows = projected.enabled ? GivenRows(tensors, projected, t, h)
                                             : WorkspaceRows(ws + i * cols + q_cols, hd, h, d);
      EpilogueRow(epilogue, Proj::kK, t, h, rows.k, k_row);
      EpilogueRow(epilogue, Proj::kV, t, h, rows.v, v_row);
    };
    stats = StatsFromSample(s, shape, config.transforms, kv_row, threads);
    // Queries of the sampled tokens: projected here, or the caller's (a Project call without Q
    // keeps the options' set).
    QueryRowFn q_row;
    if (config.transforms.choose_per_head && (!projected.enabled || tensors.q != nullptr)) {
      q_row = [&](int64_t i, int h, float* q) {
        const int64_t t = StatsSampleToken(i, n, s);
        const uint16_t* given = projected.enabled ? tensors.q + projected.Offset(t, h)
                                                  : ws + i * cols + static_cast<int64_t>(h) * d;
        EpilogueRow(epilogue, Proj::kQ, t, h, given, q);
      };
    }
    const TokenPageMap ranges(config.ranges);
    record = ChooseTransforms(
        s, s, shape, ChoiceTransforms(config), config.attention.softmax_scale, kv_row, q_row,
        [&](int64_t i) { return config.ranges[ranges.RangeOf(StatsSampleToken(i, n, s))].format; }, &stats, threads);
  } else {
    stats.mu_k.assign(hd, 0.0f);
    stats.mu_v.assign(hd, 0.0f);
    stats.lambda.assign(hd, 1.0f);
    stats.lambda_v.assign(hd, 1.0f);
  }
  if (Error e = PassGate(gate, "the statistics pre-pass"); !e.ok()) return e;

  // Prologue: page table, offsets and statistics into the block; pages cleared.
  const KvLayout layout = PlanKvLayout(shape, config.ranges);
  WriteBlockHeader(layout, stats, kv);
  WriteTransformRecord(layout, record, kv);
  const TokenPageMap map(config.ranges);

  // Main loop: chunks of Tp tokens — GEMM into the workspace, then epilogue and packing.
  for (int64_t begin = 0; begin < n; begin += config.projection_chunk) {
    if (Error e = PassGate(gate, "the K/V projection"); !e.ok()) return e;
    const int64_t rows = std::min(config.projection_chunk, n - begin);
    if (!projected.enabled) {
      ParallelFor(threads, rows, [&](int64_t r) {
        ProjectRow(tensors.x + (begin + r) * hidden, tensors.w_qkv, hidden, hd, 2 * hd, ws + r * 2 * hd);
      });
    }
    ParallelFor(threads, rows, [&](int64_t r) {
      const int64_t t = begin + r;
      int page, slot;
      map.Locate(t, &page, &slot);
      float k_row[kMaxHeadDimCpu], v_row[kMaxHeadDimCpu];
      for (int h = 0; h < shape.n_heads; ++h) {
        const RowPair row = projected.enabled ? GivenRows(tensors, projected, t, h)
                                              : WorkspaceRows(ws + r * 2 * hd, hd, h, d);
        EpilogueRow(epilogue, Proj::kK, t, h, row.k, k_row);
        EpilogueRow(epilogue, Proj::kV, t, h, row.v, v_row);
        PackRow(layout, shape, config.transforms, stats, page, slot, h, k_row, v_row, kv);
      }
    });
  }
  return Error::Ok();
}

Error AttendLayer(const LayerConfig& config, const LayerTensors& tensors, const KvEntryView& kv,
                  uint8_t* workspace, const CpuOptions& options, const ChunkGate& gate, SparseReport* sparse_report) {
  // Preconditions.
  if (Error e = Supported(config); !e.ok()) return e;
  if (Error e = CheckTensors(config, tensors, true); !e.ok()) return e;
  if (workspace == nullptr) return InvalidArgument("workspace must not be null");
  const LayerShape& shape = config.shape;
  if (kv.n_heads != shape.n_heads || kv.head_dim != shape.head_dim || kv.n_tokens != shape.n_tokens) {
    return InvalidArgument("kv entry shape (n_heads " + std::to_string(kv.n_heads) + ", head_dim " +
                           std::to_string(kv.head_dim) + ", n_tokens " + std::to_string(kv.n_tokens) +
                           ") does not match the layer");
  }
  const int64_t n = shape.n_tokens;
  const int d = shape.head_dim;
  const int heads = shape.n_heads;
  const int hidden = shape.hidden;
  const int64_t hd = shape.HeadCols();
  const int threads = ResolveThreadCount(options.n_threads);
  const EpilogueParams epilogue = MakeEpilogueParams(config, tensors);
  const float scale = EffectiveScale(config.attention, d);
  const TokenPageMap map(config.ranges);
  uint16_t* q_ws = reinterpret_cast<uint16_t*>(workspace);  // bf16 [Tq, H·d]: Q in stored form

  const bool sparse = config.attention.sparse.enabled;
  uint8_t* routing = workspace + QueryBytes(config);
  if (sparse) {
    uint16_t* mean_k = reinterpret_cast<uint16_t*>(routing);
    ComputePageStats(kv, mean_k, mean_k + static_cast<int64_t>(heads) * kv.n_pages * d, CpuOptions{threads});
  }
  for (int64_t begin = 0, end = 0; begin < n; begin = end) {
    if (Error e = PassGate(gate, "attention"); !e.ok()) return e;
    end = sparse ? SparseChunkEnd(config, kv.pages, kv.n_pages, begin) : std::min(begin + config.query_chunk, n);
    const int64_t rows = end - begin;
    // Q of the chunk, from x rows [begin, begin + rows) — read before any of them is overwritten.
    ParallelFor(threads, rows, [&](int64_t r) {
      const int64_t t = begin + r;
      uint16_t* q_row = q_ws + r * hd;
      if (!config.projected.enabled) ProjectRow(tensors.x + t * hidden, tensors.w_qkv, hidden, 0, hd, q_row);
      float q[kMaxHeadDimCpu];
      for (int h = 0; h < heads; ++h) {
        uint16_t* head_row = q_row + static_cast<int64_t>(h) * d;
        const uint16_t* given = config.projected.enabled ? tensors.q + config.projected.Offset(t, h) : head_row;
        EpilogueRow(epilogue, Proj::kQ, t, h, given, q);
        ToStoredQ(q, d, kv.lambda + static_cast<int64_t>(h) * d, HeadRotatesK(kv.rotate, kv.head_flags, h), kv.seed);
        for (int c = 0; c < d; ++c) head_row[c] = FloatToBf16(q[c]);  // exact: q is bf16-valued
      }
    });
    if (sparse) {
      AttendChunkSparse(config, kv, q_ws, begin, end, routing, threads, tensors.out, sparse_report);
      continue;
    }
    // Attention: tiles of kQueryTile queries × one head; writes out rows [begin, begin + rows).
    const MmaPath mma = ConfigMmaPath(config);
    const int64_t n_tiles = (rows + kQueryTile - 1) / kQueryTile;
    ParallelFor(threads, n_tiles * heads, [&](int64_t item) {
      const int64_t first = (item / heads) * kQueryTile;  // row inside the chunk
      const int h = static_cast<int>(item % heads);
      const int count = static_cast<int>(std::min<int64_t>(kQueryTile, rows - first));
      float q[kQueryTile * kMaxHeadDimCpu];
      float o[kQueryTile * kMaxHeadDimCpu];
      int32_t seq[kQueryTile];
      int64_t pos[kQueryTile];
      for (int i = 0; i < count; ++i) {
        const int64_t t = begin + first + i;
        const uint16_t* src = q_ws + (first + i) * hd + static_cast<int64_t>(h) * d;
        for (int c = 0; c < d; ++c) q[i * d + c] = Bf16ToFloat(src[c]);
        seq[i] = config.ranges[map.RangeOf(t)].seq_id;
        pos[i] = t;
      }
      AttendTile(kv, h, QueryTile{q, seq, pos, count}, config.attention.causal, scale, mma, o);
      for (int i = 0; i < count; ++i) {
        uint16_t* dst = tensors.out + (begin + first + i) * hd + static_cast<int64_t>(h) * d;
        for (int c = 0; c < d; ++c) dst[c] = FloatToBf16(o[i * d + c]);
      }
    });
  }
  return Error::Ok();
}

Error RunLayer(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
               const CpuOptions& options, const ChunkGate& gate, SparseReport* sparse_report) {
  if (Error e = ProjectKv(config, tensors, kv, workspace, options, gate); !e.ok()) return e;
  const KvLayout layout = PlanKvLayout(config.shape, config.ranges);
  const KvEntryView view = MakeKvView(layout, config.shape, kv, config.transforms);
  return AttendLayer(config, tensors, view, workspace, options, gate, sparse_report);
}

}  // namespace kvpack::cpu
