// The real kvpackd on the CUDA backend (label gpu): one layer with inline tensors (staged through the
// pool) and with x and the output in CUDA IPC regions (used in place, nothing staged), each checked
// against the CPU reference and the planner's predicted peak, each on the kernel auto picks and again
// with --attention_kernel=mma_sync (on an H200 that runs the portable kernel, which other GPUs run
// under auto). Skips without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>

#include "tests/server/service/cuda_ipc_region.h"
#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

// GPU vs CPU backend on the same plan: cuBLAS sums the projection in another order, so a few
// bf16-rounded projections and hence codes differ (cuda_layer_test measures 0.001–0.0044).
constexpr double kGpuVsCpuRelL2 = 2e-2;
// Bytes in front of x inside its allocation: a region slice at a non-zero offset, as PyTorch's
// sub-allocations are.
constexpr uint64_t kOffset = 4096;

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

bool IsHopper(const cudaDeviceProp& prop) { return prop.major == 9 && prop.minor == 0; }

// The test's parameter: the daemon's --attention_kernel.
class CudaDaemonTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: the CUDA daemon test runs on a GPU host";
    ASSERT_EQ(cudaGetDeviceProperties(&prop_, 0), cudaSuccess);
    daemon_ = std::make_unique<DaemonProcess>(
        std::vector<std::string>{"--backend=cuda", "--vram_budget=2Gi", "--attention_kernel=" + GetParam()});
    ASSERT_TRUE(daemon_->ok()) << daemon_->why();
    c_ = daemon_->Connect();
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ(s->backend(), "cuda") << "kvpackd fell back to the CPU backend";
    // The kernel that serves: wgmma only under auto on an H100/H200 in a build that holds sm_90a.
    const bool wgmma =
        GetParam() == "auto" && IsHopper(prop_) && s->cuda_archs_built().find("sm_90a") != std::string::npos;
    EXPECT_EQ(s->attention_kernel(), wgmma ? "wgmma" : "mma_sync");
    EXPECT_EQ(s->compute_capability(), "sm_" + std::to_string(prop_.major) + std::to_string(prop_.minor));
    EXPECT_EQ(s->sm_count(), prop_.multiProcessorCount);
    EXPECT_NE(s->cuda_archs_built().find("sm_"), std::string::npos) << s->cuda_archs_built();
    EXPECT_NE(daemon_->Metrics().find("attention_kernel=\"" + s->attention_kernel() + "\""), std::string::npos);
    weights_ = c_->RegisterWeights(WeightsOf(layer_));
    ASSERT_TRUE(weights_.ok()) << weights_.status();
  }

  std::string RegisterIpc(void* allocation, uint64_t bytes) { return RegisterCudaIpcRegion(*c_, allocation, bytes); }

  void ExpectMatchesReference(const std::vector<uint16_t>& out, const v1::LayerResult& r) {
    // The CUDA backend chooses transforms per head as the CPU reference does (head_choice.h).
    absl::StatusOr<std::vector<uint16_t>> ref = client::ReferenceOutput(layer_, r.plan());
    ASSERT_TRUE(ref.ok()) << ref.status();
    const client::Comparison cmp = client::Compare(out, *ref);
    EXPECT_LT(cmp.rel_l2, kGpuVsCpuRelL2) << "max |err| " << cmp.max_abs;
  }

  const client::SyntheticLayer layer_ = client::MakeSyntheticLayer(SmallSpec(11));
  cudaDeviceProp prop_{};
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> c_;
  absl::StatusOr<v1::WeightsResponse> weights_;
};

TEST_P(CudaDaemonTest, InlineTensorsAreStagedThroughThePool) {
  v1::LayerHeader h = layer_.header;
  h.set_weights_handle(weights_->handle());
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> r = c_->AttentionLayer(h, DataOf(layer_, &out));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->plan().io_bytes(), 0u);
  EXPECT_EQ(r->peak_bytes(), r->plan().predicted_peak_bytes());
  ExpectMatchesReference(out, *r);
  EXPECT_EQ(c_->Status()->pool_bytes(), weights_->pool_bytes());
  // The run's own error estimate (the per-head choice's, head_choice.h), as the CPU backend reports
  // it: per format, per range in the range's format, and in /metrics.
  const v1::ErrorEstimate& e = r->estimated_rel_error();
  EXPECT_GT(e.int4(), e.int8());
  EXPECT_GT(e.int8(), e.bf16());
  EXPECT_GT(e.bf16(), 0.0);
  EXPECT_EQ(r->plan().ranges(0).estimated_rel_error(), e.bf16());
  EXPECT_EQ(r->plan().ranges(2).estimated_rel_error(), e.int4());
  EXPECT_EQ(Sample(daemon_->Metrics(), "kvpack_estimated_relative_error_count{format=\"int4\"}"), 1.0);
}

TEST_P(CudaDaemonTest, CudaIpcInputAndOutputAreUsedInPlace) {
  const uint64_t x_bytes = layer_.x.size() * 2, out_bytes = layer_.out_bytes();
  uint8_t* x_alloc = nullptr;
  uint8_t* out_alloc = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&x_alloc), kOffset + x_bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out_alloc), out_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(x_alloc + kOffset, layer_.x.data(), x_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(out_alloc, 0xff, out_bytes), cudaSuccess);  // NaN poison
  const std::string x_region = RegisterIpc(x_alloc, kOffset + x_bytes);
  const std::string out_region = RegisterIpc(out_alloc, out_bytes);

  v1::LayerHeader h = layer_.header;
  h.set_weights_handle(weights_->handle());
  v1::RegionSlice* xs = h.mutable_x()->mutable_region();
  xs->set_region_id(x_region);
  xs->set_offset(kOffset);
  xs->set_size_bytes(x_bytes);
  h.mutable_output()->set_mode(v1::OUTPUT_REGION);
  v1::RegionSlice* os = h.mutable_output()->mutable_region();
  os->set_region_id(out_region);
  os->set_size_bytes(out_bytes);
  client::LayerData data;
  data.positions = layer_.positions.empty() ? nullptr : layer_.positions.data();  // inline, staged
  absl::StatusOr<v1::LayerResult> r = c_->AttentionLayer(h, data);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->plan().io_bytes(), server::PoolBytes(layer_.positions.size() * 4)) << "only positions are staged";
  EXPECT_EQ(r->peak_bytes(), r->plan().predicted_peak_bytes());
  std::vector<uint16_t> out(out_bytes / 2);
  ASSERT_EQ(cudaMemcpy(out.data(), out_alloc, out_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  ExpectMatchesReference(out, *r);

  EXPECT_TRUE(c_->UnregisterRegion(x_region).ok());
  EXPECT_TRUE(c_->UnregisterRegion(out_region).ok());
  EXPECT_EQ(c_->Status()->pool_bytes(), weights_->pool_bytes());
  cudaFree(x_alloc);
  cudaFree(out_alloc);
}

INSTANTIATE_TEST_SUITE_P(AttentionKernel, CudaDaemonTest, ::testing::Values("auto", "mma_sync"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// --attention_kernel=wgmma off Hopper stops the daemon at startup (exit 2) instead of serving on
// another kernel or on the CPU.
TEST(CudaDaemonStartup, WgmmaOffHopperStopsTheStart) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: the CUDA daemon test runs on a GPU host";
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  DaemonProcess d({"--backend=cuda", "--vram_budget=1Gi", "--attention_kernel=wgmma"});
  if (IsHopper(prop)) {  // (the default KVPACK_CUDA_ARCHITECTURES holds sm_90a)
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(d.Connect()->Status()->attention_kernel(), "wgmma");
  } else {
    EXPECT_FALSE(d.ok());
    EXPECT_EQ(d.Stop(), 2);
  }
}

}  // namespace
}  // namespace kvpack::testing
