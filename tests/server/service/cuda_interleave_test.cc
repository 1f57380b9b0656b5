// GPU turns through the real kvpackd on the CUDA backend (label gpu; skips without a device): a long
// low-priority layer is running when a short high-priority one arrives. With chunk-by-chunk turns
// the short one waits for at most one chunk of the long one, not for the whole layer; both outputs
// stay correct (the short one against the CPU reference, the long one against the same layer run
// alone).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/server/service/cuda_ipc_region.h"
#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

using Clock = std::chrono::steady_clock;

// GPU vs CPU backend on the same plan (cuda_daemon_test.cc says why it is not bit-exact).
constexpr double kGpuVsCpuRelL2 = 2e-2;
// The long layer interleaved vs alone: the same kernels on the same inputs; only the order of the
// two requests' chunks differs, which must not change a value.
constexpr double kInterleavedVsAloneRelL2 = 1e-6;
// The short request's latency as a share of the long one's. Without turns it waits for the whole
// rest of the long layer (share ≈ 0.9); with them for at most one chunk of it (~1/24 of the layer
// at --max_chunk_tokens=4096) plus its own few milliseconds.
constexpr double kMaxLatencyShare = 0.5;

// The long layer: N = 98304, D = 1024, 32 heads × 128, INT4, non-causal — ~0.6–1 s of attention on
// an H100/H200 (4·N²·d·H = 1.6e14 FLOPs), 24 query chunks of 4096. x and the output live in CUDA IPC
// regions so that nothing slow crosses the socket.
constexpr int64_t kLongTokens = 98304;
constexpr int kLongHidden = 1024, kLongHeads = 32, kLongDim = 128;

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// Seeded normal values scaled by `scale`, with a per-column offset (K/V-like structure), in bf16.
std::vector<uint16_t> RandomBf16(int64_t rows, int64_t cols, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> offset(cols);
  for (float& o : offset) o = 0.3f * normal(rng);
  std::vector<uint16_t> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = Bf16(scale * (normal(rng) + offset[c]));
  }
  return out;
}

double RelL2(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  const auto f = [](uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return static_cast<double>(x);
  };
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (f(a[i]) - f(b[i])) * (f(a[i]) - f(b[i]));
    den += f(b[i]) * f(b[i]);
  }
  return std::sqrt(num / den);
}

class CudaInterleaveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: the CUDA interleaving test runs on a GPU host";
    daemon_ = std::make_unique<DaemonProcess>(
        std::vector<std::string>{"--backend=cuda", "--vram_budget=8Gi", "--threads=2", "--max_chunk_tokens=4096"});
    ASSERT_TRUE(daemon_->ok()) << daemon_->why();
    long_client_ = daemon_->Connect();
    short_client_ = daemon_->Connect();
    absl::StatusOr<v1::StatusResponse> s = long_client_->Status();
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ(s->backend(), "cuda") << "kvpackd fell back to the CPU backend";
  }

  void TearDown() override {
    if (x_) cudaFree(x_);
    if (out_) cudaFree(out_);
  }

  // Registers the long layer's weights and its x and output as CUDA IPC regions; returns its header.
  v1::LayerHeader PrepareLong() {
    const int64_t rows = 3ll * kLongHeads * kLongDim;
    w_host_ = RandomBf16(rows, kLongHidden, 1.0f / std::sqrt(static_cast<float>(kLongHidden)), 5);
    client::WeightsData wd;
    wd.hidden = kLongHidden;
    wd.n_heads = kLongHeads;
    wd.head_dim = kLongDim;
    wd.w_qkv = w_host_.data();
    absl::StatusOr<v1::WeightsResponse> weights = long_client_->RegisterWeights(wd);
    EXPECT_TRUE(weights.ok()) << weights.status();
    const std::vector<uint16_t> x = RandomBf16(kLongTokens, kLongHidden, 1.0f, 6);
    x_bytes_ = x.size() * 2;
    out_bytes_ = 2ull * kLongTokens * kLongHeads * kLongDim;
    EXPECT_EQ(cudaMalloc(&x_, x_bytes_), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&out_, out_bytes_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(x_, x.data(), x_bytes_, cudaMemcpyHostToDevice), cudaSuccess);

    v1::LayerHeader h;
    h.mutable_shape()->set_n_tokens(kLongTokens);
    h.mutable_shape()->set_hidden(kLongHidden);
    h.mutable_shape()->set_n_heads(kLongHeads);
    h.mutable_shape()->set_head_dim(kLongDim);
    v1::TokenRange* range = h.add_ranges();
    range->set_begin(0);
    range->set_end(kLongTokens);
    range->add_allowed_formats(v1::FORMAT_INT4);
    h.set_weights_handle(weights.ok() ? weights->handle() : "");
    h.set_priority(0);
    v1::RegionSlice* xs = h.mutable_x()->mutable_region();
    xs->set_region_id(RegisterIpc(x_, x_bytes_));
    xs->set_size_bytes(x_bytes_);
    h.mutable_output()->set_mode(v1::OUTPUT_REGION);
    h.mutable_output()->mutable_region()->set_region_id(RegisterIpc(out_, out_bytes_));
    h.mutable_output()->mutable_region()->set_size_bytes(out_bytes_);
    return h;
  }

  std::string RegisterIpc(void* allocation, uint64_t bytes) { return RegisterCudaIpcRegion(*long_client_, allocation, bytes); }

  std::vector<uint16_t> LongOutput() {
    std::vector<uint16_t> out(out_bytes_ / 2);
    EXPECT_EQ(cudaMemcpy(out.data(), out_, out_bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> long_client_, short_client_;
  std::vector<uint16_t> w_host_;
  void* x_ = nullptr;
  void* out_ = nullptr;
  uint64_t x_bytes_ = 0, out_bytes_ = 0;
};

TEST_F(CudaInterleaveTest, ShortHighPriorityLayerPassesALongOneChunkByChunk) {
  const v1::LayerHeader long_header = PrepareLong();
  // Alone first: the long layer's reference output and duration (this also warms the daemon up).
  const Clock::time_point alone_start = Clock::now();
  absl::StatusOr<v1::LayerResult> alone = long_client_->AttentionLayer(long_header, client::LayerData{});
  const double alone_s = std::chrono::duration<double>(Clock::now() - alone_start).count();
  ASSERT_TRUE(alone.ok()) << alone.status();
  const std::vector<uint16_t> alone_out = LongOutput();
  ASSERT_EQ(cudaMemset(out_, 0xff, out_bytes_), cudaSuccess);  // NaN poison before the second run

  const client::SyntheticLayer small = client::MakeSyntheticLayer(SmallSpec(12));
  absl::StatusOr<v1::WeightsResponse> small_weights = short_client_->RegisterWeights(WeightsOf(small));
  ASSERT_TRUE(small_weights.ok()) << small_weights.status();
  v1::LayerHeader short_header = small.header;
  short_header.set_weights_handle(small_weights->handle());
  short_header.set_priority(10);

  // The long layer starts; the short one is sent once a quarter of the long one's time has passed.
  const Clock::time_point long_start = Clock::now();
  std::future<std::pair<absl::StatusOr<v1::LayerResult>, double>> long_run = std::async(std::launch::async, [&] {
    absl::StatusOr<v1::LayerResult> r = long_client_->AttentionLayer(long_header, client::LayerData{});
    return std::make_pair(std::move(r), std::chrono::duration<double>(Clock::now() - long_start).count());
  });
  std::this_thread::sleep_for(std::chrono::duration<double>(alone_s / 4));
  std::vector<uint16_t> short_out;
  const Clock::time_point short_start = Clock::now();
  absl::StatusOr<v1::LayerResult> short_result = short_client_->AttentionLayer(short_header, DataOf(small, &short_out));
  const double short_s = std::chrono::duration<double>(Clock::now() - short_start).count();
  auto [long_result, long_s] = long_run.get();

  ASSERT_TRUE(short_result.ok()) << short_result.status();
  ASSERT_TRUE(long_result.ok()) << long_result.status();
  std::printf("long alone %.3f s; interleaved: long %.3f s (turn wait %.3f s), short %.3f s (turn wait %.3f s)\n",
              alone_s, long_s, long_result->seconds().turn_wait(), short_s, short_result->seconds().turn_wait());
  EXPECT_LT(short_s, kMaxLatencyShare * long_s) << "the short request waited for the whole long layer";
  EXPECT_LT(short_s + (short_start - long_start) / std::chrono::duration<double>(1), long_s)
      << "the short request finished after the long one";
  EXPECT_GT(long_result->seconds().turn_wait(), 0.0) << "the long layer never yielded its turn";

  // The CUDA backend chooses transforms per head as the CPU reference does (head_choice.h).
  absl::StatusOr<std::vector<uint16_t>> ref = client::ReferenceOutput(small, short_result->plan());
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_LT(client::Compare(short_out, *ref).rel_l2, kGpuVsCpuRelL2);
  EXPECT_LT(RelL2(LongOutput(), alone_out), kInterleavedVsAloneRelL2);
}

}  // namespace
}  // namespace kvpack::testing
