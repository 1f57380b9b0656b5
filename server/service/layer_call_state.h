// What a layer call (AttentionLayer, Project, Attend, and their unary *Regions forms) does apart
// from moving messages: the header admitted, checked, planned and bound to its tensors; inline
// chunks received; the job submitted, cancelled and turned into a LayerResult; the final status
// named and counted. The reactors only move messages:
//
//   layer_call.cc          stream: header, inline chunks, half-close → result, output chunks
//   layer_regions_call.cc  unary:  LayerHeader → LayerResult (every tensor in a region)
//   lane.cc                the unary forms through a shared-memory lane (kvpack/v1/lane.h)
//
// so both forms share every check, limit, plan, scheduling path, metric and cancellation.
//
// Thread safety: Admit, OnHeader, OnChunk and Submit run on the reactor's callback threads, one at
// a time (gRPC serialises a call's reads); Cancel may run concurrently with any of them; Complete
// runs once, on the executor thread that finished the job, after Submit.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvpack/v1/kvpack.pb.h"
#include "server/runtime/engine.h"

namespace grpc {
class CallbackServerContext;
}  // namespace grpc

namespace kvpack::server {

class KvpackService;

// Which form of the call: the stream takes inline tensors; the unary form and its lane twin take
// regions only (INVALID_ARGUMENT naming the field of an inline tensor or an inline output).
enum class LayerTransport { kStream, kRegionsOnly, kLane };

// The method name of `mode` in `transport` ("AttentionLayer", "AttendRegions", ...): the metrics'
// method label and the name in error messages.
const char* LayerMethodName(LayerMode mode, LayerTransport transport);

class LayerCallState {
 public:
  LayerCallState(KvpackService* service, grpc::CallbackServerContext* context, LayerMode mode,
                 LayerTransport transport);
  // A call that came over a lane: `tenant` was admitted when the lane opened; `deadline` is the
  // request's (absl::InfiniteFuture() for none).
  LayerCallState(KvpackService* service, std::string tenant, absl::Time deadline, LayerMode mode);

  const char* method() const { return method_; }

  // The caller's tenant (auth, draining); the first call of every call.
  absl::Status Admit();
  // Validates `header`, plans the layer (failing fast when it cannot fit) and binds its tensors.
  absl::Status OnHeader(const v1::LayerHeader& header);
  bool have_header() const { return have_header_; }
  // One inline chunk (stream only): in order, inside the tensor the header declared inline.
  absl::Status OnChunk(const v1::TensorChunk& chunk);
  // Checks that every inline input arrived and hands the job to the Engine; `done` runs once with
  // the job's status on an executor thread (or the scheduler's pump on reject).
  // REQUIRES: OnHeader returned OK.
  absl::Status Submit(std::function<void(absl::Status)> done);
  // The client went away or cancelled: the job stops at its next check and frees its memory.
  void Cancel();
  // After the job's `done`: lets go of the handles and regions the job used (before the client
  // hears back, so a release it sends next frees their memory at once) and fills `result` when
  // the status stays OK. Returns the call's status.
  absl::Status Complete(absl::Status status, v1::LayerResult* result);

  // The output bytes that travel back inline (stream only; nullptr when none).
  const uint8_t* inline_output() const { return out_inline_; }
  uint64_t output_bytes() const;
  double upload_seconds() const { return upload_seconds_; }

  // The call's status: counted in the metrics, CANCELLED named DEADLINE_EXCEEDED when the
  // deadline is what ended it. Returns false (and does nothing) when the call already finished:
  // exactly one Finish per call.
  bool FinishOnce(absl::Status status, grpc::Status* out);
  // From the reactor's OnDone: counts a call that FinishOnce left uncounted (an upload that ended
  // short: KvpackService::RecordShortUpload).
  void OnDone();

 private:
  // One input tensor as the header declared it.
  struct Input {
    const char* field = "";
    uint64_t size = 0;        // expected bytes
    bool is_inline = false;
    uint8_t* data = nullptr;  // inline buffer or region slice
    uint64_t received = 0;    // inline bytes so far
    uint64_t align = 4;       // required alignment of a region slice
  };

  absl::Status BindInputs(const v1::LayerHeader& header, const LayerRequest& request, LayerJob* job);
  absl::Status BindOutput(const v1::LayerHeader& header, uint64_t out_size, LayerJob* job);
  absl::Status MatchKv(const KvEntry& kv, const LayerRequest& request, const WeightsEntry& w) const;
  absl::Status BindWaitEvent(const v1::LayerHeader& header, LayerJob* job);
  absl::Status BindDoneEvent(const v1::LayerHeader& header, const LayerRequest& request, LayerJob* job);
  bool InDeviceRegion(const std::string& region_id) const;
  bool InDeviceRegion(const v1::TensorRef& ref) const;
  absl::Status Bind(const v1::TensorRef& ref, Input* input, LayerJob* job, bool required);
  std::array<const Input*, 5> Inputs() const { return {&x_, &positions_, &qkv_[0], &qkv_[1], &qkv_[2]}; }

  KvpackService* const service_;
  grpc::CallbackServerContext* const context_;  // null for a lane call
  const absl::Time deadline_;
  const LayerMode mode_;
  const LayerTransport transport_;
  const char* const method_;
  std::string tenant_;
  bool have_header_ = false;
  Input x_, positions_;
  Input qkv_[3];  // header.projected q, k, v
  bool projected_ = false;
  uint8_t* out_inline_ = nullptr;
  int64_t chunks_ = 0;
  absl::Time header_start_;
  double upload_seconds_ = 0, plan_seconds_ = 0;
  std::atomic<bool> submitted_{false};
  std::mutex mu_;
  std::shared_ptr<LayerJob> job_;
  bool cancelled_ = false;
  bool finished_ = false;
  bool short_upload_ = false;  // Submit found an inline input or the header missing
  std::optional<grpc::StatusCode> uncounted_;  // FinishOnce's code, counted in OnDone
};

}  // namespace kvpack::server
