// Cancellation and deadlines: while a request waits for memory and while it runs. Its memory is
// freed, the daemon keeps serving.
#include <gtest/gtest.h>

#include <thread>

#include "tests/server/service/daemon_process.h"
#include "tests/server/service/sanitizer_build.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

class CancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    L_ = client::MakeSyntheticLayer(LongSpec());
    // Room for two tenants' weights and one long layer at a time.
    const uint64_t budget = 2 * WeightsPoolBytes(L_) + LayerPeakBytes(L_, 256) * 3 / 2;
    daemon_ = std::make_unique<DaemonProcess>(std::vector<std::string>{"--vram_budget=" + std::to_string(budget),
                                                                          "--max_chunk_tokens=256"});
    ASSERT_TRUE(daemon_->ok());
    c_ = daemon_->Connect();
    absl::StatusOr<v1::WeightsResponse> w = c_->RegisterWeights(WeightsOf(L_));
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = *w;
    header_ = L_.header;
    header_.set_weights_handle(w->handle());
  }
  // Back to the weights alone, nothing running or queued.
  bool Idle() {
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    return s.ok() && s->pool_bytes() == weights_.pool_bytes() && s->reserved_bytes() == 0 && s->running() == 0 &&
           s->queue_depth() == 0;
  }
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> c_;
  client::SyntheticLayer L_;
  v1::WeightsResponse weights_;
  v1::LayerHeader header_;
};

TEST_F(CancelTest, DeadlineMidLayer) {
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> r = c_->AttentionLayer(header_, DataOf(L_, &out), absl::Milliseconds(150));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_TRUE(WaitFor([&] { return Idle(); }, std::chrono::milliseconds(5000 * kSanitizerSlowdown)));
  EXPECT_TRUE(WaitFor([&] {
    return Sample(daemon_->Metrics(), "kvpack_requests_total{code=\"DEADLINE_EXCEEDED\",method=\"AttentionLayer\"}") == 1.0;
  }));
  // Still serving.
  EXPECT_TRUE(*c_->Health());
}

TEST_F(CancelTest, ClientCancelsMidLayer) {
  grpc::ClientContext context;
  c_->Prepare(&context);
  auto stream = c_->stub()->AttentionLayer(&context);
  v1::LayerRequest msg;
  *msg.mutable_header() = header_;
  msg.mutable_header()->mutable_x()->set_inline_bytes(L_.x.size() * 2);
  msg.mutable_header()->mutable_positions()->set_inline_bytes(L_.positions.size() * 4);
  ASSERT_TRUE(stream->Write(msg));
  for (auto [id, p, n] : {std::tuple{v1::TENSOR_X, static_cast<const void*>(L_.x.data()), L_.x.size() * 2},
                          std::tuple{v1::TENSOR_POSITIONS, static_cast<const void*>(L_.positions.data()),
                                     L_.positions.size() * 4}}) {
    v1::LayerRequest chunk;
    chunk.mutable_chunk()->set_tensor(id);
    chunk.mutable_chunk()->set_data(p, n);
    ASSERT_TRUE(stream->Write(chunk));
  }
  stream->WritesDone();
  // Admitted (running() counts it) and then, once an executor thread takes it, holding its K/V and
  // workspace; the executor threads run at --layer_nice, so on a loaded host the second step lags.
  ASSERT_TRUE(WaitFor([&] {
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    return s->running() == 1 && s->pool_bytes() > weights_.pool_bytes();
  }));
  context.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitFor([&] { return Idle(); }, std::chrono::milliseconds(5000 * kSanitizerSlowdown)));
}

TEST_F(CancelTest, DeadlineAndCancelWhileWaitingForMemory) {
  // A budget that fits one long layer: a second one waits in the queue.
  std::vector<uint16_t> out1;
  absl::StatusOr<v1::LayerResult> first;
  std::thread t([&] { first = c_->AttentionLayer(header_, DataOf(L_, &out1)); });
  ASSERT_TRUE(WaitFor([&] { return c_->Status()->running() == 1; }));
  // Another tenant's layer of the same size cannot be admitted while the first runs.
  auto other = daemon_->Connect("other");
  absl::StatusOr<v1::WeightsResponse> w = other->RegisterWeights(WeightsOf(L_));
  ASSERT_TRUE(w.ok()) << w.status();
  v1::LayerHeader h = L_.header;
  h.set_weights_handle(w->handle());
  std::vector<uint16_t> out2;
  absl::StatusOr<v1::LayerResult> waited;
  std::thread second([&] { waited = other->AttentionLayer(h, DataOf(L_, &out2), absl::Milliseconds(250)); });
  EXPECT_TRUE(WaitFor([&] { return c_->Status()->queue_depth() == 1; },
                      std::chrono::milliseconds(250 * kSanitizerSlowdown)));
  second.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded) << waited.status();
  EXPECT_TRUE(WaitFor([&] { return c_->Status()->queue_depth() == 0; },
                      std::chrono::milliseconds(1000 * kSanitizerSlowdown)));
  t.join();
  EXPECT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(other->ReleaseWeights(w->handle()).ok());
  EXPECT_TRUE(WaitFor([&] { return Idle(); }));
}

// One executor thread, room in the budget for three long layers: the second and third are admitted
// (memory reserved) and wait for the thread.
class ExecutorQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    client::SyntheticSpec spec = LongSpec();
    spec.n_tokens = 6000;  // ~2 s on one thread: long enough to act while it runs
    spec.ranges = {{6000, 0, {v1::FORMAT_INT4}}};
    L_ = client::MakeSyntheticLayer(spec);
    const uint64_t budget = WeightsPoolBytes(L_) + 4 * LayerPeakBytes(L_, 256);
    daemon_ = std::make_unique<DaemonProcess>(std::vector<std::string>{
        "--vram_budget=" + std::to_string(budget), "--max_chunk_tokens=256", "--threads=1",
        // The running layer must finish inside the drain (~2 s here; 10x that under ASan).
        "--drain_seconds=" + std::to_string(30 * kSanitizerSlowdown)});
    ASSERT_TRUE(daemon_->ok());
    c_ = daemon_->Connect();
    absl::StatusOr<v1::WeightsResponse> w = c_->RegisterWeights(WeightsOf(L_));
    ASSERT_TRUE(w.ok()) << w.status();
    header_ = L_.header;
    header_.set_weights_handle(w->handle());
  }
  // Runs a layer on its own connection in a thread.
  std::thread Run(absl::StatusOr<v1::LayerResult>* result, std::vector<uint16_t>* out) {
    return std::thread([this, result, out] {
      *result = daemon_->Connect()->AttentionLayer(header_, DataOf(L_, out));
    });
  }
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> c_;
  client::SyntheticLayer L_;
  v1::LayerHeader header_;
};

TEST_F(ExecutorQueueTest, CancellingAnAdmittedLayerFreesItsPlaceAndMemoryAtOnce) {
  absl::StatusOr<v1::LayerResult> first;
  std::vector<uint16_t> out1;
  std::thread t = Run(&first, &out1);
  ASSERT_TRUE(WaitFor([&] { return c_->Status()->running() == 1; }));

  grpc::ClientContext context;
  c_->Prepare(&context);
  auto stream = c_->stub()->AttentionLayer(&context);
  v1::LayerRequest msg;
  *msg.mutable_header() = header_;
  msg.mutable_header()->mutable_x()->set_inline_bytes(L_.x.size() * 2);
  msg.mutable_header()->mutable_positions()->set_inline_bytes(L_.positions.size() * 4);
  ASSERT_TRUE(stream->Write(msg));
  for (auto [id, p, n] : {std::tuple{v1::TENSOR_X, static_cast<const void*>(L_.x.data()), L_.x.size() * 2},
                          std::tuple{v1::TENSOR_POSITIONS, static_cast<const void*>(L_.positions.data()),
                                     L_.positions.size() * 4}}) {
    v1::LayerRequest chunk;
    chunk.mutable_chunk()->set_tensor(id);
    chunk.mutable_chunk()->set_data(p, n);
    ASSERT_TRUE(stream->Write(chunk));
  }
  stream->WritesDone();
  // Admitted: its peak is reserved, and it waits for the one executor thread.
  ASSERT_TRUE(WaitFor([&] {
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    return s->queue_depth() == 1 && s->reserved_bytes() > 0;
  }));
  context.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // Gone as soon as the daemon hears of the cancel, while the first layer (~2 s) still runs; before
  // the fix it kept its place and reservation until that layer ended.
  EXPECT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::StatusResponse> s = c_->Status();
        return s->running() == 1 && s->queue_depth() == 0 && s->reserved_bytes() == 0;
      },
      std::chrono::milliseconds(500)));
  EXPECT_EQ(c_->Status()->running(), 1);
  t.join();
  EXPECT_TRUE(first.ok()) << first.status();
}

TEST_F(ExecutorQueueTest, SigtermFinishesTheRunningLayerAndRejectsQueuedOnes) {
  absl::StatusOr<v1::LayerResult> first, second, third;
  std::vector<uint16_t> out1, out2, out3;
  std::thread t1 = Run(&first, &out1);
  ASSERT_TRUE(WaitFor([&] { return c_->Status()->running() == 1; }));
  std::thread t2 = Run(&second, &out2);
  std::thread t3 = Run(&third, &out3);
  ASSERT_TRUE(WaitFor([&] { return c_->Status()->queue_depth() == 2; }));
  c_.reset();
  EXPECT_EQ(daemon_->Stop(), 0);
  t1.join();
  t2.join();
  t3.join();
  EXPECT_TRUE(first.ok()) << first.status();  // in flight: finishes
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();  // queued: retry elsewhere
  EXPECT_EQ(third.status().code(), absl::StatusCode::kUnavailable) << third.status();
}

}  // namespace
}  // namespace kvpack::testing
