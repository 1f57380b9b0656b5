// Lanes (kvpack/v1/lane.h): the unary layer calls through a shared-memory region that a daemon
// thread watches, for callers on the daemon's host. A transport like the gRPC reactors: it moves
// bytes in and out and hands every call to a LayerCallState, so lane calls share every check,
// limit, plan, scheduling path, metric (method "AttentionLayerLane", ...) and cancellation.
//
//   OpenLane (gRPC, authenticated) → a Lane thread bound to (tenant, shm region)
//   lane thread: spin on request_seq for the spin window after each answer, then FUTEX_WAIT
//     (100 ms ticks: close requests, draining, the idle limit) → copy ≤ R request bytes out of the
//     region, parse a LayerHeader, Admit → OnHeader → Submit
//   executor thread (the job's done): Complete → answer bytes, code, answer_seq, FUTEX_WAKE
//
// Nothing in the region is trusted: the sizes are read once at open, every request is copied out
// before it is parsed, and an answer that does not fit the answer area becomes RESOURCE_EXHAUSTED.
// A lane holds its region (RegionUse) while it runs; unregistering the region closes the lane
// first (after the call in flight), so the unregister completes.
//
// Thread safety: LaneTable's methods are thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpack/v1/kvpack.pb.h"

namespace kvpack::server {

class KvpackService;
class Lane;

struct LaneLimits {
  int max_lanes = 8;             // all tenants (--max_lanes); each is a thread
  int max_lanes_per_tenant = 2;  // --max_lanes_per_tenant
  uint32_t max_spin_us = 20000;  // --lane_spin_us: the default spin window and its ceiling
};

class LaneTable {
 public:
  LaneTable(KvpackService* service, LaneLimits limits);
  // Closes every lane and waits for their threads (each answers its call in flight first).
  ~LaneTable();

  const LaneLimits& limits() const { return limits_; }
  // Opens a lane of `tenant` over its shared-memory region `request.region_id`.
  absl::StatusOr<v1::OpenLaneResponse> Open(const std::string& tenant, const v1::OpenLaneRequest& request);
  // Closes the lane (its call in flight is answered first). NOT_FOUND for another tenant's id.
  absl::Status Close(const std::string& tenant, const std::string& lane_id);
  // Asks every lane of `tenant` over `region_id` to close; returns at once.
  void CloseRegion(const std::string& tenant, const std::string& region_id);
  // Closes every lane and waits for their threads (draining, shutdown).
  void CloseAll();
  // Lanes open: neither closed nor asked to close (so a CloseLane shows at once).
  int Count() const;

 private:
  // Joins the threads of lanes that have closed on their own (idle, region gone). REQUIRES: mu_.
  void ReapLocked();

  KvpackService* const service_;
  const LaneLimits limits_;
  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<Lane>> lanes_;  // by lane id
};

}  // namespace kvpack::server
