// The CUDA layer's per-head transform choice (kernels/cuda/head_choice.h) against the CPU layer's, on
// the sink-heavy data of issue 15 (cpu::MakeSyntheticData kSinks: the data of docs/quality.md's
// table, where the fixed transform set falls far below naive INT4). GPU test: skips without a device.
//
// The layer reads the data as pre-projected bf16 q, k, v (LayerConfig::projected), so both backends
// start from the same bf16 rows: the contract held here is that the GPU's per-head flags equal the
// CPU's for every head, its tables match the CPU's to kStatsRelTol (the statistics reduction sums
// in another order: row_epilogue.h), its codes and outputs match the CPU backend's as
// cuda_layer_test requires, and per-head cosines against FP64 attention of the same rows meet the
// named floors below, the choice above the fixed set. Every check prints PASS or FAIL with its figure.
#include "kernels/cuda/head_choice.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/layer.h"
#include "kernels/cpu/pack.h"
#include "kernels/cpu/quality.h"
#include "kernels/cuda/layer.h"
#include "kernels/transform_choice.h"
#include "kernels/transform_select.h"
#include "tests/kernels/cuda_test_layer.h"

namespace kvpack::cuda {
namespace {

// Floors of the per-head cosine vs FP64 on the sink data (N = 2048 self-attention, 8 heads, d = 64,
// outliers 2×). The CPU layer on this very input (projected bf16, bf16 output; both MMA paths
// within 1e-4): INT4 chosen mean 0.99720, worst head 0.99381; fixed set 0.91603 / 0.75380.
// INT8 chosen 0.999986 / 0.999974; fixed set 0.99787 / 0.99205 (docs/quality.md's 256-query table:
// INT4 0.9972 / 0.9951 vs 0.9059 / 0.7402).
inline constexpr double kInt4ChosenMeanCos = 0.995;
inline constexpr double kInt4ChosenWorstCos = 0.99;
inline constexpr double kInt8ChosenMeanCos = 0.9999;
inline constexpr double kInt8ChosenWorstCos = 0.9995;
// The fixed set must show the failure the choice fixes (else the data is not sink-heavy and the
// comparison proves nothing): its mean cosine below this.
inline constexpr double kInt4FixedMeanCosBelow = 0.98;
inline constexpr double kInt8FixedMeanCosBelow = 0.9995;
// The GPU's estimate (head_estimates table) vs the CPU's: the same function on rows that agree and
// tables that agree to kStatsRelTol.
inline constexpr double kEstimateRelTol = 1e-2;

bool Check(const std::string& what, double value, const char* op, double bound) {
  const bool ok = std::string(op) == ">=" ? value >= bound : std::string(op) == "<=" ? value <= bound : value < bound;
  std::printf("  %s %-58s %.6f %s %.6f\n", ok ? "PASS" : "FAIL", what.c_str(), value, op, bound);
  return ok;
}

// Token-major bf16 [N, H, d] rows and their float values.
struct Qkv {
  std::vector<uint16_t> q, k, v;
  std::vector<float> qf, kf, vf;
};

Qkv SinkData(int64_t n, int heads, int dim) {
  cpu::SyntheticOptions o;
  o.n_k = o.n_q = n;
  o.n_heads = heads, o.head_dim = dim;
  o.outlier_scale = 2.0;
  o.seed = 1;
  o.kind = cpu::SyntheticKind::kSinks;
  const cpu::SyntheticData d = cpu::MakeSyntheticData(o);
  Qkv r;
  const auto round = [](const std::vector<float>& in, std::vector<uint16_t>* bits, std::vector<float>* values) {
    bits->resize(in.size()), values->resize(in.size());
    for (size_t i = 0; i < in.size(); ++i) (*bits)[i] = FloatToBf16(in[i]), (*values)[i] = Bf16ToFloat((*bits)[i]);
  };
  round(d.q, &r.q, &r.qf);
  round(d.k, &r.k, &r.kf);
  round(d.v, &r.v, &r.vf);
  return r;
}

LayerConfig SinkConfig(int64_t n, int heads, int dim, PageFormat format, bool choose) {
  LayerConfig c;
  c.shape = {n, heads * dim, heads, dim};
  c.ranges = {{0, n, 0, format}};
  c.has_bias = false;
  c.projected.enabled = true;
  c.projected.token_stride = static_cast<int64_t>(heads) * dim;
  c.projected.head_stride = dim;
  c.projected.batch_tokens = n;
  c.projected.batch_stride = n * heads * dim;
  c.transforms.choose_per_head = choose;
  return c;
}

struct LayerRun {
  std::vector<uint8_t> block;
  std::vector<float> out;
};

void RunOnGpu(const LayerConfig& cfg, const Qkv& in, LayerRun* r) {
  ASSERT_OK(Supported(cfg));
  const int64_t elems = static_cast<int64_t>(in.q.size());
  DeviceBuffer q(elems * 2), k(elems * 2), v(elems * 2), out(elems * 2), kv(KvBytes(cfg)), ws(WorkspaceBytes(cfg));
  ASSERT_TRUE(q.ok() && k.ok() && v.ok() && out.ok() && kv.ok() && ws.ok());
  ASSERT_CUDA(cudaMemcpy(q.as<void>(), in.q.data(), elems * 2, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(k.as<void>(), in.k.data(), elems * 2, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(v.as<void>(), in.v.data(), elems * 2, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemset(kv.as<void>(), 0xa5, KvBytes(cfg)));  // garbage the engine must overwrite
  ASSERT_CUDA(cudaMemset(out.as<void>(), 0xff, elems * 2));     // NaN poison
  LayerTensors t;
  t.q = q.as<uint16_t>(), t.k = k.as<uint16_t>(), t.v = v.as<uint16_t>(), t.out = out.as<uint16_t>();
  CudaContext ctx;
  ASSERT_CUDA(cudaStreamCreate(&ctx.stream));
  ASSERT_EQ(cublasLtCreate(&ctx.blas), CUBLAS_STATUS_SUCCESS);
  ASSERT_OK(RunLayer(cfg, t, kv.as<uint8_t>(), ws.as<uint8_t>(), ctx, nullptr));
  r->block.resize(KvBytes(cfg));
  std::vector<uint16_t> bits(elems);
  ASSERT_CUDA(cudaMemcpy(r->block.data(), kv.as<void>(), r->block.size(), cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(bits.data(), out.as<void>(), elems * 2, cudaMemcpyDeviceToHost));
  cublasLtDestroy(ctx.blas);
  cudaStreamDestroy(ctx.stream);
  r->out.resize(elems);
  for (int64_t i = 0; i < elems; ++i) r->out[i] = Bf16ToFloat(bits[i]);
}

// The CPU backend on the same rows, emulating the MMA path this GPU runs (cuda_layer_test does the same).
void RunOnCpu(const LayerConfig& cfg, const Qkv& in, LayerRun* r) {
  AttentionTilingChoice tiling;
  LayerConfig c = cfg;
  ASSERT_OK(ResolveLayerKernel(cfg, AttentionTilingChoice::kAuto, &tiling, &c.attention.mma));
  r->block.resize(cpu::KvBytes(c));
  std::vector<uint8_t> ws(cpu::WorkspaceBytes(c));
  std::vector<uint16_t> bits(in.q.size());
  LayerTensors t;
  t.q = in.q.data(), t.k = in.k.data(), t.v = in.v.data(), t.out = bits.data();
  ASSERT_OK(cpu::RunLayer(c, t, r->block.data(), ws.data(), cpu::CpuOptions{}, nullptr));
  r->out.resize(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) r->out[i] = Bf16ToFloat(bits[i]);
}

struct Floors {
  double chosen_mean, chosen_worst, fixed_mean_below;
};

// mma kBf16: the choice may also keep q·k plain (format v3), which the INT8 MMA path (auto here) forbids.
void RunSinkCase(PageFormat format, const Floors& floors, MmaPath mma = MmaPath::kAuto) {
  constexpr int64_t kTokens = 2048;
  constexpr int kHeads = 8, kDim = 64;
  const std::string name = std::string("sinks ") + (format == PageFormat::kInt4 ? "int4" : "int8") +
                           (mma == MmaPath::kBf16 ? " bf16-mma" : "") + " N=2048 H=8 d=64";
  const Qkv in = SinkData(kTokens, kHeads, kDim);
  LayerConfig chosen_cfg = SinkConfig(kTokens, kHeads, kDim, format, true);
  LayerConfig fixed_cfg = SinkConfig(kTokens, kHeads, kDim, format, false);
  chosen_cfg.attention.mma = fixed_cfg.attention.mma = mma;
  ASSERT_TRUE(ChoosesPerHead(chosen_cfg));
  LayerRun gpu, cpu_run, gpu_fixed;
  RunOnGpu(chosen_cfg, in, &gpu);
  RunOnCpu(chosen_cfg, in, &cpu_run);
  RunOnGpu(fixed_cfg, in, &gpu_fixed);
  if (::testing::Test::HasFatalFailure()) return;
  const KvLayout layout = PlanKvLayout(chosen_cfg.shape, chosen_cfg.ranges);
  const int64_t hd = chosen_cfg.shape.HeadCols();
  bool ok = true;
  std::printf("[%s] digest block %016llx out %016llx\n", name.c_str(),
              static_cast<unsigned long long>(Fnv1a64(gpu.block.data(), gpu.block.size())),
              static_cast<unsigned long long>(Fnv1a64(gpu.out.data(), gpu.out.size() * 4)));

  // ── Head flags: equal for every head ──────────────────────────────────────────────────────────
  const auto* g_flags = reinterpret_cast<const uint32_t*>(gpu.block.data() + layout.head_flags_offset);
  const auto* c_flags = reinterpret_cast<const uint32_t*>(cpu_run.block.data() + layout.head_flags_offset);
  int same_flags = 0;
  std::printf("[%s] head flags gpu/cpu:", name.c_str());
  for (int h = 0; h < kHeads; ++h) {
    same_flags += g_flags[h] == c_flags[h];
    std::printf(" h%d %03x/%03x", h, g_flags[h], c_flags[h]);
    EXPECT_TRUE(g_flags[h] & kHeadChosen) << "head " << h;
  }
  std::printf("\n");
  ok &= Check("heads whose flags equal the CPU's", same_flags, ">=", kHeads);
  int plain_k = 0, plain_v = 0;  // heads stored without R (format v3): the paths this case exercises
  for (int h = 0; h < kHeads; ++h) plain_k += (g_flags[h] & kHeadPlainK) != 0, plain_v += (g_flags[h] & kHeadPlainV) != 0;
  std::printf("[%s] heads with plain q·k: %d, plain V: %d\n", name.c_str(), plain_k, plain_v);
  if (ConfigMmaPath(chosen_cfg) == MmaPath::kInt8) ok &= Check("heads with plain q·k on the INT8 MMA path", plain_k, "<=", 0);

  // ── Tables and estimates ──────────────────────────────────────────────────────────────────────
  int64_t same_values = 0;
  double worst_rel = 0.0;
  for (uint64_t off : {layout.mu_k_offset, layout.mu_v_offset, layout.lambda_offset, layout.lambda_v_offset}) {
    const float* g = reinterpret_cast<const float*>(gpu.block.data() + off);
    const float* w = reinterpret_cast<const float*>(cpu_run.block.data() + off);
    double scale = 1e-30;
    for (int64_t i = 0; i < hd; ++i) scale = std::max(scale, std::fabs(double(w[i])));
    for (int64_t i = 0; i < hd; ++i) {
      same_values += g[i] == w[i];
      worst_rel = std::max(worst_rel, std::fabs(double(g[i]) - w[i]) / scale);
    }
  }
  std::printf("[%s] tables (mu_k, mu_v, lambda, lambda_v) bit-identical to the CPU's: %lld of %lld\n", name.c_str(),
              static_cast<long long>(same_values), static_cast<long long>(4 * hd));
  ok &= Check("tables: largest difference / table's max |value|", worst_rel, "<=", kStatsRelTol);
  const auto* g_est = reinterpret_cast<const float*>(gpu.block.data() + layout.head_estimates_offset);
  const auto* c_est = reinterpret_cast<const float*>(cpu_run.block.data() + layout.head_estimates_offset);
  const double g_rel = EstimatedRelError(g_est, kHeads, format), c_rel = EstimatedRelError(c_est, kHeads, format);
  std::printf("[%s] estimated rel L2: gpu %.5f cpu %.5f\n", name.c_str(), g_rel, c_rel);
  ok &= Check("estimate > 0 (the record was written)", g_rel, ">=", 1e-6);
  ok &= Check("estimate: |gpu − cpu| / cpu", std::fabs(g_rel - c_rel) / std::max(c_rel, 1e-30), "<=", kEstimateRelTol);

  // ── Codes and outputs vs the CPU backend ──────────────────────────────────────────────────────
  int64_t values = 0, same = 0;
  for (size_t i = 0; i < layout.pages.size() * kHeads * 2; ++i) {
    const size_t pages = layout.pages.size() * kHeads;
    const PageDesc& page = layout.pages[(i % pages) % layout.pages.size()];
    const uint64_t o = (i < pages ? layout.k_offsets : layout.v_offsets)[i % pages];
    const int bytes = page.n_valid * CodeBytesPerRow(format, kDim);
    for (int b = 0; b < bytes; ++b) {
      const uint8_t g = gpu.block[o + b], w = cpu_run.block[o + b];
      if (format == PageFormat::kInt4) {
        values += 2, same += ((g ^ w) & 0x0f) == 0, same += ((g ^ w) & 0xf0) == 0;
      } else {
        ++values, same += g == w;
      }
    }
  }
  ok &= Check("codes identical to the CPU backend's (fraction)", double(same) / double(values), ">=",
              kCodeMatchFraction);
  std::vector<double> cpu_out(cpu_run.out.begin(), cpu_run.out.end());
  int64_t non_finite = 0;
  for (float x : gpu.out) non_finite += !std::isfinite(x);
  ok &= Check("non-finite outputs (NaN poison left)", double(non_finite), "<=", 0.0);
  ok &= Check("rel L2 vs the CPU backend's output", RelL2(gpu.out, cpu_out), "<=", kCpuRelL2);

  // ── Per-head cosine vs FP64 attention of the same bf16 rows ───────────────────────────────────
  std::vector<double> reference(in.qf.size());
  cpu::QueryBlock queries;
  queries.q = in.qf.data(), queries.n_q = kTokens;
  cpu::ReferenceAttention(queries, in.kf.data(), in.vf.data(), nullptr, kTokens, kHeads, kDim, AttentionOptions{},
                          reference.data());
  const cpu::QualityResult g = cpu::CompareOutputs(reference.data(), gpu.out.data(), kTokens, kHeads, kDim);
  const cpu::QualityResult c = cpu::CompareOutputs(reference.data(), cpu_run.out.data(), kTokens, kHeads, kDim);
  const cpu::QualityResult f = cpu::CompareOutputs(reference.data(), gpu_fixed.out.data(), kTokens, kHeads, kDim);
  std::printf("[%s] cosine vs FP64, mean (worst head): gpu chosen %.6f (%.6f, h%d), cpu chosen %.6f (%.6f), "
              "gpu fixed set %.6f (%.6f, h%d); rel L2 gpu chosen %.5f, fixed %.5f\n",
              name.c_str(), g.cosine, g.worst_head_cosine, g.worst_head, c.cosine, c.worst_head_cosine, f.cosine,
              f.worst_head_cosine, f.worst_head, g.rel_l2, f.rel_l2);
  ok &= Check("gpu chosen: mean cosine", g.cosine, ">=", floors.chosen_mean);
  ok &= Check("gpu chosen: worst head's cosine", g.worst_head_cosine, ">=", floors.chosen_worst);
  ok &= Check("gpu fixed set: mean cosine (the failure the choice fixes)", f.cosine, "<", floors.fixed_mean_below);
  ok &= Check("gpu chosen worst head − fixed set worst head", g.worst_head_cosine - f.worst_head_cosine, ">=", 0.0);
  std::printf("[%s] %s\n", name.c_str(), ok ? "PASS" : "FAIL");
  EXPECT_TRUE(ok) << "a check above printed FAIL";
}

TEST(CudaHeadChoice, SinkHeadsInt4ChooseAsTheCpu) {
  SKIP_WITHOUT_GPU();
  RunSinkCase(PageFormat::kInt4, {kInt4ChosenMeanCos, kInt4ChosenWorstCos, kInt4FixedMeanCosBelow});
}

TEST(CudaHeadChoice, SinkHeadsInt8ChooseAsTheCpu) {
  SKIP_WITHOUT_GPU();
  RunSinkCase(PageFormat::kInt8, {kInt8ChosenMeanCos, kInt8ChosenWorstCos, kInt8FixedMeanCosBelow});
}

TEST(CudaHeadChoice, SinkHeadsInt4Bf16MmaChooseAsTheCpu) {
  SKIP_WITHOUT_GPU();
  RunSinkCase(PageFormat::kInt4, {kInt4ChosenMeanCos, kInt4ChosenWorstCos, kInt4FixedMeanCosBelow}, MmaPath::kBf16);
}

// The estimate's rows as the device lays them out (head_choice.h steps 1–3) from the float rows of
// `in`: keys [n_k, 2·H·d] (K | V), queries [n_q, H·d], and each key's range format.
struct EstimateRows {
  std::vector<float> keys, queries;
  std::vector<uint8_t> formats;
};
EstimateRows GatherEstimateRows(const Qkv& in, const LayerConfig& cfg, const EstimateSampleRows& rows) {
  const int64_t hd = cfg.shape.HeadCols(), n = cfg.shape.n_tokens;
  EstimateRows r;
  r.keys.resize(rows.key_index.size() * 2 * hd);
  r.queries.resize(rows.query_token.size() * hd);
  r.formats.resize(rows.key_index.size());
  const cpu::TokenPageMap ranges(cfg.ranges);
  for (size_t j = 0; j < rows.key_index.size(); ++j) {
    const int64_t token = cpu::StatsSampleToken(rows.key_index[j], n, rows.n_sample);
    std::copy(&in.kf[token * hd], &in.kf[token * hd] + hd, &r.keys[j * 2 * hd]);
    std::copy(&in.vf[token * hd], &in.vf[token * hd] + hd, &r.keys[j * 2 * hd + hd]);
    r.formats[j] = static_cast<uint8_t>(cfg.ranges[ranges.RangeOf(token)].format);
  }
  for (size_t i = 0; i < rows.query_token.size(); ++i) {
    std::copy(&in.qf[rows.query_token[i] * hd], &in.qf[rows.query_token[i] * hd] + hd, &r.queries[i * hd]);
  }
  return r;
}

// The host half of the GPU's choice (ChooseFromEstimateSample, no device) fed the CPU layer's own
// rows — picked by PlanEstimateSample, laid out as the device copies them — records exactly what the
// CPU layer records: flags, estimates and chosen tables bit for bit. Two ranges of two formats, so
// each key's format is looked up too.
TEST(CudaHeadChoice, HostHalfOnTheCpuRowsIsTheCpuLayersChoice) {
  constexpr int64_t kTokens = 2048;
  constexpr int kHeads = 8, kDim = 64;
  const Qkv in = SinkData(kTokens, kHeads, kDim);
  LayerConfig cfg = SinkConfig(kTokens, kHeads, kDim, PageFormat::kInt4, true);
  cfg.ranges = {{0, 1000, 0, PageFormat::kInt4}, {1000, kTokens, 0, PageFormat::kInt8}};
  std::vector<uint8_t> block(cpu::KvBytes(cfg)), ws(cpu::WorkspaceBytes(cfg));
  std::vector<uint16_t> out(in.q.size());
  LayerTensors t;
  t.q = in.q.data(), t.k = in.k.data(), t.v = in.v.data(), t.out = out.data();
  ASSERT_OK(cpu::RunLayer(cfg, t, block.data(), ws.data(), cpu::CpuOptions{}, nullptr));

  const EstimateSampleRows rows = PlanEstimateSample(cfg);
  ASSERT_EQ(rows.n_sample, 1024);
  ASSERT_EQ(rows.key_index.size(), 512u);
  ASSERT_EQ(rows.query_token.size(), 32u);
  const int64_t hd = cfg.shape.HeadCols();
  const EstimateRows sample = GatherEstimateRows(in, cfg, rows);
  const std::vector<float>& keys = sample.keys;
  const std::vector<float>& queries = sample.queries;
  KvStats stats = cpu::ComputeStats(in.kf.data(), in.vf.data(), cfg.shape, cfg.transforms);
  const cpu::TransformRecord record = ChooseFromEstimateSample(cfg, rows, keys.data(), queries.data(), &stats);

  const KvLayout layout = PlanKvLayout(cfg.shape, cfg.ranges);
  EXPECT_EQ(0, std::memcmp(record.head_flags.data(), block.data() + layout.head_flags_offset, kHeads * 4));
  EXPECT_EQ(0, std::memcmp(record.head_estimates.data(), block.data() + layout.head_estimates_offset,
                           record.head_estimates.size() * 4));
  const std::vector<float>* tables[4] = {&stats.mu_k, &stats.mu_v, &stats.lambda, &stats.lambda_v};
  const uint64_t offsets[4] = {layout.mu_k_offset, layout.mu_v_offset, layout.lambda_offset, layout.lambda_v_offset};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(0, std::memcmp(tables[i]->data(), block.data() + offsets[i], hd * 4)) << i;
  int chosen_differently = 0;  // the sink heads must not keep the options' full set (flags 0x1b)
  for (int h = 0; h < kHeads; ++h) chosen_differently += (record.head_flags[h] & 0xff) != FixedHeadFlags(cfg.transforms);
  EXPECT_GE(chosen_differently, kHeads / 2);
}

// The device decision (head_estimate.cu, LaunchHeadEstimate) on the very rows the host half gets:
// flags, estimates and chosen tables equal to ChooseFromEstimateSample's bit for bit. At d = 64 over
// two ranges of two formats (each key's own format looked up), and at d = 128 with 56 heads (H3's
// head count: the figure printed is the kernel's time for a whole layer's choice).
void RunDeviceEstimateCase(int heads, int dim, bool two_formats) {
  constexpr int64_t kTokens = 2048;
  const Qkv in = SinkData(kTokens, heads, dim);
  LayerConfig cfg = SinkConfig(kTokens, heads, dim, PageFormat::kInt4, true);
  if (two_formats) cfg.ranges = {{0, 1000, 0, PageFormat::kInt4}, {1000, kTokens, 0, PageFormat::kInt8}};
  const EstimateSampleRows rows = PlanEstimateSample(cfg);
  const int64_t hd = cfg.shape.HeadCols();
  const EstimateRows sample = GatherEstimateRows(in, cfg, rows);
  const std::vector<float>& keys = sample.keys;
  const std::vector<float>& queries = sample.queries;
  const std::vector<uint8_t>& formats = sample.formats;
  const KvStats full = cpu::ComputeStats(in.kf.data(), in.vf.data(), cfg.shape, cfg.transforms);
  KvStats host_stats = full;
  const cpu::TransformRecord host = ChooseFromEstimateSample(cfg, rows, keys.data(), queries.data(), &host_stats);

  const KvLayout layout = PlanKvLayout(cfg.shape, cfg.ranges);
  std::vector<uint8_t> block(layout.total_bytes, 0);
  const std::vector<float>* tables[4] = {&full.mu_k, &full.mu_v, &full.lambda, &full.lambda_v};
  const std::vector<float>* chosen[4] = {&host_stats.mu_k, &host_stats.mu_v, &host_stats.lambda, &host_stats.lambda_v};
  const uint64_t offsets[4] = {layout.mu_k_offset, layout.mu_v_offset, layout.lambda_offset, layout.lambda_v_offset};
  for (int i = 0; i < 4; ++i) std::memcpy(block.data() + offsets[i], tables[i]->data(), hd * 4);
  const int n_q = static_cast<int>(queries.size() / hd), n_k = static_cast<int>(formats.size());
  DeviceBuffer d_keys(keys.size() * 4), d_queries(queries.size() * 4), d_formats(formats.size()),
      d_kv(block.size()), d_scratch(heads * HeadEstimateBytes(n_q, n_k, dim));
  ASSERT_CUDA(cudaMemcpy(d_keys.as<void>(), keys.data(), keys.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_queries.as<void>(), queries.data(), queries.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_formats.as<void>(), formats.data(), formats.size(), cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_kv.as<void>(), block.data(), block.size(), cudaMemcpyHostToDevice));
  HeadEstimateArgs a;
  a.queries = d_queries.as<float>(), a.q_stride = hd;
  a.keys = d_keys.as<float>(), a.kv_stride = 2 * hd;
  a.formats = d_formats.as<uint8_t>();
  a.n_q = n_q, a.n_k = n_k, a.d = dim;
  a.scale = EstimateSoftmaxScale(cfg.attention.softmax_scale, dim);
  a.rotate = cfg.transforms.rotate, a.seed = cfg.transforms.seed, a.transforms = ChoiceTransforms(cfg);  // as the layer passes them (head_choice.cc)
  a.kv = d_kv.as<uint8_t>();
  a.mu_k_offset = layout.mu_k_offset, a.mu_v_offset = layout.mu_v_offset;
  a.lambda_offset = layout.lambda_offset, a.lambda_v_offset = layout.lambda_v_offset;
  a.head_flags_offset = layout.head_flags_offset, a.head_estimates_offset = layout.head_estimates_offset;
  a.scratch = d_scratch.as<uint8_t>();
  cudaEvent_t start, stop;
  ASSERT_CUDA(cudaEventCreate(&start));
  ASSERT_CUDA(cudaEventCreate(&stop));
  ASSERT_CUDA(cudaEventRecord(start));
  ASSERT_OK(LaunchHeadEstimate(a, heads, nullptr));
  ASSERT_CUDA(cudaEventRecord(stop));
  ASSERT_CUDA(cudaEventSynchronize(stop));
  float ms = 0.0f;
  ASSERT_CUDA(cudaEventElapsedTime(&ms, start, stop));
  ASSERT_CUDA(cudaMemcpy(block.data(), d_kv.as<void>(), block.size(), cudaMemcpyDeviceToHost));

  int flags_equal = 0, estimates_equal = 0, tables_equal = 0;
  for (int h = 0; h < heads; ++h) {
    flags_equal += std::memcmp(&host.head_flags[h], block.data() + layout.head_flags_offset + h * 4, 4) == 0;
    estimates_equal += std::memcmp(&host.head_estimates[h * kHeadEstimateFields],
                                   block.data() + layout.head_estimates_offset + h * kHeadEstimateFields * 4,
                                   kHeadEstimateFields * 4) == 0;
    int rows_equal = 0;
    for (int i = 0; i < 4; ++i) {
      rows_equal += std::memcmp(chosen[i]->data() + h * dim, block.data() + offsets[i] + h * dim * 4, dim * 4) == 0;
    }
    tables_equal += rows_equal == 4;
  }
  std::printf("[device estimate H=%d d=%d %s] kernel %.3f ms for the layer's heads\n", heads, dim,
              two_formats ? "int4+int8" : "int4", ms);
  bool ok = Check("heads whose flags equal the host's", flags_equal, ">=", heads);
  ok &= Check("heads whose estimates equal the host's bit for bit", estimates_equal, ">=", heads);
  ok &= Check("heads whose chosen table rows equal the host's bit for bit", tables_equal, ">=", heads);
  EXPECT_TRUE(ok) << "a check above printed FAIL";
}

TEST(CudaHeadChoice, DeviceEstimateIsTheHostsBitForBitTwoFormats) {
  SKIP_WITHOUT_GPU();
  RunDeviceEstimateCase(8, 64, true);
}

TEST(CudaHeadChoice, DeviceEstimateIsTheHostsBitForBitD128FiftySixHeads) {
  SKIP_WITHOUT_GPU();
  RunDeviceEstimateCase(56, 128, false);
}

// What needs no GPU: when the layer chooses, and that the choice's sample has room in the workspace.
TEST(CudaHeadChoice, ChoiceNeedsOptionsAndScratch) {
  LayerConfig c = SinkConfig(5000, 4, 128, PageFormat::kInt4, true);
  EXPECT_TRUE(ChoosesPerHead(c));
  // Keys 512 × 2·H·d floats and queries 32 × H·d floats, at least; beside the pre-pass's float K | V
  // of its S = 1024 (stats_sample_tokens) tokens.
  EXPECT_GE(ChoiceScratchBytes(c), (512ull * 2 + 32) * 4 * 128 * 4);
  EXPECT_GE(WorkspaceBytes(c), ChoiceScratchBytes(c) + 1024ull * 2 * 4 * 128 * 4);
  c.transforms.choose_per_head = false;
  EXPECT_FALSE(ChoosesPerHead(c));
  EXPECT_EQ(ChoiceScratchBytes(c), 0u);
  c.transforms.choose_per_head = true;
  c.transforms.smooth = c.transforms.balance = false;  // nothing to choose: the CPU layer keeps the set too
  EXPECT_FALSE(ChoosesPerHead(c));
  c.transforms.smooth = true;
  KvStats given;
  c.stats = &given;  // the caller's tables are kept as given
  EXPECT_FALSE(ChoosesPerHead(c));
}

}  // namespace
}  // namespace kvpack::cuda
