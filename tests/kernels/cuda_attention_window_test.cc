// kvpack::cuda attention over an entry longer than one visibility window, against the CPU reference
// over the same packed entry. GPU tests skip with a message when no CUDA device answers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/epilogue.h"
#include "kernels/cpu/layer.h"
#include "kernels/cuda/attention.h"
#include "kernels/format.h"
#include "kernels/layer_spec.h"
#include "tests/kernels/cpu_test_layer.h"
#include "tests/kernels/cuda_test_layer.h"

namespace kvpack::cuda {
namespace {

// An entry past one visibility window (the wgmma kernel examines 3072 pages per pass, the portable one
// 2048): 3100 pages, whose rows from the wgmma kernel's second window on come from x rows ×4, so that for
// most of the queries (the last 128 tokens, in that region too) the second window's first page raises
// the row maximum over the 196,608 keys before it (165 of the 256 (query, head) rows, by q·k from x and
// W in double, checked when the test was written), and the O carried over from the first window must be
// rescaled there (the deep ring did not before session 12). GPU attention against the CPU's over the
// same entry, packed by the CPU, for each kernel the GPU runs. (Written when no GPU was lent: its
// first run on the H200 is the next session's; its CPU half takes 19 s on two cores.)
TEST(CudaAttentionWindow, EntryPastOneWindowMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  constexpr int kPages = 3100, kSecondWindow = 3072, kQueries = 128, kHeads = 2, kDim = 64, kHidden = 64;
  constexpr int64_t n = int64_t{kPages} * kPageTokens, hd = kHeads * kDim;
  cpu::testing::TestLayer L = cpu::testing::MakeTestLayer(n, kHidden, kHeads, kDim, 31, PageFormat::kInt4);
  for (int64_t t = int64_t{kSecondWindow} * kPageTokens; t < n; ++t) {
    for (int c = 0; c < kHidden; ++c) L.x[t * kHidden + c] = FloatToBf16(4.0f * Bf16ToFloat(L.x[t * kHidden + c]));
  }
  const LayerConfig& cfg = L.config;
  std::vector<uint8_t> kv_host(cpu::KvBytes(cfg)), ws_host(cpu::WorkspaceBytes(cfg));
  ASSERT_OK(cpu::ProjectKv(cfg, L.Tensors(), kv_host.data(), ws_host.data(), cpu::CpuOptions{}, nullptr));
  const KvLayout layout = PlanKvLayout(cfg.shape, cfg.ranges);
  const KvEntryView host = MakeKvView(layout, cfg.shape, kv_host.data(), cfg.transforms);
  ASSERT_EQ(host.n_pages, kPages);

  // The queries' stored rows (bf16), from x and W in double, as the layer's Q epilogue makes them.
  cpu::testing::TestLayer tail = L;
  tail.config.shape.n_tokens = kQueries;
  tail.x.assign(L.x.end() - kQueries * kHidden, L.x.end());
  std::vector<float> q, k, v;
  cpu::testing::DirectQkv(tail, &q, &k, &v);
  std::vector<uint16_t> q_ws(kQueries * hd);
  std::vector<float> q_head(static_cast<size_t>(kHeads) * kQueries * kDim);  // [H, kQueries, d], bf16-valued
  for (int t = 0; t < kQueries; ++t) {
    for (int h = 0; h < kHeads; ++h) {
      float* row = q.data() + t * hd + h * kDim;
      cpu::ToStoredQ(row, kDim, host.lambda + h * kDim, host.rotate, host.seed);
      for (int c = 0; c < kDim; ++c) {
        q_ws[t * hd + h * kDim + c] = FloatToBf16(row[c]);
        q_head[(static_cast<size_t>(h) * kQueries + t) * kDim + c] = Bf16ToFloat(q_ws[t * hd + h * kDim + c]);
      }
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  std::vector<float> cpu_out(static_cast<size_t>(kQueries) * hd);
  std::vector<int32_t> seq(kQueries, 0);
  std::vector<int64_t> pos(kQueries);
  for (int t = 0; t < kQueries; ++t) pos[t] = n - kQueries + t;
  for (int h = 0; h < kHeads; ++h) {
    float o[cpu::kQueryTile * kDim];
    for (int i0 = 0; i0 < kQueries; i0 += cpu::kQueryTile) {
      const int count = std::min(cpu::kQueryTile, kQueries - i0);
      const float* qh = q_head.data() + (static_cast<size_t>(h) * kQueries + i0) * kDim;
      cpu::AttendTile(host, h, cpu::QueryTile{qh, seq.data() + i0, pos.data() + i0, count}, false, scale, MmaPath::kBf16, o);
      for (int i = 0; i < count; ++i) std::copy(o + i * kDim, o + (i + 1) * kDim, cpu_out.begin() + (i0 + i) * hd + h * kDim);
    }
  }

  DeviceBuffer d_kv(kv_host.size()), d_q(q_ws.size() * 2), d_out(q_ws.size() * 2);
  ASSERT_TRUE(d_kv.ok() && d_q.ok() && d_out.ok());
  ASSERT_CUDA(cudaMemcpy(d_kv.as<void>(), kv_host.data(), kv_host.size(), cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_q.as<void>(), q_ws.data(), q_ws.size() * 2, cudaMemcpyHostToDevice));
  std::vector<AttentionTilingChoice> tilings = {AttentionTilingChoice::kMmaSync};
  AttentionTilingChoice resolved;
  if (ResolveAttentionTiling(kDim, PageBytes(PageFormat::kInt4, kDim), AttentionTilingChoice::kWgmma, &resolved).ok()) {
    tilings.push_back(AttentionTilingChoice::kWgmma);
  }
  for (AttentionTilingChoice tiling : tilings) {
    AttentionParams a;
    a.q = d_q.as<uint16_t>(), a.q_stride = hd, a.q_token_begin = n - kQueries, a.n_q = kQueries;
    a.out = d_out.as<uint16_t>(), a.out_stride = hd;
    a.kv = MakeKvView(layout, cfg.shape, d_kv.as<uint8_t>(), cfg.transforms);
    a.softmax_scale = scale;
    a.max_page_bytes = PageBytes(PageFormat::kInt4, kDim);
    a.tiling = tiling;
    a.mma = MmaPath::kBf16;
    ASSERT_CUDA(cudaMemset(d_out.as<void>(), 0xff, q_ws.size() * 2));
    ASSERT_OK(LaunchAttention(a, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> gpu_out(q_ws.size());
    ASSERT_CUDA(cudaMemcpy(gpu_out.data(), d_out.as<void>(), gpu_out.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<float> got(gpu_out.size());
    for (size_t i = 0; i < got.size(); ++i) got[i] = Bf16ToFloat(gpu_out[i]);
    const double rel = RelL2(got, std::vector<double>(cpu_out.begin(), cpu_out.end()));
    std::printf("[%d pages, %d queries, %s] vs the CPU over the same entry: rel L2 %.5f (tol %.3f)\n", kPages, kQueries,
                tiling == AttentionTilingChoice::kWgmma ? "wgmma" : "mma.sync", rel, kCpuRelL2);
    EXPECT_LE(rel, kCpuRelL2);  // NaN fails too
  }
}

}  // namespace
}  // namespace kvpack::cuda
