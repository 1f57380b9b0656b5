// The client side of a lane (proto/kvpack/v1/lane.h): the unary layer calls through a registered
// shared-memory object that a daemon thread watches, for a client on the daemon's host. The Python
// client's kvpack.lane is its twin; tests drive the daemon's lane through this one.
//
// Thread safety: Call and CallRaw run one at a time (a lane carries one call at a time); the
// caller serialises them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "kvpack/v1/lane.h"

namespace kvpack::client {

struct LaneOptions {
  uint32_t area_bytes = 256 << 10;  // each of the request and answer areas
  uint32_t daemon_spin_us = 0;      // OpenLaneRequest.spin_us (0: the daemon's --lane_spin_us)
  // How long a call spins on its answer before it sleeps on the futex.
  absl::Duration spin = absl::Milliseconds(1);
};

class Lane {
 public:
  // Creates the object, registers it and opens the lane. REQUIRES: client outlives the lane.
  static absl::StatusOr<std::unique_ptr<Lane>> Open(Client* client, const LaneOptions& options = {});
  // CloseLane, UnregisterRegion, then the object is unlinked (errors ignored: the daemon may be gone).
  ~Lane();

  // The *Regions form of `method` with `header`; the daemon's status on error. UNAVAILABLE
  // ("lane closed") when the daemon closed the lane before it read the request.
  absl::StatusOr<v1::LayerResult> Call(v1::lane::LaneMethod method, const v1::LayerHeader& header,
                                       absl::Duration timeout);
  // The protocol itself, for tests: `bytes` copied into the request area (at most its size),
  // `declared` written as request_bytes, `method` as is. Returns the answer's code and bytes.
  struct Answer {
    uint32_t code = 0;
    std::string bytes;
  };
  absl::StatusOr<Answer> CallRaw(uint32_t method, const std::string& bytes, uint32_t declared, absl::Duration timeout);

  const std::string& lane_id() const { return lane_id_; }
  const std::string& region_id() const { return region_id_; }
  const v1::OpenLaneResponse& opened() const { return opened_; }
  uint8_t* region() const { return shm_->data(); }  // tests: write where a client should not
  uint32_t state() const;

 private:
  Lane(Client* client, const LaneOptions& options) : client_(client), options_(options) {}

  Client* const client_;
  const LaneOptions options_;
  std::unique_ptr<SharedMemory> shm_;
  std::string region_id_, lane_id_;
  v1::OpenLaneResponse opened_;
};

}  // namespace kvpack::client
