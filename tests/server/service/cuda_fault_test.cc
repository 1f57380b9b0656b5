// GPU faults against the real kvpackd on the CUDA backend (label gpu; skips without a device):
//   VmmExhaustion  another process (this test) takes the GPU's free memory, so the daemon's VMM arena
//                  cannot map the chunks a layer needs: RESOURCE_EXHAUSTED, the pool back to the
//                  weights, health SERVING, and once the memory is back the same call runs.
//   InjectedVmmMap kvpackd --fault_every=vmm_map:N: every N-th allocation of the CUDA arena fails, at
//                  whatever stage of a call it falls on (K/V block, workspace, staging): each call
//                  ends OK (output checked) or RESOURCE_EXHAUSTED, and after each the pool is back
//                  at the weights and the daemon SERVING.
//   FreedIpc*      a CUDA IPC region whose allocation its owner freed (cudaFree in this process)
//                  after registering it, and a handle freed before RegisterRegion: a code of the
//                  documented set, never a crash, INTERNAL or NOT_SERVING; the daemon keeps serving.
// Every case prints one line "[cuda_fault] <case>: ... -> PASS|FAIL" with what it saw.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tests/server/service/cuda_ipc_region.h"
#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

// GPU vs CPU backend on the same plan (cuda_daemon_test.cc: cuBLAS sums in another order).
constexpr double kGpuVsCpuRelL2 = 2e-2;
// The test's hold on device memory: large pieces first, then the 2 MiB of the daemon's VMM chunks,
// until cudaMalloc refuses; what is left is less than one chunk.
constexpr size_t kHogPieceBytes = 256ull << 20;
constexpr size_t kHogChunkBytes = 2ull << 20;

// N = 2048, D = 512, H = 4, d = 128 in three ranges (BF16, INT8, INT4): the layer's K/V block,
// workspace and staged x and output need several of the arena's 2 MiB chunks beyond the weights'.
client::SyntheticSpec MediumSpec() {
  client::SyntheticSpec s;
  s.n_tokens = 2048;
  s.hidden = 512;
  s.n_heads = 4;
  s.head_dim = 128;
  s.ranges = {{701, 0, {v1::FORMAT_BF16}}, {999, 0, {v1::FORMAT_INT8}}, {348, 1, {v1::FORMAT_INT4}}};
  s.causal = true;
  s.rope = true;
  s.bias = true;
  s.qk_norm = true;
  s.seed = 13;
  return s;
}

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

const char* Verdict(bool ok) { return ok ? "PASS" : "FAIL"; }

class CudaFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: the CUDA fault test runs on a GPU host";
    std::vector<std::string> args = {"--backend=cuda", "--vram_budget=4Gi"};
    if (!fault_every_.empty()) args.push_back("--fault_every=" + fault_every_);
    daemon_ = std::make_unique<DaemonProcess>(args);
    ASSERT_TRUE(daemon_->ok()) << daemon_->why();
    c_ = daemon_->Connect();
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ(s->backend(), "cuda") << "kvpackd fell back to the CPU backend";
    // With injected faults the registration itself may draw one (RESOURCE_EXHAUSTED): try again.
    for (int attempt = 0; attempt < kRegisterAttempts; ++attempt) {
      weights_ = c_->RegisterWeights(WeightsOf(layer_));
      if (weights_.status().code() != absl::StatusCode::kResourceExhausted) break;
    }
    ASSERT_TRUE(weights_.ok()) << weights_.status();
  }

  void TearDown() override {
    for (void* p : hog_) cudaFree(p);
  }

  // Takes device memory until cudaMalloc refuses; returns the bytes taken.
  size_t HogDeviceMemory() {
    size_t taken = 0;
    for (size_t piece : {kHogPieceBytes, kHogChunkBytes}) {
      void* p = nullptr;
      while (cudaMalloc(&p, piece) == cudaSuccess) {
        hog_.push_back(p);
        taken += piece;
      }
      cudaGetLastError();  // the refusal is expected: clear it
    }
    return taken;
  }

  void ReleaseHog() {
    for (void* p : hog_) cudaFree(p);
    hog_.clear();
  }

  // An inline layer call on the registered weights; `out` receives the output.
  absl::StatusOr<v1::LayerResult> RunInline(std::vector<uint16_t>* out) {
    v1::LayerHeader h = layer_.header;
    h.set_weights_handle(weights_->handle());
    return c_->AttentionLayer(h, DataOf(layer_, out));
  }

  double RelL2VsReference(const std::vector<uint16_t>& out, const v1::LayerResult& r) {
    absl::StatusOr<std::vector<uint16_t>> ref = client::ReferenceOutput(layer_, r.plan(), /*choose_per_head=*/false);
    if (!ref.ok()) return 1e9;
    return client::Compare(out, *ref).rel_l2;
  }

  // Pool bytes and health now (health via Status.serving and grpc.health.v1).
  void ExpectServingWithPoolAtWeights(const char* after) {
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    ASSERT_TRUE(s.ok()) << after << ": Status failed: " << s.status();
    EXPECT_TRUE(s->serving()) << after;
    EXPECT_EQ(s->pool_bytes(), weights_->pool_bytes()) << after << ": pool not back to the weights";
    absl::StatusOr<bool> health = c_->Health();
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_TRUE(*health) << after << ": grpc.health.v1 not SERVING";
  }

  static constexpr int kRegisterAttempts = 3;
  std::string fault_every_;  // kvpackd's --fault_every, set by a derived fixture before SetUp
  const client::SyntheticLayer layer_ = client::MakeSyntheticLayer(MediumSpec());
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> c_;
  absl::StatusOr<v1::WeightsResponse> weights_;
  std::vector<void*> hog_;
};

// No layer runs before the hog, so the daemon's arena has mapped only the weights' chunks and the
// layer's K/V block, workspace and staging all need new ones.
TEST_F(CudaFaultTest, VmmExhaustionIsResourceExhaustedAndTheDaemonRecovers) {
  v1::PlanRequest plan_request;
  *plan_request.mutable_header() = layer_.header;
  plan_request.mutable_header()->set_weights_handle(weights_->handle());
  absl::StatusOr<v1::PlanResponse> plan = c_->Plan(plan_request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GT(plan->plan().predicted_peak_bytes(), 2 * kHogChunkBytes) << "the layer must need new chunks";
  const size_t taken = HogDeviceMemory();
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> exhausted = RunInline(&out);
  absl::StatusOr<v1::StatusResponse> during = c_->Status();
  const bool refused = exhausted.status().code() == absl::StatusCode::kResourceExhausted;
  const bool serving = during.ok() && during->serving() && during->pool_bytes() == weights_->pool_bytes();
  EXPECT_TRUE(refused) << exhausted.status();
  ExpectServingWithPoolAtWeights("after the exhausted call");

  ReleaseHog();
  absl::StatusOr<v1::LayerResult> again = RunInline(&out);
  const double rel_l2 = again.ok() ? RelL2VsReference(out, *again) : 1e9;
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_LT(rel_l2, kGpuVsCpuRelL2);
  ExpectServingWithPoolAtWeights("after the call with memory back");
  std::printf("[cuda_fault] vmm exhaustion: layer peak %.1f MiB; took %.2f GiB (%.1f MiB left free of %.1f GiB); layer call: %s \"%.120s\"; "
              "pool %s weights, serving %d; with memory back: %s rel_l2 %.2e -> %s\n",
              plan->plan().predicted_peak_bytes() / double(1ull << 20), taken / double(1ull << 30), free_bytes / double(1ull << 20), total_bytes / double(1ull << 30),
              absl::StatusCodeToString(exhausted.status().code()).c_str(), std::string(exhausted.status().message()).c_str(),
              serving ? "==" : "!=", serving, absl::StatusCodeToString(again.status().code()).c_str(), rel_l2,
              Verdict(refused && serving && again.ok() && rel_l2 < kGpuVsCpuRelL2));
}

// Every 7th allocation of the daemon's CUDA arena fails. A layer call makes a few (K/V block,
// workspace, staged x and output), so over the calls below the fault falls on different stages of
// some calls and on none of others.
constexpr char kVmmFaultEvery[] = "vmm_map:7";
constexpr int kVmmFaultCalls = 10;

class CudaVmmFaultTest : public CudaFaultTest {
 protected:
  CudaVmmFaultTest() { fault_every_ = kVmmFaultEvery; }
};

TEST_F(CudaVmmFaultTest, InjectedVmmMapFailuresAreResourceExhaustedAndNothingLeaks) {
  int ok = 0, refused = 0, ok_after_refused = 0, other = 0;
  double worst_rel_l2 = 0;
  for (int i = 0; i < kVmmFaultCalls; ++i) {
    std::vector<uint16_t> out;
    absl::StatusOr<v1::LayerResult> r = RunInline(&out);
    if (r.ok()) {
      const double rel_l2 = RelL2VsReference(out, *r);
      worst_rel_l2 = std::max(worst_rel_l2, rel_l2);
      EXPECT_LT(rel_l2, kGpuVsCpuRelL2) << "call " << i;
      ++ok;
      if (refused > 0) ++ok_after_refused;
    } else if (r.status().code() == absl::StatusCode::kResourceExhausted) {
      ++refused;
    } else {
      ++other;
      ADD_FAILURE() << "call " << i << ": " << r.status();
    }
    ExpectServingWithPoolAtWeights(("after call " + std::to_string(i)).c_str());
  }
  EXPECT_GT(refused, 0) << "no call drew an injected fault";
  EXPECT_GT(ok_after_refused, 0) << "no call ran after a refused one";
  absl::StatusOr<v1::StatusResponse> s = c_->Status();
  const bool serving = s.ok() && s->serving() && s->pool_bytes() == weights_->pool_bytes();
  std::printf("[cuda_fault] injected vmm_map (--fault_every=%s), %d calls: %d OK (worst rel_l2 %.2e), %d RESOURCE_EXHAUSTED, "
              "%d other; OK after a refusal %d; pool at weights and serving %d -> %s\n",
              kVmmFaultEvery, kVmmFaultCalls, ok, worst_rel_l2, refused, other, ok_after_refused, serving,
              Verdict(refused > 0 && ok_after_refused > 0 && other == 0 && serving && worst_rel_l2 < kGpuVsCpuRelL2));
}

// The codes a call over a region whose memory its owner freed may end with: OK (the daemon's
// cudaIpcOpenMemHandle keeps the allocation alive until the region is unregistered, and the layer
// reads what it last held) or a refusal naming the region; never INTERNAL (a sticky CUDA error that
// would take the daemon out of service for every client).
bool DocumentedFreedRegionCode(absl::StatusCode code) {
  return code == absl::StatusCode::kOk || code == absl::StatusCode::kNotFound ||
         code == absl::StatusCode::kFailedPrecondition || code == absl::StatusCode::kInvalidArgument;
}

TEST_F(CudaFaultTest, FreedIpcAllocationAfterRegisterDoesNotTakeTheDaemonDown) {
  const uint64_t x_bytes = layer_.x.size() * 2;
  void* x_alloc = nullptr;
  ASSERT_EQ(cudaMalloc(&x_alloc, x_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(x_alloc, layer_.x.data(), x_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  const std::string region = RegisterCudaIpcRegion(*c_, x_alloc, x_bytes);
  ASSERT_FALSE(region.empty());
  ASSERT_EQ(cudaFree(x_alloc), cudaSuccess);  // the owner frees it while the daemon holds the region
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  v1::LayerHeader h = layer_.header;
  h.set_weights_handle(weights_->handle());
  v1::RegionSlice* xs = h.mutable_x()->mutable_region();
  xs->set_region_id(region);
  xs->set_size_bytes(x_bytes);
  client::LayerData data;
  data.positions = layer_.positions.empty() ? nullptr : layer_.positions.data();
  std::vector<uint16_t> out(layer_.out_bytes() / 2);
  data.out = out.data();
  data.out_capacity = layer_.out_bytes();
  absl::StatusOr<v1::LayerResult> r = c_->AttentionLayer(h, data);
  const absl::StatusCode code = r.status().code();
  EXPECT_TRUE(DocumentedFreedRegionCode(code)) << r.status();
  ExpectServingWithPoolAtWeights("after the call over the freed region");
  const absl::Status unregistered = c_->UnregisterRegion(region);
  EXPECT_TRUE(unregistered.ok()) << unregistered;

  std::vector<uint16_t> next_out;
  absl::StatusOr<v1::LayerResult> next = RunInline(&next_out);
  const double rel_l2 = next.ok() ? RelL2VsReference(next_out, *next) : 1e9;
  EXPECT_TRUE(next.ok()) << next.status();
  EXPECT_LT(rel_l2, kGpuVsCpuRelL2);
  absl::StatusOr<v1::StatusResponse> s = c_->Status();
  const bool serving = s.ok() && s->serving() && s->pool_bytes() == weights_->pool_bytes();
  std::printf("[cuda_fault] ipc freed after register: layer call %s \"%.120s\"; unregister %s; next inline call %s "
              "rel_l2 %.2e; serving %d -> %s\n",
              absl::StatusCodeToString(code).c_str(), std::string(r.status().message()).c_str(),
              absl::StatusCodeToString(unregistered.code()).c_str(), absl::StatusCodeToString(next.status().code()).c_str(),
              rel_l2, serving, Verdict(DocumentedFreedRegionCode(code) && serving && next.ok() && rel_l2 < kGpuVsCpuRelL2));
}

TEST_F(CudaFaultTest, FreedIpcAllocationBeforeRegisterIsInvalidArgument) {
  void* alloc = nullptr;
  ASSERT_EQ(cudaMalloc(&alloc, kHogChunkBytes), cudaSuccess);
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, alloc), cudaSuccess);
  ASSERT_EQ(cudaFree(alloc), cudaSuccess);
  v1::RegisterRegionRequest req;
  req.set_kind(v1::REGION_CUDA_IPC);
  req.set_cuda_ipc_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  req.set_device(0);
  req.set_size_bytes(kHogChunkBytes);
  v1::RegisterRegionResponse resp;
  grpc::ClientContext ctx;
  c_->Prepare(&ctx);
  const grpc::Status st = c_->stub()->RegisterRegion(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  ExpectServingWithPoolAtWeights("after registering a freed handle");
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> next = RunInline(&out);
  EXPECT_TRUE(next.ok()) << next.status();
  std::printf("[cuda_fault] ipc freed before register: RegisterRegion code %d \"%.120s\"; next inline call %s -> %s\n",
              static_cast<int>(st.error_code()), st.error_message().c_str(),
              absl::StatusCodeToString(next.status().code()).c_str(),
              Verdict(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT && next.ok()));
}

}  // namespace
}  // namespace kvpack::testing
