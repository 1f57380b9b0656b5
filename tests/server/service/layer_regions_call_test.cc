// AttentionLayerRegions, ProjectRegions and AttendRegions (unary, every tensor in a region) against
// the real kvpackd (CPU backend, shared-memory regions): the same output bytes, plan and peak as the
// streamed calls; inline tensors and outputs refused naming the field; malformed headers, limits,
// deadlines, cancellation and auth answered as the stream answers them, with the memory back in
// the pool after each.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>

#include "tests/server/service/daemon_process.h"
#include "tests/server/service/region_layer.h"
#include "tests/server/service/sanitizer_build.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

class LayerRegionsCallTest : public RegionLayerTest {
 protected:
  LayerRegionsCallTest()
      : RegionLayerTest(SmallSpec(17), [](const client::SyntheticLayer&) {
          return std::vector<std::string>{"--vram_budget=256Mi"};
        }) {}
  void ExpectError(const std::string& method, const v1::LayerHeader& h, absl::StatusCode code,
                   const std::string& text) {
    absl::StatusOr<v1::LayerResult> r = Unary(*c_, method, h);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status();
  }
};

TEST_F(LayerRegionsCallTest, SameOutputBytesPlanAndPeakAsTheStream) {
  // The stream with inline tensors, the stream over the region, and the unary call over it.
  std::vector<uint16_t> inline_out;
  absl::StatusOr<v1::LayerResult> inline_run = c_->AttentionLayer(base_, DataOf(L_, &inline_out));
  ASSERT_TRUE(inline_run.ok()) << inline_run.status();
  absl::StatusOr<v1::LayerResult> streamed = c_->AttentionLayer(layer_.Header(base_, 0), client::LayerData{});
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  absl::StatusOr<v1::StatusResponse> before = c_->Status();
  absl::StatusOr<v1::LayerResult> unary = Unary(*c_, "AttentionLayerRegions", layer_.Header(base_, 1));
  ASSERT_TRUE(unary.ok()) << unary.status();
  absl::StatusOr<v1::StatusResponse> after = c_->Status();

  EXPECT_TRUE(layer_.Output(0) == inline_out);
  EXPECT_TRUE(layer_.Output(1) == layer_.Output(0));
  EXPECT_EQ(unary->plan().SerializeAsString(), streamed->plan().SerializeAsString());
  EXPECT_EQ(unary->peak_bytes(), unary->plan().predicted_peak_bytes());
  EXPECT_EQ(unary->output_bytes(), 0u);
  EXPECT_GT(unary->seconds().total(), 0.0);
  EXPECT_EQ(after->inline_bytes_received(), before->inline_bytes_received());  // nothing travelled inline
  EXPECT_EQ(after->inline_bytes_sent(), before->inline_bytes_sent());
  EXPECT_TRUE(Idle());
  EXPECT_TRUE(WaitFor([&] {
    return Sample(daemon_.Metrics(), "kvpack_requests_total{code=\"OK\",method=\"AttentionLayerRegions\"}") == 1.0;
  }));
}

TEST_F(LayerRegionsCallTest, ProjectThenAttendMatchTheStream) {
  v1::LayerHeader p = layer_.Header(base_, 0);
  p.mutable_output()->Clear();
  p.mutable_output()->set_mode(v1::OUTPUT_NONE);
  absl::StatusOr<v1::LayerResult> project = Unary(*c_, "ProjectRegions", p);
  ASSERT_TRUE(project.ok()) << project.status();
  ASSERT_FALSE(project->kv_handle().empty());
  v1::LayerHeader h = layer_.Header(base_, 1);
  h.set_kv_handle(project->kv_handle());
  absl::StatusOr<v1::LayerResult> unary = Unary(*c_, "AttendRegions", h);
  ASSERT_TRUE(unary.ok()) << unary.status();
  h = layer_.Header(base_, 2);
  h.set_kv_handle(project->kv_handle());
  absl::StatusOr<v1::LayerResult> streamed = c_->Attend(h, client::LayerData{});
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_TRUE(layer_.Output(1) == layer_.Output(2));
  // Attend over a handle is the whole layer's attention: the same bytes as AttentionLayer.
  std::vector<uint16_t> whole;
  ASSERT_TRUE(c_->AttentionLayer(base_, DataOf(L_, &whole)).ok());
  EXPECT_TRUE(layer_.Output(1) == whole);
  ASSERT_TRUE(c_->ReleaseKv(project->kv_handle()).ok());
  EXPECT_TRUE(Idle());
}

TEST_F(LayerRegionsCallTest, InlineTensorsAndMalformedHeadersNameTheField) {
  const auto with = [&](auto edit) {
    v1::LayerHeader h = layer_.Header(base_, 0);
    edit(&h);
    return h;
  };
  // Inline tensors and an inline output belong to the stream.
  ExpectError("AttentionLayerRegions", with([&](v1::LayerHeader* h) { h->mutable_x()->set_inline_bytes(L_.x.size() * 2); }),
              absl::StatusCode::kInvalidArgument, "header.x.inline_bytes: AttentionLayerRegions takes tensors in regions");
  ExpectError("AttentionLayerRegions",
              with([&](v1::LayerHeader* h) { h->mutable_positions()->set_inline_bytes(L_.positions.size() * 4); }),
              absl::StatusCode::kInvalidArgument, "header.positions.inline_bytes");
  ExpectError("AttentionLayerRegions", with([](v1::LayerHeader* h) { h->mutable_output()->set_mode(v1::OUTPUT_INLINE); }),
              absl::StatusCode::kInvalidArgument, "header.output.mode: AttentionLayerRegions writes into a region");
  ExpectError("ProjectRegions", with([&](v1::LayerHeader* h) { h->mutable_x()->set_inline_bytes(L_.x.size() * 2); }),
              absl::StatusCode::kInvalidArgument, "header.x.inline_bytes: ProjectRegions takes tensors in regions");
  v1::LayerHeader projected = layer_.Header(base_, 0);  // output into the region
  projected.clear_weights_handle();
  projected.clear_positions();
  projected.mutable_options()->clear_rope();
  projected.mutable_options()->clear_qk_norm();
  projected.mutable_shape()->set_hidden(0);
  projected.mutable_projected()->set_layout(v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR);
  projected.mutable_projected()->mutable_q()->set_inline_bytes(L_.out_bytes());
  ExpectError("AttentionLayerRegions", projected, absl::StatusCode::kInvalidArgument,
              "header.projected.q.inline_bytes");

  // Malformed headers: the same answers as the stream gives.
  ExpectError("AttentionLayerRegions", v1::LayerHeader(), absl::StatusCode::kInvalidArgument,
              "header.weights_handle: required");
  ExpectError("AttentionLayerRegions", with([](v1::LayerHeader* h) { h->mutable_x()->mutable_region()->set_region_id("r-0"); }),
              absl::StatusCode::kNotFound, "header.x.region");
  ExpectError("AttentionLayerRegions",
              with([](v1::LayerHeader* h) { h->mutable_x()->mutable_region()->set_size_bytes(2); }),
              absl::StatusCode::kInvalidArgument, "header.x.region.size_bytes");
  ExpectError("AttentionLayerRegions",
              with([](v1::LayerHeader* h) { h->mutable_x()->mutable_region()->set_offset(1ull << 40); }),
              absl::StatusCode::kInvalidArgument, "header.x.region");
  ExpectError("AttentionLayerRegions", with([](v1::LayerHeader* h) { h->mutable_output()->mutable_region()->set_offset(1ull << 40); }),
              absl::StatusCode::kInvalidArgument, "header.output.region");
  ExpectError("AttentionLayerRegions", with([](v1::LayerHeader* h) { h->mutable_shape()->set_n_tokens((1 << 22) + 1); }),
              absl::StatusCode::kInvalidArgument, "header.shape.n_tokens = 4194305 exceeds");
  ExpectError("AttentionLayerRegions", with([](v1::LayerHeader* h) { h->mutable_ranges(0)->set_end(3); }),
              absl::StatusCode::kInvalidArgument, "ranges[1].begin = 77 leaves tokens [3, 77) in no range");
  ExpectError("ProjectRegions", with([](v1::LayerHeader* h) { h->mutable_output()->set_mode(v1::OUTPUT_REGION); }),
              absl::StatusCode::kInvalidArgument, "header.output.mode: Project writes no output");
  ExpectError("AttentionLayerRegions", with([](v1::LayerHeader* h) { h->set_cuda_wait_event(std::string(64, 'e')); }),
              absl::StatusCode::kFailedPrecondition, "header.cuda_wait_event");

  // header.cuda_done_event: checked on every backend; taken by the CUDA backend only.
  ExpectError("AttentionLayerRegions", with([](v1::LayerHeader* h) { h->set_cuda_done_event("abc"); }),
              absl::StatusCode::kInvalidArgument, "header.cuda_done_event: 3 bytes");
  ExpectError("AttentionLayerRegions", with([](v1::LayerHeader* h) {
                h->set_cuda_done_event(std::string(64, 'd'));
                h->set_keep_kv(true);
              }),
              absl::StatusCode::kInvalidArgument, "header.cuda_done_event: AttentionLayerRegions answers after");
  ExpectError("AttentionLayerRegions", with([](v1::LayerHeader* h) { h->set_cuda_done_event(std::string(64, 'd')); }),
              absl::StatusCode::kInvalidArgument, "header.cuda_done_event: every tensor of the call");
  {
    std::vector<uint16_t> out;
    v1::LayerHeader h = base_;
    h.set_cuda_done_event(std::string(64, 'd'));
    absl::StatusOr<v1::LayerResult> r = c_->AttentionLayer(h, DataOf(L_, &out));  // the stream checks it too
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find("header.cuda_done_event"), std::string::npos) << r.status();
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_FALSE(s->cuda_done_event());
  }

  // Nothing held, and the daemon still serves.
  EXPECT_TRUE(Idle());
  EXPECT_TRUE(Unary(*c_, "AttentionLayerRegions", layer_.Header(base_, 0)).ok());
  EXPECT_TRUE(WaitFor([&] {
    return Sample(daemon_.Metrics(),
                  "kvpack_requests_total{code=\"INVALID_ARGUMENT\",method=\"AttentionLayerRegions\"}") >= 10.0;
  }));
}

using LayerRegionsCallCancelTest = LongRegionLayerTest;

TEST_F(LayerRegionsCallCancelTest, DeadlineAndCancelMidLayerFreeTheMemory) {
  absl::StatusOr<v1::LayerResult> r = Unary(*c_, "AttentionLayerRegions", layer_.Header(base_, 0), absl::Milliseconds(150));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_TRUE(WaitFor([&] { return Idle(); }, std::chrono::milliseconds(5000 * kSanitizerSlowdown)));

  // The client cancels while the layer runs (holding its K/V and workspace).
  grpc::ClientContext context;
  c_->Prepare(&context);
  const v1::LayerHeader header = layer_.Header(base_, 1);
  v1::LayerResult result;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  c_->stub()->async()->AttentionLayerRegions(&context, &header, &result, [&](grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    status = s;
    done = true;
    cv.notify_all();
  });
  ASSERT_TRUE(WaitFor([&] {
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    return s->running() == 1 && s->pool_bytes() > weights_.pool_bytes();
  }));
  context.TryCancel();
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  EXPECT_TRUE(WaitFor([&] { return Idle(); }, std::chrono::milliseconds(5000 * kSanitizerSlowdown)));
  EXPECT_TRUE(WaitFor([&] {
    return Sample(daemon_.Metrics(), "kvpack_requests_total{code=\"CANCELLED\",method=\"AttentionLayerRegions\"}") == 1.0;
  }));

  // Still serving: the same layer runs to the end.
  EXPECT_TRUE(Unary(*c_, "AttentionLayerRegions", layer_.Header(base_, 2)).ok());
}

TEST(LayerRegionsCallAuthTest, TokensAndTenantsAsOnTheStream) {
  constexpr char kToken[] = "service-token-0123456789abcdef";
  const std::string path = ::testing::TempDir() + "/kvpack_regions_tokens";
  std::ofstream(path) << kToken << "\n";
  DaemonProcess daemon({"--vram_budget=64Mi", "--auth_token_file=" + path});
  ASSERT_TRUE(daemon.ok());
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(5));
  auto alice = daemon.Connect("alice", kToken);
  absl::StatusOr<v1::WeightsResponse> w = alice->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok()) << w.status();
  RegionLayer layer(L);
  ASSERT_TRUE(layer.Register(*alice).ok());
  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  h = layer.Header(h, 0);

  EXPECT_EQ(Unary(*daemon.Connect("alice"), "AttentionLayerRegions", h).status().code(),
            absl::StatusCode::kUnauthenticated);
  // Another tenant sees neither alice's weights nor, with weights of its own, her region.
  auto bob = daemon.Connect("bob", kToken);
  absl::StatusOr<v1::LayerResult> r = Unary(*bob, "AttentionLayerRegions", h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  absl::StatusOr<v1::WeightsResponse> bob_w = bob->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(bob_w.ok()) << bob_w.status();
  v1::LayerHeader bob_h = h;
  bob_h.set_weights_handle(bob_w->handle());
  r = Unary(*bob, "AttentionLayerRegions", bob_h);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("header.x.region"), std::string::npos) << r.status();
  r = Unary(*alice, "AttentionLayerRegions", h);
  EXPECT_TRUE(r.ok()) << r.status();
}

}  // namespace
}  // namespace kvpack::testing
