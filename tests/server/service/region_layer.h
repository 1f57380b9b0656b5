// Test helpers of the region-only layer calls (layer_regions_call_test.cc, lane_test.cc): a layer's
// tensors in one shared-memory region, and one unary *Regions call through the stub.
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/synthetic.h"
#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {

// One unary call through the stub, with the client's deadline and metadata.
inline absl::StatusOr<v1::LayerResult> Unary(client::Client& c, const std::string& method, const v1::LayerHeader& header,
                                      absl::Duration timeout = absl::ZeroDuration()) {
  grpc::ClientContext context;
  c.Prepare(&context, timeout);
  v1::LayerResult result;
  grpc::Status s = method == "ProjectRegions" ? c.stub()->ProjectRegions(&context, header, &result)
                   : method == "AttendRegions" ? c.stub()->AttendRegions(&context, header, &result)
                                               : c.stub()->AttentionLayerRegions(&context, header, &result);
  if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  return result;
}

// A layer's x and positions in one shared-memory region, with room for three outputs after them.
class RegionLayer {
 public:
  explicit RegionLayer(const client::SyntheticLayer& L) : L_(L) {
    x_bytes_ = L.x.size() * 2;
    pos_bytes_ = L.positions.size() * 4;
    out_at_ = (x_bytes_ + pos_bytes_ + 63) / 64 * 64;
    absl::StatusOr<std::unique_ptr<client::SharedMemory>> shm = client::SharedMemory::Create(out_at_ + 3 * out_bytes());
    EXPECT_TRUE(shm.ok()) << shm.status();
    shm_ = std::move(*shm);
    std::memcpy(shm_->data(), L.x.data(), x_bytes_);
    std::memcpy(shm_->data() + x_bytes_, L.positions.data(), pos_bytes_);
  }
  absl::Status Register(client::Client& c) {
    absl::StatusOr<std::string> id = c.RegisterShmRegion(shm_->name(), shm_->size());
    if (!id.ok()) return id.status();
    region_ = *id;
    return absl::OkStatus();
  }
  uint64_t out_bytes() const { return L_.out_bytes(); }
  const std::string& region() const { return region_; }
  // `base` with x and positions in the region and the output into slot `slot` (0..2).
  v1::LayerHeader Header(v1::LayerHeader base, int slot) const {
    SetSlice(base.mutable_x()->mutable_region(), 0, x_bytes_);
    SetSlice(base.mutable_positions()->mutable_region(), x_bytes_, pos_bytes_);
    base.mutable_output()->set_mode(v1::OUTPUT_REGION);
    SetSlice(base.mutable_output()->mutable_region(), out_at_ + slot * out_bytes(), out_bytes());
    return base;
  }
  std::vector<uint16_t> Output(int slot) const {
    std::vector<uint16_t> out(out_bytes() / 2);
    std::memcpy(out.data(), shm_->data() + out_at_ + slot * out_bytes(), out_bytes());
    return out;
  }

 private:
  void SetSlice(v1::RegionSlice* s, uint64_t offset, uint64_t size) const {
    s->set_region_id(region_);
    s->set_offset(offset);
    s->set_size_bytes(size);
  }
  const client::SyntheticLayer& L_;
  uint64_t x_bytes_ = 0, pos_bytes_ = 0, out_at_ = 0;
  std::unique_ptr<client::SharedMemory> shm_;
  std::string region_;
};

// A daemon of the test's own with a synthetic layer's weights registered and its x and positions
// in a region (layer_regions_call_test.cc, lane_test.cc). `flags` may size the daemon to the layer.
class RegionLayerTest : public ::testing::Test {
 protected:
  using Flags = std::vector<std::string> (*)(const client::SyntheticLayer&);
  RegionLayerTest(const client::SyntheticSpec& spec, Flags flags)
      : L_(client::MakeSyntheticLayer(spec)), daemon_(flags(L_)), layer_(L_) {}

  void SetUp() override {
    ASSERT_TRUE(daemon_.ok()) << daemon_.why();
    c_ = daemon_.Connect();
    absl::StatusOr<v1::WeightsResponse> w = c_->RegisterWeights(WeightsOf(L_));
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = *w;
    base_ = L_.header;
    base_.set_weights_handle(w->handle());
    ASSERT_TRUE(layer_.Register(*c_).ok());
  }
  // The weights alone in the pool, nothing running or queued.
  bool Idle() {
    absl::StatusOr<v1::StatusResponse> s = c_->Status();
    return s.ok() && s->pool_bytes() == weights_.pool_bytes() && s->reserved_bytes() == 0 && s->running() == 0 &&
           s->queue_depth() == 0;
  }

  const client::SyntheticLayer L_;
  DaemonProcess daemon_;
  RegionLayer layer_;
  std::unique_ptr<client::Client> c_;
  v1::WeightsResponse weights_;
  v1::LayerHeader base_;
};

// LongSpec's layer (~0.5 s) with room for two such layers in chunks of 256: the deadline and cancel
// tests of the unary call and of the lane.
class LongRegionLayerTest : public RegionLayerTest {
 protected:
  LongRegionLayerTest()
      : RegionLayerTest(LongSpec(), [](const client::SyntheticLayer& L) {
          return std::vector<std::string>{"--vram_budget=" + std::to_string(WeightsPoolBytes(L) + 2 * LayerPeakBytes(L, 256)),
                                          "--max_chunk_tokens=256"};
        }) {}
};

}  // namespace kvpack::testing
