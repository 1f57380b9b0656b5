#include "kernels/cuda/layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/head_choice.h"
#include "kernels/cuda/row_epilogue.h"
#include "kernels/cuda/sparse.h"
#include "kernels/sparse_plan.h"
#include "kernels/transform_choice.h"

namespace kvpack::cuda {
namespace {

constexpr uint64_t kAlign = 256;
uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

int64_t SampleTokens(const LayerConfig& c) {
  return std::min<int64_t>(c.shape.n_tokens, std::max(1, c.transforms.stats_sample_tokens));
}
int64_t ProjectionRows(const LayerConfig& c) { return std::min(c.projection_chunk, c.shape.n_tokens); }
int64_t QueryRows(const LayerConfig& c) { return std::min(c.query_chunk, c.shape.n_tokens); }

// Pieces of the pre-pass inside the main workspace region.
struct StatsScratch {
  uint64_t index = 0, gathered = 0, projected = 0, floats = 0, choice = 0, estimate = 0, end = 0;
};
// With pre-projected input the epilogue reads the sampled rows in place: no gathered x, no GEMM output.
StatsScratch PlanStatsScratch(const LayerConfig& c) {
  const uint64_t s = SampleTokens(c), hd = c.shape.HeadCols();
  const bool gemm = !c.projected.enabled;
  StatsScratch p;
  p.index = 0;
  p.gathered = AlignUp(p.index + s * sizeof(int64_t));
  p.projected = AlignUp(p.gathered + (gemm ? s * c.shape.hidden * 2 : 0));
  p.floats = AlignUp(p.projected + (gemm ? s * 2 * hd * 2 : 0));
  const uint64_t floats_end = AlignUp(p.floats + s * 2 * hd * sizeof(float));
  // The per-head choice's sample (head_choice.h) runs after the statistics epilogue, when the gathered
  // x rows and their GEMM output are dead: it reuses their bytes where it fits there (at H3 scale,
  // S = 1024: 29 MiB of choice in 44 MiB), else it follows the floats it reads.
  const uint64_t choice = ChoiceScratchBytes(c);
  p.choice = p.gathered + choice <= p.floats ? p.gathered : floats_end;
  const uint64_t choice_end = AlignUp(p.choice + choice);
  // The estimate (head_choice.h step 4) runs once the keys are gathered from the floats: it takes
  // their bytes where it fits there (H3: 47 of 59 MiB), else it follows everything.
  const uint64_t estimate = ChoiceEstimateBytes(c);
  p.estimate = p.floats + estimate <= floats_end ? p.floats : std::max(floats_end, choice_end);
  p.end = std::max({floats_end, choice_end, AlignUp(p.estimate + estimate)});
  return p;
}

uint64_t MainRegionBytes(const LayerConfig& c) {
  const uint64_t hd = c.shape.HeadCols();
  const uint64_t projection = c.projected.enabled ? 0 : AlignUp(ProjectionRows(c) * 2 * hd * 2);
  // Sparse: the stored queries of a chunk ending on a page end (sparse_plan.h), then the routing region.
  const uint64_t query = c.attention.sparse.enabled ? AlignUp(SparseQueryRows(c) * hd * 2) + PlanSparseRegion(c).end
                                                    : AlignUp(QueryRows(c) * hd * 2);
  const uint64_t stats = c.stats ? 0 : PlanStatsScratch(c).end;
  return std::max({projection, query, stats});
}

// The cuBLASLt workspace sits first; pre-projected input runs no GEMM and has none.
uint64_t BlasBytes(const LayerConfig& c) { return c.projected.enabled ? 0 : kBlasWorkspaceBytes; }

float* Slot(const CudaContext& ctx, float StageTimes::*member) { return ctx.times ? &(ctx.times->*member) : nullptr; }

// Events around the launches of one stage; summed into StageTimes at Finish().
class StageClock {
 public:
  explicit StageClock(const CudaContext& ctx) : ctx_(ctx) {}
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;
  ~StageClock() {
    for (auto& m : marks_) cudaEventDestroy(m.first), cudaEventDestroy(m.second.first);
  }
  // Runs `launch` (which enqueues work on the stream) between two events whose interval Finish adds
  // to `stage` of ctx.times; without ctx.times it only runs `launch`.
  template <typename Launch>
  Error Time(float StageTimes::*stage, Launch&& launch) {
    KVPACK_RETURN_IF_ERROR(Start(Slot(ctx_, stage)));
    KVPACK_RETURN_IF_ERROR(launch());
    return Stop();
  }
  Error Finish() {
    if (!ctx_.times) return Error::Ok();
    KVPACK_CUDA_RETURN(cudaStreamSynchronize(ctx_.stream));
    for (auto& m : marks_) {
      float ms = 0;
      KVPACK_CUDA_RETURN(cudaEventElapsedTime(&ms, m.first, m.second.first));
      *m.second.second += ms;
    }
    return Error::Ok();
  }

 private:
  Error Start(float* slot) {
    if (!ctx_.times) return Error::Ok();
    cudaEvent_t a, b;
    KVPACK_CUDA_RETURN(cudaEventCreate(&a));
    KVPACK_CUDA_RETURN(cudaEventCreate(&b));
    marks_.push_back({a, {b, slot}});
    return CudaError(cudaEventRecord(a, ctx_.stream), "cudaEventRecord");
  }
  Error Stop() {
    if (!ctx_.times) return Error::Ok();
    return CudaError(cudaEventRecord(marks_.back().second.first, ctx_.stream), "cudaEventRecord");
  }

  const CudaContext& ctx_;
  std::vector<std::pair<cudaEvent_t, std::pair<cudaEvent_t, float*>>> marks_;
};

// The parts of a row epilogue that come from the config and tensors.
RowEpilogueParams BaseRowParams(const LayerConfig& c, const LayerTensors& t) {
  RowEpilogueParams p;
  p.n_heads = c.shape.n_heads;
  p.head_dim = c.shape.head_dim;
  p.bias = c.has_bias ? t.bias : nullptr;
  p.norm = c.qk_norm.enabled;
  p.q_norm_weight = t.q_norm_weight;
  p.k_norm_weight = t.k_norm_weight;
  p.norm_weight_len = c.qk_norm.weight_len;
  p.norm_eps = c.qk_norm.eps;
  FillRopeTable(c.rope, &p);
  p.positions = t.positions;
  p.rotate = c.transforms.rotate;
  p.seed = c.transforms.seed;
  return p;
}

Error CheckTensors(const LayerConfig& c, const LayerTensors& t) {
  if (c.projected.enabled) {
    for (const uint16_t* given : {t.q, t.k, t.v}) {
      if (!given) return InvalidArgument("tensors.q / k / v: null with projected input");
      if (reinterpret_cast<uintptr_t>(given) % 16 != 0) {
        return InvalidArgument("tensors.q / k / v must be 16-byte aligned (vector loads of a row)");
      }
    }
    if (!t.out) return InvalidArgument("tensors.out is null");
    return Error::Ok();
  }
  if (!t.x) return InvalidArgument("tensors.x is null");
  if (!t.w_qkv) return InvalidArgument("tensors.w_qkv is null");
  if (!t.out) return InvalidArgument("tensors.out is null");
  if (c.has_bias && !t.bias) return InvalidArgument("tensors.bias is null but has_bias is set");
  if (c.rope.layout != RopeLayout::kNone && !t.positions) return InvalidArgument("tensors.positions is null but RoPE is on");
  if (c.qk_norm.enabled && (!t.q_norm_weight || !t.k_norm_weight)) {
    return InvalidArgument("tensors.q_norm_weight / k_norm_weight are required with qk_norm.enabled");
  }
  if (c.in_place && t.out != t.x) return InvalidArgument("in_place is set but tensors.out != tensors.x");
  if (!c.in_place && t.out == t.x) return InvalidArgument("tensors.out == tensors.x needs in_place");
  return Error::Ok();
}

Error PassGate(const ChunkGate& gate) { return gate ? gate() : Error::Ok(); }

int MaxPageBytes(const LayerConfig& c) {
  int bytes = 0;
  for (const TokenRange& r : c.ranges) bytes = std::max(bytes, PageBytes(r.format, c.shape.head_dim));
  return bytes;
}

}  // namespace

Error ResolveLayerKernel(const LayerConfig& c, AttentionTilingChoice requested, AttentionTilingChoice* tiling,
                         MmaPath* mma) {
  KVPACK_RETURN_IF_ERROR(ResolveAttentionTiling(c.shape.head_dim, MaxPageBytes(c), requested, tiling));
  *mma = ConfigMmaPath(c);
  if (*mma == MmaPath::kFp8) {
    return Unsupported("attention.mma = fp8: the CPU reference emulates it (mma_path.h); no GPU kernel runs it yet");
  }
  return Error::Ok();
}

namespace {

// The statistics pre-pass: sample, project, epilogue to float, reduce into the entry's tables; then,
// with the per-head choice, the choice from the same sample (head_choice.h).
Error ComputeStatsOnDevice(const LayerConfig& c, const LayerTensors& t, const KvLayout& layout, uint8_t* kv,
                           uint8_t* workspace, uint8_t* main, BlasGemm& gemm, const CudaContext& ctx) {
  const int64_t n = c.shape.n_tokens, s = SampleTokens(c), hd = c.shape.HeadCols();
  const StatsScratch sp = PlanStatsScratch(c);
  std::vector<int64_t> index(s);
  for (int64_t i = 0; i < s; ++i) index[i] = i * n / s;  // strided over the whole sequence
  int64_t* d_index = reinterpret_cast<int64_t*>(main + sp.index);
  uint16_t* gathered = reinterpret_cast<uint16_t*>(main + sp.gathered);
  uint16_t* projected = reinterpret_cast<uint16_t*>(main + sp.projected);
  float* floats = reinterpret_cast<float*>(main + sp.floats);
  KVPACK_CUDA_RETURN(cudaMemcpyAsync(d_index, index.data(), s * sizeof(int64_t), cudaMemcpyHostToDevice, ctx.stream));
  RowEpilogueParams p = BaseRowParams(c, t);
  if (c.projected.enabled) {  // the sampled rows are read where the caller keeps them
    p.given[0] = t.k, p.given[1] = t.v, p.given_layout = c.projected;
  } else {
    KVPACK_RETURN_IF_ERROR(LaunchGatherRows(t.x, c.shape.hidden, d_index, s, gathered, ctx.stream));
    GemmArgs g;
    g.a = gathered, g.lda = c.shape.hidden;
    g.b = t.w_qkv + hd * c.shape.hidden, g.ldb = c.shape.hidden;  // rows [k | v] of W
    g.c = projected, g.ldc = 2 * hd;
    g.m = s, g.n = 2 * hd, g.k = c.shape.hidden;
    KVPACK_RETURN_IF_ERROR(gemm.Run(g, ctx.stream));
    p.in = projected, p.in_stride = 2 * hd;
  }
  p.n_rows = s, p.token_index = d_index;
  p.out_float = floats;
  KVPACK_RETURN_IF_ERROR(LaunchRowEpilogue(RowMode::kStats, p, ctx.stream));
  KvStatsOut out;
  out.mu_k = reinterpret_cast<float*>(kv + layout.mu_k_offset);
  out.mu_v = reinterpret_cast<float*>(kv + layout.mu_v_offset);
  out.lambda = reinterpret_cast<float*>(kv + layout.lambda_offset);
  out.lambda_v = reinterpret_cast<float*>(kv + layout.lambda_v_offset);
  KVPACK_RETURN_IF_ERROR(LaunchKvStats(floats, s, c.shape.n_heads, c.shape.head_dim, c.transforms.smooth,
                                       c.transforms.balance, out, ctx.stream));
  if (!ChoosesPerHead(c)) return Error::Ok();
  return ChooseHeadTransformsFromDevice(c, t, BaseRowParams(c, t), floats, layout, kv, main + sp.choice,
                                        main + sp.estimate, ctx.blas, workspace, ctx.stream);
}

// The Q epilogue's parameters: stored form (bias, QK-norm, RoPE, ×λ, R) in place in the workspace q.
RowEpilogueParams QueryRowParams(const LayerConfig& c, const LayerTensors& t, const KvEntryView& kv, uint16_t* q) {
  const int64_t hd = c.shape.HeadCols();
  RowEpilogueParams p = BaseRowParams(c, t);
  p.in = q, p.in_stride = hd, p.out_bf16 = q, p.out_stride = hd;
  if (c.projected.enabled) p.given[0] = t.q, p.given_layout = c.projected;  // read there, stored form into q
  p.lambda = kv.lambda, p.rotate = kv.rotate, p.head_flags = kv.head_flags, p.seed = kv.seed;
  return p;
}

// What every attention launch of the layer shares (queries from q, rows of H·d).
AttentionParams BaseAttentionParams(const LayerConfig& c, const KvEntryView& kv, const uint16_t* q) {
  const int64_t hd = c.shape.HeadCols();
  AttentionParams a;
  a.q = q, a.q_stride = hd;
  a.out_stride = hd;
  a.kv = kv;
  a.softmax_scale = c.attention.softmax_scale > 0.0f ? c.attention.softmax_scale
                                                      : 1.0f / std::sqrt(static_cast<float>(c.shape.head_dim));
  a.visibility.causal = c.attention.causal;
  a.max_page_bytes = MaxPageBytes(c);
  return a;
}

// The Q projection of rows [q0, q0 + rows) into the stored-form workspace q (GEMM, then the epilogue).
Error ProjectQueries(const LayerConfig& c, const LayerTensors& t, int64_t q0, int64_t rows, uint16_t* q,
                     RowEpilogueParams& p, BlasGemm& gemm, StageClock& clock, const CudaContext& ctx) {
  const int64_t hd = c.shape.HeadCols(), hidden = c.shape.hidden;
  if (!c.projected.enabled) {
    GemmArgs g;
    g.a = t.x + q0 * hidden, g.lda = hidden;
    g.b = t.w_qkv, g.ldb = hidden;  // rows [q] of W
    g.c = q, g.ldc = hd;
    g.m = rows, g.n = hd, g.k = hidden;
    KVPACK_RETURN_IF_ERROR(clock.Time(&StageTimes::q_gemm_ms, [&] { return gemm.Run(g, ctx.stream); }));
  }
  p.n_rows = rows, p.token_begin = q0;
  return clock.Time(&StageTimes::q_epilogue_ms, [&] { return LaunchRowEpilogue(RowMode::kQuery, p, ctx.stream); });
}

// AttendLayer with config.attention.sparse (sparse.h): page statistics once, then per query chunk (ending
// on a page end) the Q projection, the routing and the exact + pooled attention of its blocks.
Error AttendSparse(const LayerConfig& c, const LayerTensors& t, const KvEntryView& kv, uint8_t* workspace,
                   const CudaContext& ctx, const ChunkGate& gate, SparseReport* report) {
  KVPACK_RETURN_IF_ERROR(SparseSupported(c));
  const int64_t n = c.shape.n_tokens, hd = c.shape.HeadCols();
  uint8_t* main = workspace + BlasBytes(c);
  BlasGemm gemm(ctx.blas, workspace);
  StageClock clock(ctx);
  uint16_t* q = reinterpret_cast<uint16_t*>(main);  // [SparseQueryRows, H·d] bf16
  uint8_t* region = main + AlignUp(SparseQueryRows(c) * hd * 2);
  const SparseRegion r = PlanSparseRegion(c);
  RowEpilogueParams p = QueryRowParams(c, t, kv, q);
  SparseChunk chunk;
  AttentionParams& a = chunk.attention;
  a = BaseAttentionParams(c, kv, q);
  // The wgmma kernel's routed instance where the GPU runs it, else the portable kernel; the layer's
  // MMA path (ConfigMmaPath), as on the dense path.
  KVPACK_RETURN_IF_ERROR(ResolveLayerKernel(c, ctx.attention_tiling, &a.tiling, &a.mma));
  chunk.options = c.attention.sparse;
  BindSparseRegion(r, region, &chunk);
  chunk.n_ranges = static_cast<int>(c.ranges.size());

  KVPACK_RETURN_IF_ERROR(PassGate(gate));
  std::vector<uint8_t> flags(c.ranges.size());
  for (size_t i = 0; i < c.ranges.size(); ++i) {
    flags[i] = static_cast<uint8_t>((c.ranges[i].always_attend ? kSparseRangeAlwaysAttend : 0) |
                                    (c.ranges[i].attend_densely ? kSparseRangeAttendDensely : 0));
  }
  KVPACK_CUDA_RETURN(cudaMemcpyAsync(region + r.flags, flags.data(), flags.size(), cudaMemcpyHostToDevice, ctx.stream));
  const std::vector<PageDesc> pages = BuildPageLayout(c.ranges);
  const std::vector<int32_t> leads = QueryBlockLeads(pages.data(), static_cast<int>(pages.size()));
  KVPACK_CUDA_RETURN(cudaMemcpyAsync(chunk.lead_table, leads.data(), leads.size() * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, ctx.stream));
  KVPACK_CUDA_RETURN(cudaMemsetAsync(chunk.tallies, 0, 3 * sizeof(unsigned long long), ctx.stream));
  KVPACK_RETURN_IF_ERROR(clock.Time(&StageTimes::routing_ms, [&] {
    return LaunchPageStats(kv, chunk.attention.route, ctx.stream);
  }));

  int first_page = 0, first_block = 0;
  for (int64_t begin = 0; begin < n;) {
    KVPACK_RETURN_IF_ERROR(PassGate(gate));
    const int64_t end = SparseChunkEnd(c, pages.data(), static_cast<int>(pages.size()), begin);
    KVPACK_RETURN_IF_ERROR(ProjectQueries(c, t, begin, end - begin, q, p, gemm, clock, ctx));
    int last_page = first_page;
    while (last_page < static_cast<int>(pages.size()) && pages[last_page].token_begin < end) ++last_page;
    a.q_token_begin = begin, a.n_q = end - begin;
    a.out = t.out + begin * hd;
    int last_block = first_block;
    while (last_block < static_cast<int>(leads.size()) && leads[last_block] < last_page) ++last_block;
    chunk.attention.route.first_page = first_page;
    chunk.attention.route.n_blocks = last_page - first_page;
    chunk.attention.route.leads = chunk.lead_table + first_block;
    chunk.attention.route.n_leads = last_block - first_block;
    KVPACK_RETURN_IF_ERROR(clock.Time(&StageTimes::routing_ms, [&] { return LaunchRoutePages(chunk, ctx.stream); }));
    KVPACK_RETURN_IF_ERROR(
        clock.Time(&StageTimes::attention_ms, [&] { return LaunchSparseAttention(chunk, ctx.stream); }));
    first_page = last_page, first_block = last_block;
    begin = end;
  }
  if (report != nullptr) {  // the tallies, after the last chunk's routing
    unsigned long long tallies[3] = {0, 0, 0};
    KVPACK_CUDA_RETURN(cudaMemcpyAsync(tallies, chunk.tallies, sizeof(tallies), cudaMemcpyDeviceToHost, ctx.stream));
    KVPACK_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
    report->visible_pages += static_cast<int64_t>(tallies[0]);
    report->exact_pages += static_cast<int64_t>(tallies[1]);
    report->pooled_pages += static_cast<int64_t>(tallies[2]);
  }
  return clock.Finish();
}

}  // namespace

Error Supported(const LayerConfig& c) {
  KVPACK_RETURN_IF_ERROR(ValidateShape(c.shape, /*for_gpu=*/true));
  KVPACK_RETURN_IF_ERROR(ValidateRanges(c.shape.n_tokens, c.ranges));
  KVPACK_RETURN_IF_ERROR(ValidateRope(c.rope, c.shape.head_dim));
  KVPACK_RETURN_IF_ERROR(ValidateQkNorm(c.qk_norm, c.shape));
  KVPACK_RETURN_IF_ERROR(ValidateProjected(c));
  if (c.projected.enabled && (c.projected.token_stride % 8 != 0 || c.projected.batch_stride % 8 != 0)) {
    return InvalidArgument("projected: token and batch strides must be multiples of 8 elements on the GPU (16-byte rows)");
  }
  if (!c.projected.enabled && c.shape.hidden % 8 != 0) {
    return Unsupported("hidden = " + std::to_string(c.shape.hidden) + " must be a multiple of 8 on the GPU");
  }
  if (c.projection_chunk <= 0) return InvalidArgument("projection_chunk must be positive");
  if (c.query_chunk <= 0) return InvalidArgument("query_chunk must be positive");
  if (c.attention.sparse.enabled) KVPACK_RETURN_IF_ERROR(SparseSupported(c));
  if (c.in_place && c.shape.hidden != c.shape.HeadCols()) {
    return InvalidArgument("in_place needs hidden (" + std::to_string(c.shape.hidden) + ") == n_heads * head_dim (" +
                           std::to_string(c.shape.HeadCols()) + ")");
  }
  if (c.stats) {
    const size_t want = static_cast<size_t>(c.shape.HeadCols());
    if (c.stats->mu_k.size() != want || c.stats->mu_v.size() != want || c.stats->lambda.size() != want ||
        c.stats->lambda_v.size() != want) {
      return InvalidArgument("stats: mu_k, mu_v, lambda and lambda_v must each hold n_heads * head_dim = " +
                             std::to_string(want) + " values");
    }
    if (!c.stats->head_flags.empty() && c.stats->head_flags.size() != static_cast<size_t>(c.shape.n_heads)) {
      return InvalidArgument("stats.head_flags must hold 0 or n_heads = " + std::to_string(c.shape.n_heads) + " flags");
    }
  } else if (c.transforms.stats_sample_tokens <= 0) {
    return InvalidArgument("transforms.stats_sample_tokens must be positive");
  }
  return Error::Ok();
}

uint64_t KvBytes(const LayerConfig& c) { return KvLayoutBytes(c.shape, c.ranges); }

uint64_t WorkspaceBytes(const LayerConfig& c) { return BlasBytes(c) + MainRegionBytes(c); }
uint64_t RoutingBytes(const LayerConfig& c) { return c.attention.sparse.enabled ? PlanSparseRegion(c).end : 0; }

Error ProjectKv(const LayerConfig& c, const LayerTensors& t, uint8_t* kv, uint8_t* workspace,
                const CudaContext& ctx, const ChunkGate& gate) {
  // ── Preconditions ─────────────────────────────────────────────────────────────────────────────
  KVPACK_RETURN_IF_ERROR(Supported(c));
  KVPACK_RETURN_IF_ERROR(CheckTensors(c, t));
  if (!kv || !workspace) return InvalidArgument("kv and workspace must be device buffers");
  const KvLayout layout = PlanKvLayout(c.shape, c.ranges);
  const int64_t n = c.shape.n_tokens, hd = c.shape.HeadCols(), hidden = c.shape.hidden;
  uint8_t* main = workspace + BlasBytes(c);
  BlasGemm gemm(ctx.blas, workspace);
  StageClock clock(ctx);

  // ── Tables: zeroed pages (unused slots read as zeros), page table and offsets ─────────────────
  KVPACK_RETURN_IF_ERROR(PassGate(gate));  // the prologue and the pre-pass are one chunk of GPU work
  KVPACK_CUDA_RETURN(cudaMemsetAsync(kv, 0, layout.page_bytes, ctx.stream));
  std::vector<uint8_t> tables(layout.mu_k_offset - layout.pages_offset);
  WriteKvTables(layout, tables.data());
  KVPACK_CUDA_RETURN(cudaMemcpyAsync(kv + layout.pages_offset, tables.data(), tables.size(), cudaMemcpyHostToDevice,
                                     ctx.stream));
  // Per-head record (format v2): the options' set (with the caller's statistics, their plain bits) and
  // no estimate, as the CPU layer records it without a choice; the pre-pass overwrites it when it
  // chooses per head (head_choice.h).
  std::vector<uint8_t> record(layout.total_bytes - layout.head_flags_offset, 0);
  for (int h = 0; h < c.shape.n_heads; ++h) {
    const uint32_t flags = c.stats ? CallerStatsHeadFlags(c.transforms, *c.stats, h) : FixedHeadFlags(c.transforms);
    memcpy(record.data() + h * sizeof(uint32_t), &flags, sizeof(flags));
  }
  KVPACK_CUDA_RETURN(cudaMemcpyAsync(kv + layout.head_flags_offset, record.data(), record.size(),
                                     cudaMemcpyHostToDevice, ctx.stream));

  // ── Statistics: the caller's, or the pre-pass ─────────────────────────────────────────────────
  if (c.stats) {
    const size_t bytes = hd * sizeof(float);
    KVPACK_CUDA_RETURN(cudaMemcpyAsync(kv + layout.mu_k_offset, c.stats->mu_k.data(), bytes, cudaMemcpyHostToDevice, ctx.stream));
    KVPACK_CUDA_RETURN(cudaMemcpyAsync(kv + layout.mu_v_offset, c.stats->mu_v.data(), bytes, cudaMemcpyHostToDevice, ctx.stream));
    KVPACK_CUDA_RETURN(cudaMemcpyAsync(kv + layout.lambda_offset, c.stats->lambda.data(), bytes, cudaMemcpyHostToDevice, ctx.stream));
    KVPACK_CUDA_RETURN(cudaMemcpyAsync(kv + layout.lambda_v_offset, c.stats->lambda_v.data(), bytes, cudaMemcpyHostToDevice,
                                       ctx.stream));
  } else {
    KVPACK_RETURN_IF_ERROR(clock.Time(&StageTimes::stats_ms, [&] {
      return ComputeStatsOnDevice(c, t, layout, kv, workspace, main, gemm, ctx);
    }));
  }

  // ── Streamed projection: per chunk one GEMM into [Tp, 2·H·d] bf16, one fused epilogue ─────────
  const KvEntryView view = MakeKvView(layout, c.shape, kv, c.transforms);
  uint16_t* projected = reinterpret_cast<uint16_t*>(main);
  RowEpilogueParams p = BaseRowParams(c, t);
  p.in = projected, p.in_stride = 2 * hd;
  if (c.projected.enabled) p.given[0] = t.k, p.given[1] = t.v, p.given_layout = c.projected;
  p.mu_k = view.mu_k, p.mu_v = view.mu_v, p.lambda = view.lambda, p.lambda_v = view.lambda_v;
  p.head_flags = view.head_flags;
  p.kv_block = kv, p.pages = view.pages, p.n_pages = view.n_pages;
  p.k_offsets = view.k_offsets, p.v_offsets = view.v_offsets;
  const int64_t tp = ProjectionRows(c);
  for (int64_t t0 = 0; t0 < n; t0 += tp) {
    KVPACK_RETURN_IF_ERROR(PassGate(gate));
    const int64_t rows = std::min(tp, n - t0);
    if (!c.projected.enabled) {
      GemmArgs g;
      g.a = t.x + t0 * hidden, g.lda = hidden;
      g.b = t.w_qkv + hd * hidden, g.ldb = hidden;
      g.c = projected, g.ldc = 2 * hd;
      g.m = rows, g.n = 2 * hd, g.k = hidden;
      KVPACK_RETURN_IF_ERROR(clock.Time(&StageTimes::kv_gemm_ms, [&] { return gemm.Run(g, ctx.stream); }));
    }
    p.n_rows = rows, p.token_begin = t0;
    KVPACK_RETURN_IF_ERROR(
        clock.Time(&StageTimes::kv_epilogue_ms, [&] { return LaunchRowEpilogue(RowMode::kPackKv, p, ctx.stream); }));
  }
  return clock.Finish();
}

Error AttendLayer(const LayerConfig& c, const LayerTensors& t, const KvEntryView& kv, uint8_t* workspace,
                  const CudaContext& ctx, const ChunkGate& gate, SparseReport* report) {
  KVPACK_RETURN_IF_ERROR(Supported(c));
  KVPACK_RETURN_IF_ERROR(CheckTensors(c, t));
  KVPACK_RETURN_IF_ERROR(AttentionSupported(kv));
  if (kv.n_heads != c.shape.n_heads || kv.head_dim != c.shape.head_dim || kv.n_tokens != c.shape.n_tokens) {
    return InvalidArgument("kv: the entry's shape (heads, head_dim, tokens) differs from the layer's");
  }
  if (c.attention.sparse.enabled) return AttendSparse(c, t, kv, workspace, ctx, gate, report);
  const int64_t n = c.shape.n_tokens, hd = c.shape.HeadCols();
  uint8_t* main = workspace + BlasBytes(c);
  BlasGemm gemm(ctx.blas, workspace);
  StageClock clock(ctx);

  uint16_t* q = reinterpret_cast<uint16_t*>(main);  // [Tq, H·d] bf16
  RowEpilogueParams p = QueryRowParams(c, t, kv, q);
  AttentionParams a = BaseAttentionParams(c, kv, q);
  // The kernel for this entry on this GPU (kernel_choice.h), once: an impossible request (wgmma off
  // Hopper, pages too large for the GPU's shared memory) fails here, before any query chunk.
  KVPACK_RETURN_IF_ERROR(ResolveLayerKernel(c, ctx.attention_tiling, &a.tiling, &a.mma));

  // Launches of whole waves where the chunk holds one (the Q buffer is sized for QueryRows).
  int64_t tq = QueryRows(c), wave_rows = 0;
  KVPACK_RETURN_IF_ERROR(AttentionWaveRows(a, &wave_rows));
  if (tq >= wave_rows) tq -= tq % wave_rows;
  for (int64_t q0 = 0; q0 < n; q0 += tq) {
    KVPACK_RETURN_IF_ERROR(PassGate(gate));
    const int64_t rows = std::min(tq, n - q0);
    KVPACK_RETURN_IF_ERROR(ProjectQueries(c, t, q0, rows, q, p, gemm, clock, ctx));
    // In place, rows [q0, q0 + rows) of x are overwritten only now, after every read of them
    // (K/V projection finished before this call; this chunk's Q was projected just above).
    a.q_token_begin = q0, a.n_q = rows;
    a.out = t.out + q0 * hd;
    KVPACK_RETURN_IF_ERROR(clock.Time(&StageTimes::attention_ms, [&] { return LaunchAttention(a, ctx.stream); }));
  }
  return clock.Finish();
}

Error RunLayer(const LayerConfig& c, const LayerTensors& t, uint8_t* kv, uint8_t* workspace, const CudaContext& ctx,
               const ChunkGate& gate, SparseReport* report) {
  KVPACK_RETURN_IF_ERROR(ProjectKv(c, t, kv, workspace, ctx, gate));
  const KvEntryView view = MakeKvView(PlanKvLayout(c.shape, c.ranges), c.shape, kv, c.transforms);
  KVPACK_RETURN_IF_ERROR(AttendLayer(c, t, view, workspace, ctx, gate, report));
  return CudaError(cudaStreamSynchronize(ctx.stream), "layer");
}

}  // namespace kvpack::cuda
