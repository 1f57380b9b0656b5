#include "server/service/lane.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <new>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvpack/v1/lane.h"
#include "server/runtime/bounded.h"
#include "server/service/layer_call_state.h"
#include "server/service/service.h"
#include "server/service/upload.h"

namespace kvpack::server {
namespace lane = v1::lane;
namespace {

using lane::FutexWait;
using lane::FutexWake;
using lane::Load;
using lane::Store;

// While parked the lane thread wakes this often to see a close request, draining, a truncated
// region or the idle limit; a request wakes it at once (the client's FUTEX_WAKE).
constexpr absl::Duration kParkTick = absl::Milliseconds(100);
// While a call runs the lane thread looks at cancel_seq this often.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(1);

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

bool ModeOf(uint32_t method, LayerMode* mode) {
  switch (method) {
    case lane::kAttentionLayerRegions: *mode = LayerMode::kFull; return true;
    case lane::kProjectRegions: *mode = LayerMode::kProject; return true;
    case lane::kAttendRegions: *mode = LayerMode::kAttend; return true;
  }
  return false;
}

}  // namespace

// One lane: its thread, its region, its tenant. Created by LaneTable::Open with the region checked.
class Lane {
 public:
  Lane(KvpackService* service, std::string tenant, std::string region_id, RegionUse region, uint8_t* base,
       uint32_t request_area, uint32_t answer_area, absl::Duration spin, absl::Duration idle_limit)
      : service_(service),
        tenant_(std::move(tenant)),
        region_id_(std::move(region_id)),
        region_(std::move(region)),
        base_(base),
        request_area_(request_area),
        answer_area_(answer_area),
        spin_(spin),
        idle_limit_(idle_limit) {
    last_ = Load(base_, lane::kRequestSeq);  // requests start after OpenLane's answer
    Store(base_, lane::kAnswerSeq, last_);
    Store(base_, lane::kState, lane::kStateOpen);
  }
  ~Lane() {
    Stop();
    if (thread_.joinable()) thread_.join();
  }
  // REQUIRES: called once, right after construction. Throws std::system_error when no thread starts.
  void Start() { thread_ = std::thread([this] { Run(); }); }
  void Stop() {
    stop_ = true;
    if (!finished_) FutexWake(base_, lane::kRequestSeq);  // a parked thread sees stop_ at once
  }
  bool finished() const { return finished_; }
  // Asked to close (CloseLane, its region unregistered, the table closing) or closing on its own
  // (idle, draining, a truncated region); its thread may still be answering the call in flight.
  bool stopping() const { return stop_; }
  const std::string& tenant() const { return tenant_; }
  const std::string& region_id() const { return region_id_; }

 private:
  void Run() {
    while (Wait()) {
      try {
        Serve(last_);
      } catch (const std::bad_alloc&) {  // before the call was submitted (Serve catches it after)
        WriteAnswer(last_, grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, ""), nullptr);
      }
    }
    stop_ = true;  // no longer counted open, before the client can see it closed
    Store(base_, lane::kState, lane::kStateClosed);
    FutexWake(base_, lane::kAnswerSeq);  // a client parked on its answer sees the lane closed
    region_ = RegionUse();               // an UnregisterRegion waiting for this lane completes
    finished_ = true;
  }

  // Waits for request_seq to move past last_; false when the lane should close.
  bool Wait() {
    const absl::Time spin_until = absl::Now() + spin_;
    while (true) {
      if (stop_ || service_->draining()) return false;
      const uint32_t seq = Load(base_, lane::kRequestSeq);
      if (seq != last_) {
        last_ = seq;
        return true;
      }
      if (absl::Now() < spin_until) {
        CpuRelax();
        continue;
      }
      if (!region_.get()->Intact().ok() || absl::Now() - last_call_ > idle_limit_) return false;
      FutexWait(base_, lane::kRequestSeq, last_, absl::ToTimespec(kParkTick));
    }
  }

  void Serve(uint32_t seq) {
    last_call_ = absl::Now();
    const uint32_t method = Load(base_, lane::kMethod);
    const uint32_t bytes = Load(base_, lane::kRequestBytes);
    const uint32_t timeout_us = Load(base_, lane::kTimeoutUs);
    LayerMode mode = LayerMode::kFull;
    if (!ModeOf(method, &mode)) {
      Reject(seq, "AttentionLayerLane",
             absl::InvalidArgumentError(absl::StrCat("lane method = ", method,
                                                     ": expected 0 (AttentionLayerRegions), 1 (ProjectRegions) or 2 "
                                                     "(AttendRegions)")));
      return;
    }
    const char* name = LayerMethodName(mode, LayerTransport::kLane);
    if (bytes > request_area_) {
      Reject(seq, name, absl::InvalidArgumentError(absl::StrCat("lane request_bytes = ", bytes, ": above the lane's ",
                                                                request_area_, "-byte request area")));
      return;
    }
    // Copied out before parsing: the client can write the area at any time.
    absl::StatusOr<uint8_t*> area = region_.get()->Slice(lane::kAreasAt, request_area_, "lane request area");
    v1::LayerHeader header;
    absl::Status parsed = area.status();
    if (parsed.ok()) {
      parsed = CatchAllocationFailure([&] {
        const std::string copy(reinterpret_cast<const char*>(*area), bytes);
        return header.ParseFromString(copy) ? absl::OkStatus()
                                            : absl::InvalidArgumentError(absl::StrCat(
                                                  "lane request: its ", bytes, " bytes are not a LayerHeader"));
      });
    }
    if (!parsed.ok()) {
      Reject(seq, name, parsed);
      return;
    }
    (void)service_->engine().registry().KeepAlive(tenant_, {region_id_});  // a lane in use keeps its region

    const absl::Time deadline =
        timeout_us == 0 ? absl::InfiniteFuture() : last_call_ + absl::Microseconds(timeout_us);
    LayerCallState state(service_, tenant_, deadline, mode);
    v1::LayerResult result;
    std::mutex mu;
    std::condition_variable cv;
    bool answered = false;
    std::atomic<bool> claimed{false};
    // Exactly one answer per request, even when an allocation fails on the way to it (the lane
    // thread waits for it): the first call claims it; a std::bad_alloc inside becomes
    // RESOURCE_EXHAUSTED without a message.
    auto finish = [&](absl::Status status, bool with_result) {
      if (claimed.exchange(true)) return;
      grpc::Status out(grpc::StatusCode::RESOURCE_EXHAUSTED, "");
      try {
        if (status.ok() && with_result && result.ByteSizeLong() > answer_area_) {
          status = absl::ResourceExhaustedError(absl::StrCat("the LayerResult is ", result.ByteSizeLong(),
                                                             " bytes; the lane's answer area holds ", answer_area_));
        }
        (void)state.FinishOnce(std::move(status), &out);  // the only FinishOnce of this call
      } catch (const std::bad_alloc&) {
        out = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "");
      }
      WriteAnswer(seq, out, out.ok() ? &result : nullptr);
      std::lock_guard<std::mutex> lock(mu);
      answered = true;
      cv.notify_one();
    };
    const absl::Status s = CatchAllocationFailure([&] {
      if (absl::Status s = state.Admit(); !s.ok()) return s;
      if (absl::Status s = state.OnHeader(header); !s.ok()) return s;
      return state.Submit([&](absl::Status status) {
        const absl::Status s = CatchAllocationFailure([&] {
          finish(state.Complete(std::move(status), &result), true);
          return absl::OkStatus();
        });
        if (!s.ok()) finish(s, false);
      });
    });
    if (!s.ok()) finish(s, false);

    // One call at a time: the next request is read after this answer. Meanwhile cancel_seq = seq
    // cancels it (the job stops at its next check and still answers).
    bool cancelled = false;
    std::unique_lock<std::mutex> lock(mu);
    while (!cv.wait_for(lock, absl::ToChronoMilliseconds(kCancelPoll), [&] { return answered; })) {
      if (!cancelled && Load(base_, lane::kCancelSeq) == seq) {
        cancelled = true;
        lock.unlock();
        state.Cancel();
        lock.lock();
      }
    }
  }

  // An answer for a request that never became a call (counted under `method`).
  void Reject(uint32_t seq, const char* method, const absl::Status& status) {
    WriteAnswer(seq, service_->Finished(method, status), nullptr);
  }

  void WriteAnswer(uint32_t seq, const grpc::Status& status, const v1::LayerResult* result) {
    uint8_t* const area = base_ + lane::kAreasAt + request_area_;
    uint32_t bytes = 0;
    if (result != nullptr) {
      bytes = static_cast<uint32_t>(result->ByteSizeLong());  // ≤ answer_area_: checked in finish
      result->SerializeWithCachedSizesToArray(area);
    } else {
      const std::string& message = status.error_message();
      bytes = static_cast<uint32_t>(std::min<size_t>(message.size(), answer_area_));
      std::memcpy(area, message.data(), bytes);
    }
    Store(base_, lane::kCode, static_cast<uint32_t>(status.error_code()));
    Store(base_, lane::kAnswerBytes, bytes);
    Store(base_, lane::kAnswerSeq, seq);
    FutexWake(base_, lane::kAnswerSeq);
  }

  KvpackService* const service_;
  const std::string tenant_, region_id_;
  RegionUse region_;
  uint8_t* const base_;
  const uint32_t request_area_, answer_area_;
  const absl::Duration spin_, idle_limit_;
  uint32_t last_ = 0;                      // the last request_seq seen (lane thread only)
  absl::Time last_call_ = absl::Now();     // lane thread only
  std::atomic<bool> stop_{false};
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

LaneTable::LaneTable(KvpackService* service, LaneLimits limits) : service_(service), limits_(limits) {}

LaneTable::~LaneTable() { CloseAll(); }

absl::StatusOr<v1::OpenLaneResponse> LaneTable::Open(const std::string& tenant, const v1::OpenLaneRequest& request) {
  if (request.region_id().empty()) return absl::InvalidArgumentError("region_id: required");
  Registry& registry = service_->engine().registry();
  absl::StatusOr<RegionUse> use = registry.UseRegion(tenant, request.region_id(), "region_id");
  if (!use.ok()) return use.status();
  Region* const region = use->get();
  if (region->kind() != RegionKind::kShm) {
    return absl::InvalidArgumentError("region_id: a lane needs a REGION_SHM region; this one is CUDA IPC");
  }
  absl::StatusOr<uint8_t*> base = region->Slice(0, lane::kAreasAt, "region_id (the lane's first 4096 bytes)");
  if (!base.ok()) return base.status();
  const uint32_t magic = Load(*base, lane::kMagic), version = Load(*base, lane::kVersion);
  const uint32_t request_area = Load(*base, lane::kRequestArea), answer_area = Load(*base, lane::kAnswerArea);
  if (magic != lane::kLaneMagic || version != lane::kLaneVersion) {
    return absl::InvalidArgumentError(absl::StrCat("region_id: no lane layout at byte 0 (magic ", magic, ", version ",
                                                   version, "; expected ", lane::kLaneMagic, ", ", lane::kLaneVersion,
                                                   ": kvpack/v1/lane.h)"));
  }
  for (const auto& [field, bytes] : {std::pair<const char*, uint32_t>{"request", request_area}, {"answer", answer_area}}) {
    if (bytes < lane::kMinArea || bytes > lane::kMaxArea) {
      return absl::InvalidArgumentError(absl::StrCat("region_id: the lane's ", field, " area is ", bytes,
                                                     " bytes; expected ", lane::kMinArea, " to ", lane::kMaxArea));
    }
  }
  absl::StatusOr<uint8_t*> whole =
      region->Slice(0, lane::kAreasAt + uint64_t{request_area} + answer_area, "region_id (the lane's areas)");
  if (!whole.ok()) return whole.status();

  std::lock_guard<std::mutex> lock(mu_);
  ReapLocked();
  int of_tenant = 0;
  for (const auto& [id, l] : lanes_) {  // region ids are unique across tenants
    if (l->tenant() == tenant) ++of_tenant;
    if (l->region_id() == request.region_id()) {
      return absl::FailedPreconditionError(absl::StrCat("region_id: already carries lane ", id));
    }
  }
  if (static_cast<int>(lanes_.size()) >= limits_.max_lanes) {
    return absl::ResourceExhaustedError(absl::StrCat("lanes: ", lanes_.size(), " open, the daemon's limit (--max_lanes)"));
  }
  if (of_tenant >= limits_.max_lanes_per_tenant) {
    return absl::ResourceExhaustedError(
        absl::StrCat("lanes: ", of_tenant, " open for this tenant, its limit (--max_lanes_per_tenant)"));
  }
  const uint32_t spin_us =
      request.spin_us() == 0 ? limits_.max_spin_us : std::min(request.spin_us(), limits_.max_spin_us);
  const absl::Duration idle = registry.lease();
  std::string id = Registry::NewId("l-");
  auto l = std::make_unique<Lane>(service_, tenant, request.region_id(), *std::move(use), *whole, request_area,
                                  answer_area, absl::Microseconds(spin_us), idle);
  try {
    l->Start();
  } catch (const std::system_error&) {
    return absl::ResourceExhaustedError("lanes: the daemon could not start a thread for the lane");
  }
  lanes_.emplace(id, std::move(l));
  v1::OpenLaneResponse response;
  response.set_lane_id(id);
  response.set_spin_us(spin_us);
  response.set_request_area_bytes(request_area);
  response.set_answer_area_bytes(answer_area);
  response.set_idle_close_seconds(absl::ToDoubleSeconds(idle));
  return response;
}

absl::Status LaneTable::Close(const std::string& tenant, const std::string& lane_id) {
  if (lane_id.empty()) return absl::InvalidArgumentError("lane_id: required");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = lanes_.find(lane_id);
  if (it == lanes_.end() || it->second->tenant() != tenant) {
    return absl::NotFoundError(absl::StrCat("lane_id = \"", Bounded(lane_id), "\": no such lane for this tenant"));
  }
  it->second->Stop();
  ReapLocked();
  return absl::OkStatus();
}

void LaneTable::CloseRegion(const std::string& tenant, const std::string& region_id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, l] : lanes_) {
    if (l->tenant() == tenant && l->region_id() == region_id) l->Stop();
  }
  ReapLocked();
}

void LaneTable::CloseAll() {
  std::map<std::string, std::unique_ptr<Lane>> lanes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lanes.swap(lanes_);
  }
  for (auto& [id, l] : lanes) l->Stop();
  lanes.clear();  // joins: each thread answers its call in flight first
}

int LaneTable::Count() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& [id, l] : lanes_) n += l->finished() || l->stopping() ? 0 : 1;
  return n;
}

void LaneTable::ReapLocked() {
  for (auto it = lanes_.begin(); it != lanes_.end();) {
    it = it->second->finished() ? lanes_.erase(it) : std::next(it);
  }
}

}  // namespace kvpack::server
