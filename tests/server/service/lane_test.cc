// Lanes (proto/kvpack/v1/lane.h) against the real kvpackd (CPU backend): a lane call gives the
// bytes, plan and peak of the unary call; whatever a client writes into the region (a bad method,
// sizes past the area, bytes that are no LayerHeader, a truncated object) is answered with a code
// and the lane serves on; OpenLane checks the region and the limits; unregistering the region,
// CloseLane, the lease and draining close the lane; deadlines and cancel_seq stop a call mid-layer
// with the memory back in the pool.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <thread>

#include "client/lane.h"
#include "tests/server/service/daemon_process.h"
#include "tests/server/service/region_layer.h"
#include "tests/server/service/sanitizer_build.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

namespace lane = v1::lane;

absl::Status OpenLaneOver(client::Client& c, const std::string& region_id, v1::OpenLaneResponse* out = nullptr) {
  grpc::ClientContext context;
  c.Prepare(&context);
  v1::OpenLaneRequest request;
  request.set_region_id(region_id);
  v1::OpenLaneResponse response;
  absl::Status s = client::FromGrpc(c.stub()->OpenLane(&context, request, &response));
  if (out != nullptr) *out = response;
  return s;
}

absl::Status CloseLane(client::Client& c, const std::string& lane_id) {
  grpc::ClientContext context;
  c.Prepare(&context);
  v1::CloseLaneRequest request;
  request.set_lane_id(lane_id);
  v1::CloseLaneResponse response;
  return client::FromGrpc(c.stub()->CloseLane(&context, request, &response));
}

int OpenLanes(client::Client& c) {
  absl::StatusOr<v1::StatusResponse> s = c.Status();
  return s.ok() ? s->lanes() : -1;
}

void ExpectStatus(const absl::Status& s, absl::StatusCode code, const std::string& text) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(text), std::string::npos) << s << "\n  expected to find: " << text;
}

class LaneTest : public RegionLayerTest {
 protected:
  LaneTest()
      : RegionLayerTest(SmallSpec(23), [](const client::SyntheticLayer&) {
          return std::vector<std::string>{"--vram_budget=256Mi", "--max_lanes_per_tenant=2"};
        }) {}
  void SetUp() override {
    RegionLayerTest::SetUp();
    if (HasFatalFailure()) return;
    absl::StatusOr<std::unique_ptr<client::Lane>> l = client::Lane::Open(c_.get());
    ASSERT_TRUE(l.ok()) << l.status();
    lane_ = *std::move(l);
  }
  absl::Status Raw(uint32_t method, const std::string& bytes, uint32_t declared) {
    absl::StatusOr<client::Lane::Answer> a = lane_->CallRaw(method, bytes, declared, absl::Seconds(30));
    if (!a.ok()) return a.status();
    return absl::Status(static_cast<absl::StatusCode>(a->code), a->code == 0 ? "" : a->bytes);
  }

  std::unique_ptr<client::Lane> lane_;
};

TEST_F(LaneTest, SameBytesPlanAndPeakAsTheUnaryCall) {
  EXPECT_EQ(lane_->opened().request_area_bytes(), 256u << 10);
  EXPECT_EQ(lane_->opened().spin_us(), 20000u);  // the daemon's default --lane_spin_us
  EXPECT_EQ(lane_->state(), lane::kStateOpen);
  EXPECT_EQ(OpenLanes(*c_), 1);
  absl::StatusOr<v1::LayerResult> unary = Unary(*c_, "AttentionLayerRegions", layer_.Header(base_, 0));
  ASSERT_TRUE(unary.ok()) << unary.status();
  absl::StatusOr<v1::LayerResult> laned = lane_->Call(lane::kAttentionLayerRegions, layer_.Header(base_, 1), absl::Seconds(30));
  ASSERT_TRUE(laned.ok()) << laned.status();
  EXPECT_TRUE(layer_.Output(1) == layer_.Output(0));
  EXPECT_EQ(laned->plan().SerializeAsString(), unary->plan().SerializeAsString());
  EXPECT_EQ(laned->peak_bytes(), laned->plan().predicted_peak_bytes());
  EXPECT_GT(laned->seconds().total(), 0.0);

  // Project then Attend through the lane: the whole layer's bytes again.
  v1::LayerHeader p = layer_.Header(base_, 0);
  p.mutable_output()->Clear();
  p.mutable_output()->set_mode(v1::OUTPUT_NONE);
  absl::StatusOr<v1::LayerResult> project = lane_->Call(lane::kProjectRegions, p, absl::Seconds(30));
  ASSERT_TRUE(project.ok()) << project.status();
  v1::LayerHeader h = layer_.Header(base_, 2);
  h.set_kv_handle(project->kv_handle());
  absl::StatusOr<v1::LayerResult> attend = lane_->Call(lane::kAttendRegions, h, absl::Seconds(30));
  ASSERT_TRUE(attend.ok()) << attend.status();
  EXPECT_TRUE(layer_.Output(2) == layer_.Output(0));
  ASSERT_TRUE(c_->ReleaseKv(project->kv_handle()).ok());
  EXPECT_TRUE(Idle());
  EXPECT_TRUE(WaitFor([&] {
    const std::string m = daemon_.Metrics();
    return Sample(m, "kvpack_lanes") == 1.0 &&
           Sample(m, "kvpack_requests_total{code=\"OK\",method=\"AttentionLayerLane\"}") == 1.0 &&
           Sample(m, "kvpack_requests_total{code=\"OK\",method=\"ProjectLane\"}") == 1.0 &&
           Sample(m, "kvpack_requests_total{code=\"OK\",method=\"AttendLane\"}") == 1.0;
  }));
}

TEST_F(LaneTest, WhateverTheClientWritesIsAnsweredAndTheLaneServesOn) {
  const std::string header = layer_.Header(base_, 0).SerializeAsString();
  ExpectStatus(Raw(7, header, header.size()), absl::StatusCode::kInvalidArgument, "lane method = 7");
  ExpectStatus(Raw(lane::kAttentionLayerRegions, header, (256u << 10) + 1), absl::StatusCode::kInvalidArgument,
               "lane request_bytes = 262145: above the lane's 262144-byte request area");
  ExpectStatus(Raw(lane::kAttentionLayerRegions, header, 0xffffffffu), absl::StatusCode::kInvalidArgument,
               "lane request_bytes = 4294967295");
  ExpectStatus(Raw(lane::kAttentionLayerRegions, std::string(1000, '\xff'), 1000), absl::StatusCode::kInvalidArgument,
               "lane request: its 1000 bytes are not a LayerHeader");
  // A header cut short is not a header either (or, cut at a field boundary, a header missing fields).
  EXPECT_FALSE(Raw(lane::kAttentionLayerRegions, header, header.size() / 2).ok());
  // The header's own checks, as the unary call makes them, named for the lane's method.
  v1::LayerHeader inline_x = layer_.Header(base_, 0);
  inline_x.mutable_x()->set_inline_bytes(L_.x.size() * 2);
  ExpectStatus(lane_->Call(lane::kAttentionLayerRegions, inline_x, absl::Seconds(30)).status(),
               absl::StatusCode::kInvalidArgument, "header.x.inline_bytes: AttentionLayerLane takes tensors in regions");
  ExpectStatus(lane_->Call(lane::kAttentionLayerRegions, v1::LayerHeader(), absl::Seconds(30)).status(),
               absl::StatusCode::kInvalidArgument, "header.weights_handle: required");
  v1::LayerHeader far = layer_.Header(base_, 0);
  far.mutable_output()->mutable_region()->set_offset(1ull << 40);
  ExpectStatus(lane_->Call(lane::kAttentionLayerRegions, far, absl::Seconds(30)).status(),
               absl::StatusCode::kInvalidArgument, "header.output.region");
  // Scribbles over the identity and the daemon's line change nothing: the daemon read the areas'
  // sizes once, and writes its own line on each answer.
  std::memset(lane_->region(), 0xff, 64);
  std::memset(lane_->region() + lane::kAnswerSeq, 0x5a, 12);  // answer_seq, code, answer_bytes
  absl::StatusOr<v1::LayerResult> ok = lane_->Call(lane::kAttentionLayerRegions, layer_.Header(base_, 1), absl::Seconds(30));
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_TRUE(Unary(*c_, "AttentionLayerRegions", layer_.Header(base_, 2)).ok());
  EXPECT_TRUE(layer_.Output(1) == layer_.Output(2));
  EXPECT_TRUE(Idle());
  EXPECT_EQ(OpenLanes(*c_), 1);
  EXPECT_TRUE(WaitFor([&] {
    return Sample(daemon_.Metrics(), "kvpack_requests_total{code=\"INVALID_ARGUMENT\",method=\"AttentionLayerLane\"}") >= 7.0;
  }));
}

TEST_F(LaneTest, OpenLaneChecksTheRegionTheTenantAndTheLimits) {
  ExpectStatus(OpenLaneOver(*c_, ""), absl::StatusCode::kInvalidArgument, "region_id: required");
  ExpectStatus(OpenLaneOver(*c_, "r-0123"), absl::StatusCode::kNotFound, "region_id");
  // The layer's region has no lane layout; a second lane over the first lane's region is refused.
  ExpectStatus(OpenLaneOver(*c_, layer_.region()), absl::StatusCode::kInvalidArgument, "no lane layout at byte 0");
  ExpectStatus(OpenLaneOver(*c_, lane_->region_id()), absl::StatusCode::kFailedPrecondition, "already carries lane");
  // Another tenant names neither the region nor the lane.
  auto bob = daemon_.Connect("bob");
  ExpectStatus(OpenLaneOver(*bob, lane_->region_id()), absl::StatusCode::kNotFound, "region_id");
  ExpectStatus(CloseLane(*bob, lane_->lane_id()), absl::StatusCode::kNotFound, "no such lane for this tenant");
  ExpectStatus(CloseLane(*c_, ""), absl::StatusCode::kInvalidArgument, "lane_id: required");

  // Areas the region cannot hold, or outside the bounds, named.
  auto shm = client::SharedMemory::Create(lane::kAreasAt + 8192);
  ASSERT_TRUE(shm.ok());
  const uint32_t identity[4] = {lane::kLaneMagic, lane::kLaneVersion, 8192, 8192};
  std::memcpy((*shm)->data(), identity, sizeof(identity));
  absl::StatusOr<std::string> small = c_->RegisterShmRegion((*shm)->name(), (*shm)->size());
  ASSERT_TRUE(small.ok()) << small.status();
  ExpectStatus(OpenLaneOver(*c_, *small), absl::StatusCode::kInvalidArgument, "region_id (the lane's areas)");
  const uint32_t tiny[4] = {lane::kLaneMagic, lane::kLaneVersion, 16, 4096};
  std::memcpy((*shm)->data(), tiny, sizeof(tiny));
  ExpectStatus(OpenLaneOver(*c_, *small), absl::StatusCode::kInvalidArgument, "the lane's request area is 16 bytes");
  const uint32_t fits[4] = {lane::kLaneMagic, lane::kLaneVersion, 4096, 4096};
  std::memcpy((*shm)->data(), fits, sizeof(fits));
  v1::OpenLaneResponse second;
  ASSERT_TRUE(OpenLaneOver(*c_, *small, &second).ok());
  // --max_lanes_per_tenant=2: a third is refused; bob, another tenant, still gets one.
  auto more = client::Lane::Open(c_.get());
  ExpectStatus(more.status(), absl::StatusCode::kResourceExhausted, "--max_lanes_per_tenant");
  auto bobs = client::Lane::Open(bob.get());
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_EQ(OpenLanes(*c_), 3);
  ASSERT_TRUE(CloseLane(*c_, second.lane_id()).ok());
  EXPECT_TRUE(WaitFor([&] { return OpenLanes(*c_) == 2; }));
  ASSERT_TRUE(c_->UnregisterRegion(*small).ok());
}

TEST_F(LaneTest, UnregisteringTheRegionClosesTheLane) {
  ASSERT_TRUE(lane_->Call(lane::kAttentionLayerRegions, layer_.Header(base_, 0), absl::Seconds(30)).ok());
  // Completes: the lane lets go of its region, as any call using it does at its end.
  ASSERT_TRUE(c_->UnregisterRegion(lane_->region_id()).ok());
  EXPECT_EQ(lane_->state(), lane::kStateClosed);
  EXPECT_EQ(OpenLanes(*c_), 0);
  EXPECT_EQ(Sample(daemon_.Metrics(), "kvpack_lanes"), 0.0);
  ExpectStatus(lane_->Call(lane::kAttentionLayerRegions, layer_.Header(base_, 0), absl::Seconds(30)).status(),
               absl::StatusCode::kUnavailable, "lane closed");
  EXPECT_TRUE(Idle());
}

TEST_F(LaneTest, ATruncatedObjectClosesTheLaneAndTheDaemonServesOn) {
  // The client shrinks the object under the daemon's mapping: the daemon's reads there would
  // fault (SIGBUS) without the mapping's guard; it sees zeros instead, and closes the lane.
  std::string name = "/dev/shm";
  absl::StatusOr<v1::RegionStatusResponse> regions = c_->RegionStatus(lane_->region_id());
  ASSERT_TRUE(regions.ok() && regions->regions_size() == 1);
  name += regions->regions(0).shm_name();
  ASSERT_EQ(truncate(name.c_str(), 0), 0) << name;
  EXPECT_TRUE(WaitFor([&] { return OpenLanes(*c_) == 0; }, std::chrono::milliseconds(5000 * kSanitizerSlowdown)));
  EXPECT_TRUE(Unary(*c_, "AttentionLayerRegions", layer_.Header(base_, 0)).ok());
  EXPECT_TRUE(Idle());
}

using LaneCancelTest = LongRegionLayerTest;

TEST_F(LaneCancelTest, DeadlineAndCancelMidLayerFreeTheMemory) {
  absl::StatusOr<std::unique_ptr<client::Lane>> l = client::Lane::Open(c_.get());
  ASSERT_TRUE(l.ok()) << l.status();

  absl::StatusOr<v1::LayerResult> r =
      (*l)->Call(lane::kAttentionLayerRegions, layer_.Header(base_, 0), absl::Milliseconds(150));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_TRUE(WaitFor([&] { return Idle(); }, std::chrono::milliseconds(5000 * kSanitizerSlowdown)));

  // cancel_seq while the layer runs: the call stops, answers CANCELLED, and its memory returns.
  absl::Status cancelled;
  std::thread call([&] {
    cancelled = (*l)->Call(lane::kAttentionLayerRegions, layer_.Header(base_, 1), absl::Seconds(600)).status();
  });
  ASSERT_TRUE(WaitFor([&] {
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    return s->running() == 1 && s->pool_bytes() > weights_.pool_bytes();
  }));
  uint8_t* region = (*l)->region();
  __atomic_store_n(reinterpret_cast<uint32_t*>(region + lane::kCancelSeq),
                   __atomic_load_n(reinterpret_cast<uint32_t*>(region + lane::kRequestSeq), __ATOMIC_ACQUIRE),
                   __ATOMIC_RELEASE);
  call.join();
  EXPECT_EQ(cancelled.code(), absl::StatusCode::kCancelled) << cancelled;
  EXPECT_TRUE(WaitFor([&] { return Idle(); }, std::chrono::milliseconds(5000 * kSanitizerSlowdown)));
  EXPECT_TRUE(WaitFor([&] {
    return Sample(daemon_.Metrics(), "kvpack_requests_total{code=\"CANCELLED\",method=\"AttentionLayerLane\"}") == 1.0;
  }));
  // Still serving: the same layer runs to the end.
  EXPECT_TRUE((*l)->Call(lane::kAttentionLayerRegions, layer_.Header(base_, 2), absl::Seconds(600)).ok());
}

TEST(LaneLifetimeTest, ALaneIdleForTheLeaseClosesAndDrainingClosesTheRest) {
  DaemonProcess daemon({"--vram_budget=64Mi", "--lease_seconds=1", "--lane_spin_us=0"});
  ASSERT_TRUE(daemon.ok());
  auto c = daemon.Connect();
  absl::StatusOr<std::unique_ptr<client::Lane>> idle = client::Lane::Open(c.get());
  ASSERT_TRUE(idle.ok()) << idle.status();
  EXPECT_EQ((*idle)->opened().spin_us(), 0u);
  EXPECT_EQ((*idle)->opened().idle_close_seconds(), 1.0);
  EXPECT_TRUE(WaitFor([&] { return (*idle)->state() == lane::kStateClosed; },
                      std::chrono::milliseconds(5000 * kSanitizerSlowdown)));
  EXPECT_EQ(OpenLanes(*c), 0);

  DaemonProcess draining({"--vram_budget=64Mi"});
  ASSERT_TRUE(draining.ok());
  auto d = draining.Connect();
  absl::StatusOr<std::unique_ptr<client::Lane>> open = client::Lane::Open(d.get());
  ASSERT_TRUE(open.ok()) << open.status();
  uint8_t* region = (*open)->region();
  EXPECT_EQ(draining.Stop(), 0);  // SIGTERM: the lane closes, and the daemon still exits cleanly
  EXPECT_EQ(__atomic_load_n(reinterpret_cast<uint32_t*>(region + lane::kState), __ATOMIC_ACQUIRE), lane::kStateClosed);
}

}  // namespace
}  // namespace kvpack::testing
