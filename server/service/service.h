// The gRPC layer of kvpackd (callback API). Thin by design (STYLE.md §11): authorize, validate,
// convert, hand to the Engine, return the reactor; the executor finishes the call. Every status a
// client sees goes through ToGrpcStatus, and every finished call is counted in
// kvpack_requests_total{method, code}.
#pragma once

#include <atomic>
#include <cstdint>
#include <new>
#include <string>

#include "kvpack/v1/kvpack.grpc.pb.h"
#include "server/runtime/engine.h"
#include "server/service/auth.h"
#include "server/service/lane.h"

namespace kvpack::server {

// Shape limits of one request (INVALID_ARGUMENT naming the field when passed).
struct ServiceLimits {
  uint64_t max_inline_bytes = 16ull << 30;  // per request, all inline tensors together
  int64_t max_tokens = 1 << 22;             // N
  int max_hidden = 1 << 16;                 // D
  int max_heads = 1024;                     // H
  int64_t max_page_heads = 1ll << 24;       // (N / 64 + ranges) · H: page-table entries per layer
  // Messages of one streamed call (header and chunks): bounds the per-message work a client can
  // cause with empty chunks (RESOURCE_EXHAUSTED). 16 GiB in the clients' 1-2 MiB chunks is 16,384.
  int64_t max_chunks_per_call = 65536;
};

absl::Status CheckLimits(const LayerShape& shape, const ServiceLimits& limits);
// The RESOURCE_EXHAUSTED of a call that sent more than max_chunks_per_call chunks.
absl::Status TooManyChunks(const ServiceLimits& limits);

// The Plan RPC's work for `tenant`, without gRPC (the handler and fuzz/plan_fuzz.cc call it): the
// header converted, checked against `limits`, planned; the response filled when the status is OK.
absl::Status PlanCall(Engine& engine, const std::string& tenant, const ServiceLimits& limits,
                      const v1::PlanRequest& request, v1::PlanResponse* response);

class KvpackService final : public v1::Kvpack::CallbackService {
 public:
  KvpackService(Engine* engine, Auth auth, ServiceLimits limits, LaneLimits lane_limits = {});
  ~KvpackService() override;

  // Flips every later call to UNAVAILABLE (drain) and health to NOT_SERVING.
  void StartDraining() { draining_ = true; }
  bool draining() const { return draining_; }
  Engine& engine() { return *engine_; }
  const Auth& auth() const { return auth_; }
  const ServiceLimits& limits() const { return limits_; }
  // Closes every lane and waits for their threads (after draining, before the engine drains).
  void CloseLanes() { lanes_.CloseAll(); }

  // Inline tensor bytes received (uploads) and sent (layer outputs), all tenants, since start.
  void CountInline(uint64_t received, uint64_t sent) {
    inline_received_ += received;
    inline_sent_ += sent;
  }

  // The tenant of a call, or why not (auth, draining).
  absl::StatusOr<std::string> Admit(const grpc::CallbackServerContext& context) const;
  // Records the finished call in the metrics and converts its status.
  grpc::Status Finished(const char* method, const absl::Status& status);
  // A stream whose upload ended short: a client that half-closed early (INVALID_ARGUMENT) and one
  // whose connection died mid-upload can look the same to the daemon when the stream's end is seen
  // before the cancellation. Only in OnDone does gRPC say which (IsCancelled is settled there), so
  // such a call finishes with ToGrpcStatus alone and is counted here from its OnDone.
  void RecordShortUpload(const char* method, grpc::StatusCode finished, const grpc::CallbackServerContext& context);

  grpc::ServerReadReactor<v1::WeightsRequest>* RegisterWeights(grpc::CallbackServerContext* context,
                                                               v1::WeightsResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseWeights(grpc::CallbackServerContext* context, const v1::ReleaseRequest* request,
                                           v1::ReleaseResponse* response) override;
  grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse>* AttentionLayer(
      grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse>* Project(grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse>* Attend(grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* AttentionLayerRegions(grpc::CallbackServerContext* context, const v1::LayerHeader* header,
                                                  v1::LayerResult* result) override;
  grpc::ServerUnaryReactor* ProjectRegions(grpc::CallbackServerContext* context, const v1::LayerHeader* header,
                                           v1::LayerResult* result) override;
  grpc::ServerUnaryReactor* AttendRegions(grpc::CallbackServerContext* context, const v1::LayerHeader* header,
                                          v1::LayerResult* result) override;
  grpc::ServerUnaryReactor* ReleaseKv(grpc::CallbackServerContext* context, const v1::ReleaseRequest* request,
                                      v1::ReleaseResponse* response) override;
  grpc::ServerUnaryReactor* Plan(grpc::CallbackServerContext* context, const v1::PlanRequest* request,
                                 v1::PlanResponse* response) override;
  grpc::ServerUnaryReactor* RegisterPolicies(grpc::CallbackServerContext* context,
                                             const v1::RegisterPoliciesRequest* request,
                                             v1::RegisterPoliciesResponse* response) override;
  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* context, const v1::StatusRequest* request,
                                   v1::StatusResponse* response) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* context,
                                           const v1::RegisterRegionRequest* request,
                                           v1::RegisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* context,
                                             const v1::UnregisterRegionRequest* request,
                                             v1::UnregisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* RegionStatus(grpc::CallbackServerContext* context, const v1::RegionStatusRequest* request,
                                         v1::RegionStatusResponse* response) override;
  grpc::ServerUnaryReactor* OpenLane(grpc::CallbackServerContext* context, const v1::OpenLaneRequest* request,
                                     v1::OpenLaneResponse* response) override;
  grpc::ServerUnaryReactor* CloseLane(grpc::CallbackServerContext* context, const v1::CloseLaneRequest* request,
                                      v1::CloseLaneResponse* response) override;
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* context, const v1::KeepAliveRequest* request,
                                      v1::KeepAliveResponse* response) override;

 private:
  grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context, const char* method,
                                        const absl::Status& status);
  // Runs a unary handler's body; a std::bad_alloc from it finishes the call RESOURCE_EXHAUSTED
  // (counted) instead of escaping into gRPC. REQUIRES: the body throws before it finishes the call.
  template <typename Body>
  grpc::ServerUnaryReactor* Guarded(grpc::CallbackServerContext* context, const char* method, Body&& body) {
    try {
      return body();
    } catch (const std::bad_alloc&) {
      return FinishUnary(context, method, absl::ResourceExhaustedError("the daemon ran out of host memory for this call"));
    }
  }

  Engine* const engine_;
  const Auth auth_;
  const ServiceLimits limits_;
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> inline_received_{0};
  std::atomic<uint64_t> inline_sent_{0};
  LaneTable lanes_;  // last: its threads use the members above until they are joined
};

// Reactors of the streaming calls (layer_call.cc, weights_call.cc) and of the unary layer calls
// over regions (layer_regions_call.cc).
grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse>* NewLayerCall(KvpackService* service,
                                                                          grpc::CallbackServerContext* context,
                                                                          LayerMode mode);
grpc::ServerUnaryReactor* NewLayerRegionsCall(KvpackService* service, grpc::CallbackServerContext* context,
                                              LayerMode mode, const v1::LayerHeader* header, v1::LayerResult* result);
grpc::ServerReadReactor<v1::WeightsRequest>* NewWeightsCall(KvpackService* service,
                                                           grpc::CallbackServerContext* context,
                                                           v1::WeightsResponse* response);

}  // namespace kvpack::server
