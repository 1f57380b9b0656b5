// One case of cuda_layer_test (cuda_layer_case.h): the layer on the GPU and on the CPU backend, and the checks.
//
// Per case (fresh seeded structured inputs: channel offsets, 10–40× outlier channels, heavy tails):
//   1. packed pages: the GPU's codes equal the host encoding of the same rows (host GEMM rounded to
//      bf16, the GPU's μ/λ/λ_v) for ≥ kCodeMatchFraction of the values, and decoded values lie within
//      one quantization step of the host's (all but kBeyondOneStepFraction, none beyond kMaxSteps);
//      the step of a BF16 row is one bf16 ulp of the row's largest value;
//   2. statistics: μ_k, μ_v, λ, λ_v match the host's over the same strided sample (with the per-head
//      choice: the CPU backend's chosen tables, and its per-head flags exactly);
//   3. attention: output (poisoned with NaN before the run) vs FP64 attention over the GPU's own
//      decoded pages (tests the attention kernel alone) and vs FP64 unquantized attention (the
//      end-to-end accuracy of the format).
#include "tests/kernels/cuda_layer_case.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/cpu/epilogue.h"
#include "kernels/cpu/layer.h"
#include "kernels/cuda/layer.h"
#include "kernels/format.h"
#include "kernels/rotation.h"

namespace kvpack::cuda {
namespace {

// What a case's layer left on the GPU: the packed block, the output (bf16 bits) and the MMA path run.
struct GpuRun {
  std::vector<uint8_t> block;
  std::vector<uint16_t> out;
  MmaPath mma = MmaPath::kBf16;
};

// Runs the layer of `c` on the GPU (the output poisoned with NaN, 0xffff bf16, before the run).
void RunOnGpu(const Case& c, const HostLayer& L, GpuRun* run) {
  const LayerConfig& cfg = L.config;
  const int64_t n = c.n, hd = static_cast<int64_t>(c.heads) * c.dim;
  DeviceBuffer x(L.x.size() * 2), w(L.w.size() * 2), bias(L.bias.size() * 4), qn(hd * 4), kn(hd * 4),
      pos(L.positions.size() * 4), out(c.in_place ? 1 : n * hd * 2), kv(KvBytes(cfg)), ws(WorkspaceBytes(cfg));
  ASSERT_TRUE(x.ok() && w.ok() && out.ok() && kv.ok() && ws.ok());
  ASSERT_CUDA(cudaMemcpy(x.as<void>(), L.x.data(), L.x.size() * 2, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(w.as<void>(), L.w.data(), L.w.size() * 2, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(bias.as<void>(), L.bias.data(), L.bias.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(qn.as<void>(), L.q_norm.data(), hd * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(kn.as<void>(), L.k_norm.data(), hd * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(pos.as<void>(), L.positions.data(), L.positions.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemset(kv.as<void>(), 0xa5, KvBytes(cfg)));  // garbage the engine must overwrite
  if (!c.in_place) {
    ASSERT_CUDA(cudaMemset(out.as<void>(), 0xff, n * hd * 2));
  }
  LayerTensors t;
  t.x = x.as<uint16_t>();
  t.w_qkv = w.as<uint16_t>();
  t.bias = bias.as<float>();
  t.q_norm_weight = qn.as<float>();
  t.k_norm_weight = kn.as<float>();
  t.positions = cfg.rope.layout != RopeLayout::kNone ? pos.as<float>() : nullptr;
  t.out = c.in_place ? x.as<uint16_t>() : out.as<uint16_t>();

  CudaContext ctx;
  ctx.attention_tiling = c.tiling;
  AttentionTilingChoice kernel;  // what runs on this GPU, and its MMA path
  ASSERT_OK(ResolveLayerKernel(cfg, c.tiling, &kernel, &run->mma));
  ASSERT_CUDA(cudaStreamCreate(&ctx.stream));
  ASSERT_EQ(cublasLtCreate(&ctx.blas), CUBLAS_STATUS_SUCCESS);
  ASSERT_OK(RunLayer(cfg, t, kv.as<uint8_t>(), ws.as<uint8_t>(), ctx, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());

  run->block.resize(KvBytes(cfg));
  run->out.resize(n * hd);
  ASSERT_CUDA(cudaMemcpy(run->block.data(), kv.as<void>(), run->block.size(), cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(run->out.data(), t.out, n * hd * 2, cudaMemcpyDeviceToHost));
  // Digests of the whole block and output: two builds of the kernels that must agree bit for bit
  // (a restructuring) print the same lines (bench/h200.sh compares them).
  std::printf("[%s, tiling %d] digest block %016llx out %016llx\n", c.name, static_cast<int>(c.tiling),
              static_cast<unsigned long long>(Fnv1a64(run->block.data(), run->block.size())),
              static_cast<unsigned long long>(Fnv1a64(run->out.data(), run->out.size() * 2)));
  cublasLtDestroy(ctx.blas);
  cudaStreamDestroy(ctx.stream);
}

// The CPU backend on the same inputs, emulating the MMA path `mma` (the CPU knows no kernels): its
// block and its output.
void RunOnCpu(const Case& c, const HostLayer& L, MmaPath mma, std::vector<uint8_t>* cpu_block,
              std::vector<uint16_t>* cpu_out) {
  const LayerConfig& cfg = L.config;
  const int64_t n = c.n, hd = static_cast<int64_t>(c.heads) * c.dim;
  cpu_block->resize(cpu::KvBytes(cfg));
  std::vector<uint8_t> cpu_ws(cpu::WorkspaceBytes(cfg));
  std::vector<uint16_t> cpu_x = L.x;
  cpu_out->assign(c.in_place ? 0 : n * hd, 0);
  LayerTensors h;
  h.x = cpu_x.data();
  h.w_qkv = L.w.data();
  h.bias = L.bias.data();
  h.q_norm_weight = L.q_norm.data();
  h.k_norm_weight = L.k_norm.data();
  h.positions = cfg.rope.layout != RopeLayout::kNone ? L.positions.data() : nullptr;
  h.out = c.in_place ? cpu_x.data() : cpu_out->data();
  LayerConfig cpu_cfg = cfg;
  cpu_cfg.attention.mma = mma;
  ASSERT_OK(cpu::RunLayer(cpu_cfg, h, cpu_block->data(), cpu_ws.data(), cpu::CpuOptions{}, nullptr));
  if (c.in_place) *cpu_out = cpu_x;
}

// The entry's tables (μ_k, μ_v, λ, λ_v) as the GPU wrote them.
struct Tables {
  const float* mu_k;
  const float* mu_v;
  const float* lambda;
  const float* lambda_v;
};
Tables TablesOf(const std::vector<uint8_t>& block, const KvLayout& layout) {
  return {reinterpret_cast<const float*>(block.data() + layout.mu_k_offset),
          reinterpret_cast<const float*>(block.data() + layout.mu_v_offset),
          reinterpret_cast<const float*>(block.data() + layout.lambda_offset),
          reinterpret_cast<const float*>(block.data() + layout.lambda_v_offset)};
}

// Statistics over the same strided sample; with the choice, the CPU backend's chosen tables and its
// per-head flags.
void CheckStats(const Case& c, const HostLayer& L, const KvLayout& layout, const std::vector<uint8_t>& block,
                const std::vector<uint8_t>& cpu_block) {
  const LayerConfig& cfg = L.config;
  const int64_t hd = static_cast<int64_t>(c.heads) * c.dim;
  const Tables got = TablesOf(block, layout);
  KvStats want = cpu::ComputeStats(L.k.data(), L.v.data(), cfg.shape, cfg.transforms);
  if (c.choose) {
    std::vector<float>* tables[4] = {&want.mu_k, &want.mu_v, &want.lambda, &want.lambda_v};
    const uint64_t offsets[4] = {layout.mu_k_offset, layout.mu_v_offset, layout.lambda_offset, layout.lambda_v_offset};
    for (int i = 0; i < 4; ++i) {
      const float* table = reinterpret_cast<const float*>(cpu_block.data() + offsets[i]);
      tables[i]->assign(table, table + hd);
    }
    const auto* gpu_flags = reinterpret_cast<const uint32_t*>(block.data() + layout.head_flags_offset);
    const auto* cpu_flags = reinterpret_cast<const uint32_t*>(cpu_block.data() + layout.head_flags_offset);
    std::printf("[%s] head flags gpu/cpu:", c.name);
    for (int h = 0; h < c.heads; ++h) std::printf(" h%d %03x/%03x", h, gpu_flags[h], cpu_flags[h]);
    std::printf("\n");
    for (int h = 0; h < c.heads; ++h) EXPECT_EQ(gpu_flags[h], cpu_flags[h]) << "head " << h << " flags";
  }
  double worst_mu = 0, worst_lambda = 0, worst_lambda_v = 0, scale_mu = 1.0, widest_lambda_v = 0;
  for (int64_t col = 0; col < hd; ++col) {
    scale_mu = std::max({scale_mu, std::fabs(double(want.mu_k[col])), std::fabs(double(want.mu_v[col]))});
    worst_mu = std::max({worst_mu, std::fabs(double(got.mu_k[col]) - want.mu_k[col]), std::fabs(double(got.mu_v[col]) - want.mu_v[col])});
    worst_lambda = std::max(worst_lambda, std::fabs(double(got.lambda[col]) - want.lambda[col]) / want.lambda[col]);
    worst_lambda_v = std::max(worst_lambda_v, std::fabs(double(got.lambda_v[col]) - want.lambda_v[col]) / want.lambda_v[col]);
    widest_lambda_v = std::max(widest_lambda_v, double(got.lambda_v[col]));
  }
  std::printf("[%s] stats vs %s: mu %.2e (relative to max |mu|), lambda %.2e, lambda_v %.2e "
              "(largest lambda_v %.2f)\n",
              c.name, c.choose ? "cpu::RunLayer's chosen tables" : "cpu::ComputeStats", worst_mu / scale_mu, worst_lambda, worst_lambda_v, widest_lambda_v);
  EXPECT_LE(worst_mu / scale_mu, kStatsRelTol) << "mu";
  EXPECT_LE(worst_lambda, kStatsRelTol) << "lambda";
  EXPECT_LE(worst_lambda_v, kStatsRelTol) << "lambda_v";
  // The V outlier channels (10–40× weight rows) are balanced: some λ_v well above 1 (or all 1 when
  // off). With the choice a head may keep λ_v = 1; the comparison with the CPU's tables covers it.
  if (!c.choose) {
    if (c.transforms) {
      EXPECT_GT(widest_lambda_v, 2.0);
    } else {
      EXPECT_EQ(widest_lambda_v, 1.0);
    }
  }
}

// The GPU's codes against the CPU backend's block, counted apart: [0] INT4/INT8 codes, [1] BF16 codes
// (kBf16CodeMatchFraction). Since V is divided by λ_v, every BF16 V code also moves with the ~1e-5
// relative difference between the two backends' λ_v (each computes it from its own GEMM), so a mixed
// case's BF16 share would otherwise decide its quantized codes' threshold.
void CheckCodesAgainstTheCpu(const Case& c, const KvLayout& layout, const std::vector<uint8_t>& block,
                             const std::vector<uint8_t>& cpu_block) {
  int64_t values[2] = {0, 0}, same[2] = {0, 0};
  for (size_t off = 0; off < layout.pages.size() * 2 * c.heads; ++off) {
    const size_t which = off / (layout.pages.size() * c.heads), rest = off % (layout.pages.size() * c.heads);
    const PageDesc& page = layout.pages[rest % layout.pages.size()];
    const PageFormat f = static_cast<PageFormat>(page.format);
    const uint64_t o = (which ? layout.v_offsets : layout.k_offsets)[rest];
    const int code_bytes = page.n_valid * CodeBytesPerRow(f, c.dim);
    for (int b = 0; b < code_bytes; ++b) {
      const uint8_t g = block[o + b], w = cpu_block[o + b];
      if (f == PageFormat::kInt4) {
        values[0] += 2, same[0] += ((g ^ w) & 0x0f) == 0, same[0] += ((g ^ w) & 0xf0) == 0;
      } else if (f == PageFormat::kInt8) {
        ++values[0], same[0] += g == w;
      } else if (b % 2 == 1) {
        ++values[1], same[1] += g == w && block[o + b - 1] == cpu_block[o + b - 1];
      }
    }
  }
  const char* kind[2] = {"int4/int8", "bf16"};
  const double threshold[2] = {kCodeMatchFraction, kBf16CodeMatchFraction};
  for (int i = 0; i < 2; ++i) {
    if (values[i] == 0) continue;
    const double frac = double(same[i]) / double(values[i]);
    std::printf("[%s] %s codes identical to cpu::RunLayer's block: %.6f (%lld of %lld)\n", c.name, kind[i], frac,
                static_cast<long long>(same[i]), static_cast<long long>(values[i]));
    EXPECT_GE(frac, threshold[i]) << kind[i];
  }
}

// The GPU's pages against the host encoding of the same rows with the GPU's μ/λ; their decoded values
// into k_hat and v_hat ([n, H·d], rotated space).
void CheckPagesAgainstTheHost(const Case& c, const HostLayer& L, const KvLayout& layout,
                              const std::vector<uint8_t>& block, std::vector<float>* k_hat, std::vector<float>* v_hat) {
  const LayerConfig& cfg = L.config;
  const int64_t n = c.n, hd = static_cast<int64_t>(c.heads) * c.dim;
  const Tables t = TablesOf(block, layout);
  k_hat->assign(n * hd, 0.0f);
  v_hat->assign(n * hd, 0.0f);
  int64_t values = 0, same = 0, beyond_step = 0;
  double worst_steps = 0;
  std::vector<uint8_t> host_page(PageBytes(PageFormat::kBf16, c.dim));
  std::vector<float> row(c.dim), got(c.dim), want(c.dim);
  for (int which = 0; which < 2; ++which) {
    for (int h = 0; h < c.heads; ++h) {
      for (size_t pg = 0; pg < layout.pages.size(); ++pg) {
        const PageDesc& page = layout.pages[pg];
        const PageFormat f = static_cast<PageFormat>(page.format);
        const uint64_t off = (which ? layout.v_offsets : layout.k_offsets)[h * layout.pages.size() + pg];
        const uint8_t* gpu = block.data() + off;
        std::fill(host_page.begin(), host_page.end(), 0);
        for (int slot = 0; slot < page.n_valid; ++slot) {
          const int64_t tok = page.token_begin + slot;
          for (int e = 0; e < c.dim; ++e) {
            const int64_t col = h * c.dim + e;
            row[e] = which ? (L.v[tok * hd + col] - t.mu_v[col]) / t.lambda_v[col]
                           : (L.k[tok * hd + col] - t.mu_k[col]) / t.lambda[col];
          }
          if (c.transforms) RotateForward(row.data(), c.dim, cfg.transforms.seed);
          EncodePageRow(f, row.data(), c.dim, slot, host_page.data());
          DecodePageRow(f, gpu, c.dim, slot, got.data());
          DecodePageRow(f, host_page.data(), c.dim, slot, want.data());
          float step = 0;
          if (f == PageFormat::kBf16) {
            float amax = 0;
            for (int e = 0; e < c.dim; ++e) amax = std::max(amax, std::fabs(want[e]));
            step = amax * (1.0f / 256.0f);
          } else {
            uint16_t s_gpu, s_host;
            std::memcpy(&s_gpu, gpu + MetaOffset(f, c.dim) + slot * MetaBytesPerRow(f), 2);
            std::memcpy(&s_host, host_page.data() + MetaOffset(f, c.dim) + slot * MetaBytesPerRow(f), 2);
            step = std::max(HalfToFloat(s_gpu), HalfToFloat(s_host)) * 1.01f;
          }
          const uint8_t* codes_gpu = gpu + slot * CodeBytesPerRow(f, c.dim);
          const uint8_t* codes_host = host_page.data() + slot * CodeBytesPerRow(f, c.dim);
          for (int e = 0; e < c.dim; ++e) {
            bool eq;
            if (f == PageFormat::kInt4) eq = ((codes_gpu[e / 2] >> (4 * (e & 1))) & 15) == ((codes_host[e / 2] >> (4 * (e & 1))) & 15);
            else if (f == PageFormat::kInt8) eq = codes_gpu[e] == codes_host[e];
            else eq = codes_gpu[2 * e] == codes_host[2 * e] && codes_gpu[2 * e + 1] == codes_host[2 * e + 1];
            const double steps = std::fabs(got[e] - want[e]) / (step + 1e-12);
            same += eq, ++values, beyond_step += steps > 1.0;
            worst_steps = std::max(worst_steps, steps);
            (*(which ? v_hat : k_hat))[tok * hd + h * c.dim + e] = got[e];
          }
        }
      }
    }
  }
  const double frac = double(same) / double(values);
  std::printf("[%s] codes identical to the host encoding: %.6f (%lld of %lld), beyond one step: %lld, worst %.2f steps\n",
              c.name, frac, static_cast<long long>(same), static_cast<long long>(values),
              static_cast<long long>(beyond_step), worst_steps);
  EXPECT_GE(frac, kCodeMatchFraction);
  EXPECT_LE(double(beyond_step) / double(values), kBeyondOneStepFraction);
  EXPECT_LE(worst_steps, kMaxSteps);
}

// The output (no NaN poison left) vs FP64 attention over the GPU's own decoded pages (the attention
// kernel alone), vs the CPU backend's output, and vs FP64 unquantized attention (the format's accuracy).
void CheckAttention(const Case& c, const HostLayer& L, const KvLayout& layout, const GpuRun& run,
                    const std::vector<uint16_t>& cpu_out, const std::vector<float>& k_hat,
                    const std::vector<float>& v_hat, CaseErrors* errors, bool check_exact) {
  const LayerConfig& cfg = L.config;
  const int64_t n = c.n, hd = static_cast<int64_t>(c.heads) * c.dim;
  const Tables t = TablesOf(run.block, layout);
  std::vector<float> got(n * hd);
  int64_t non_finite = 0;
  for (int64_t i = 0; i < n * hd; ++i) {
    got[i] = Bf16ToFloat(run.out[i]);
    non_finite += !std::isfinite(got[i]);
  }
  EXPECT_EQ(non_finite, 0) << "outputs left unwritten (NaN poison) or non-finite";
  const std::vector<int32_t> seq = TokenSeqIds(cfg);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  // (a) over the GPU's own decoded pages: Q as the GPU forms it (bf16 of R·(q⊙λ)).
  std::vector<float> q_hat(n * hd);
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < c.heads; ++h) {
      float* r = &q_hat[(i * c.heads + h) * c.dim];
      for (int e = 0; e < c.dim; ++e) r[e] = L.q[i * hd + h * c.dim + e] * t.lambda[h * c.dim + e];
      if (c.transforms) RotateForward(r, c.dim, cfg.transforms.seed);
      for (int e = 0; e < c.dim; ++e) r[e] = RoundBf16(r[e]);
    }
  }
  std::vector<double> decoded = Attend(q_hat, k_hat, v_hat, seq, c.heads, c.dim, c.causal, scale);
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < c.heads; ++h) {
      std::vector<float> r(c.dim);
      double* o = &decoded[(i * c.heads + h) * c.dim];
      for (int e = 0; e < c.dim; ++e) r[e] = static_cast<float>(o[e]);
      if (c.transforms) RotateInverse(r.data(), c.dim, cfg.transforms.seed);
      for (int e = 0; e < c.dim; ++e) o[e] = static_cast<double>(r[e]) * t.lambda_v[h * c.dim + e] + t.mu_v[h * c.dim + e];
    }
  }
  // (b) unquantized FP64 attention of the host q, k, v.
  const std::vector<double> exact = Attend(L.q, L.k, L.v, seq, c.heads, c.dim, c.causal, scale);
  const double err_decoded = RelL2(got, decoded), err_exact = RelL2(got, exact);
  std::vector<double> cpu_ref(n * hd);
  for (int64_t i = 0; i < n * hd; ++i) cpu_ref[i] = Bf16ToFloat(cpu_out[i]);
  const double err_cpu = RelL2(got, cpu_ref), cpu_exact = RelL2(std::vector<float>(cpu_ref.begin(), cpu_ref.end()), exact);
  std::printf("[%s, tiling %d, mma %s] rel L2 vs FP64 over decoded pages (mma_rel_l2): %.5f (tol %.3f); vs cpu::RunLayer: %.5f (tol %.3f); "
              "vs FP64 unquantized: %.5f (tol %.3f; the CPU backend's: %.5f)\n",
              c.name, static_cast<int>(c.tiling), MmaPathName(run.mma), err_decoded, kDecodedRelL2, err_cpu, kCpuRelL2, err_exact, WorstTolerance(c.ranges), cpu_exact);
  EXPECT_LE(err_cpu, kCpuRelL2);
  EXPECT_LE(err_decoded, kDecodedRelL2);
  if (check_exact) {
    EXPECT_LE(err_exact, WorstTolerance(c.ranges));
  }
  if (errors) *errors = {err_decoded, err_exact};
}

// Whether this GPU and build run the wgmma kernel (kernel_choice.h: sm_90 and a binary with sm_90a).

}  // namespace

void RunCase(const Case& c, CaseErrors* errors, bool check_exact) {
  HostLayer L = MakeLayer(c);
  ASSERT_OK(Supported(L.config));
  const KvLayout layout = PlanKvLayout(L.config.shape, L.config.ranges);
  GpuRun gpu;
  ASSERT_NO_FATAL_FAILURE(RunOnGpu(c, L, &gpu));
  std::vector<uint8_t> cpu_block;
  std::vector<uint16_t> cpu_out;
  ASSERT_NO_FATAL_FAILURE(RunOnCpu(c, L, gpu.mma, &cpu_block, &cpu_out));
  CheckStats(c, L, layout, gpu.block, cpu_block);
  CheckCodesAgainstTheCpu(c, layout, gpu.block, cpu_block);
  std::vector<float> k_hat, v_hat;
  CheckPagesAgainstTheHost(c, L, layout, gpu.block, &k_hat, &v_hat);
  CheckAttention(c, L, layout, gpu, cpu_out, k_hat, v_hat, errors, check_exact);
}

}  // namespace kvpack::cuda
