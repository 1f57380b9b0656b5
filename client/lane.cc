#include "client/lane.h"

#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvpack::client {
namespace lane = v1::lane;
namespace {

// After its deadline a call is cancelled through cancel_seq and still gets an answer; a daemon
// that does not answer within this much more is taken for gone.
constexpr absl::Duration kCancelGrace = absl::Seconds(5);
constexpr absl::Duration kParkTick = absl::Milliseconds(10);

using lane::FutexWait;
using lane::FutexWake;
using lane::Load;
using lane::Store;

}  // namespace

absl::StatusOr<std::unique_ptr<Lane>> Lane::Open(Client* client, const LaneOptions& options) {
  auto l = std::unique_ptr<Lane>(new Lane(client, options));
  absl::StatusOr<std::unique_ptr<SharedMemory>> shm =
      SharedMemory::Create(lane::kAreasAt + 2ull * options.area_bytes);
  if (!shm.ok()) return shm.status();
  l->shm_ = *std::move(shm);
  uint8_t* base = l->shm_->data();
  Store(base, lane::kMagic, lane::kLaneMagic);
  Store(base, lane::kVersion, lane::kLaneVersion);
  Store(base, lane::kRequestArea, options.area_bytes);
  Store(base, lane::kAnswerArea, options.area_bytes);
  absl::StatusOr<std::string> region = client->RegisterShmRegion(l->shm_->name(), l->shm_->size());
  if (!region.ok()) return region.status();
  l->region_id_ = *region;
  grpc::ClientContext context;
  client->Prepare(&context);
  v1::OpenLaneRequest request;
  request.set_region_id(l->region_id_);
  request.set_spin_us(options.daemon_spin_us);
  if (grpc::Status s = client->stub()->OpenLane(&context, request, &l->opened_); !s.ok()) return FromGrpc(s);
  l->lane_id_ = l->opened_.lane_id();
  return l;
}

Lane::~Lane() {
  if (!lane_id_.empty()) {
    grpc::ClientContext context;
    client_->Prepare(&context, absl::Seconds(5));
    v1::CloseLaneRequest request;
    request.set_lane_id(lane_id_);
    v1::CloseLaneResponse response;
    (void)client_->stub()->CloseLane(&context, request, &response);
  }
  if (!region_id_.empty()) (void)client_->UnregisterRegion(region_id_);
}

uint32_t Lane::state() const { return Load(shm_->data(), lane::kState); }

absl::StatusOr<v1::LayerResult> Lane::Call(lane::LaneMethod method, const v1::LayerHeader& header,
                                           absl::Duration timeout) {
  const std::string bytes = header.SerializeAsString();
  if (bytes.size() > options_.area_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("header: ", bytes.size(), " bytes, above the lane's ",
                                                   options_.area_bytes, "-byte request area"));
  }
  absl::StatusOr<Answer> answer = CallRaw(method, bytes, static_cast<uint32_t>(bytes.size()), timeout);
  if (!answer.ok()) return answer.status();
  if (answer->code != 0) return absl::Status(static_cast<absl::StatusCode>(answer->code), answer->bytes);
  v1::LayerResult result;
  if (!result.ParseFromString(answer->bytes)) return absl::InternalError("lane answer: not a LayerResult");
  return result;
}

absl::StatusOr<Lane::Answer> Lane::CallRaw(uint32_t method, const std::string& bytes, uint32_t declared,
                                           absl::Duration timeout) {
  uint8_t* base = shm_->data();
  if (Load(base, lane::kState) != lane::kStateOpen) return absl::UnavailableError("lane closed");
  std::memcpy(base + lane::kAreasAt, bytes.data(), std::min<size_t>(bytes.size(), options_.area_bytes));
  Store(base, lane::kMethod, method);
  Store(base, lane::kRequestBytes, declared);
  const int64_t us = absl::ToInt64Microseconds(timeout);
  Store(base, lane::kTimeoutUs, us <= 0 ? 0 : static_cast<uint32_t>(std::min<int64_t>(us, UINT32_MAX)));
  uint32_t seq = Load(base, lane::kRequestSeq) + 1;
  if (seq == 0) seq = 1;
  Store(base, lane::kRequestSeq, seq);
  FutexWake(base, lane::kRequestSeq);

  const absl::Time start = absl::Now();
  const absl::Time deadline = timeout > absl::ZeroDuration() ? start + timeout : absl::InfiniteFuture();
  bool cancelled = false;
  while (true) {
    const uint32_t answered = Load(base, lane::kAnswerSeq);
    if (answered == seq) {
      Answer a;
      a.code = Load(base, lane::kCode);
      const uint32_t n = std::min(Load(base, lane::kAnswerBytes), options_.area_bytes);
      a.bytes.assign(reinterpret_cast<const char*>(base + lane::kAreasAt + options_.area_bytes), n);
      return a;
    }
    if (Load(base, lane::kState) == lane::kStateClosed) {
      return absl::UnavailableError("lane closed before it read the request");
    }
    const absl::Time now = absl::Now();
    if (now > deadline) {
      if (!cancelled) {
        Store(base, lane::kCancelSeq, seq);
        cancelled = true;
      } else if (now > deadline + kCancelGrace) {
        return absl::DeadlineExceededError("lane: no answer after the deadline and the cancellation");
      }
    }
    if (now - start > options_.spin) FutexWait(base, lane::kAnswerSeq, answered, absl::ToTimespec(kParkTick));
  }
}

}  // namespace kvpack::client
