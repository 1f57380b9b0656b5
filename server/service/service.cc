#include "server/service/service.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/core/policy_parse.h"
#include "server/runtime/bounded.h"
#include "server/service/convert.h"
#include "server/service/status_map.h"

namespace kvpack::server {

absl::Status CheckLimits(const LayerShape& shape, const ServiceLimits& limits) {
  if (shape.n_tokens > limits.max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.shape.n_tokens = ", shape.n_tokens, " exceeds this daemon's limit of ", limits.max_tokens));
  }
  if (shape.hidden > limits.max_hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.shape.hidden = ", shape.hidden, " exceeds this daemon's limit of ", limits.max_hidden));
  }
  if (shape.n_heads > limits.max_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.shape.n_heads = ", shape.n_heads, " exceeds this daemon's limit of ", limits.max_heads));
  }
  // The page tables (and planning them) grow with pages × heads; bound them before anything is laid
  // out (the MiniMax H3 layer has 2,380 pages × 56 heads ≈ 1.3e5).
  const int64_t pages = shape.n_tokens / kPageTokens + kMaxRanges;
  if (shape.n_heads > 0 && pages * shape.n_heads > limits.max_page_heads) {
    return absl::InvalidArgumentError(absl::StrCat("header.shape: ~", pages, " pages x ", shape.n_heads,
                                                   " heads exceeds this daemon's limit of ", limits.max_page_heads,
                                                   " page tables entries"));
  }
  return absl::OkStatus();
}

absl::Status TooManyChunks(const ServiceLimits& limits) {
  return absl::ResourceExhaustedError(absl::StrCat("chunk: more than ", limits.max_chunks_per_call,
                                                   " chunks in one call (--max_chunks_per_call); send larger chunks"));
}

KvpackService::KvpackService(Engine* engine, Auth auth, ServiceLimits limits, LaneLimits lane_limits)
    : engine_(engine), auth_(std::move(auth)), limits_(limits), lanes_(this, lane_limits) {
  engine_->SetLaneCount([this] { return lanes_.Count(); });
}

KvpackService::~KvpackService() { engine_->SetLaneCount(nullptr); }

absl::StatusOr<std::string> KvpackService::Admit(const grpc::CallbackServerContext& context) const {
  if (draining_) return absl::UnavailableError("kvpackd is draining before it exits");
  return auth_.Authorize(context);
}

grpc::Status KvpackService::Finished(const char* method, const absl::Status& status) {
  grpc::Status out = ToGrpcStatus(status);
  engine_->metrics().RecordRequest(method, GrpcCodeName(out.error_code()));
  return out;
}

void KvpackService::RecordShortUpload(const char* method, grpc::StatusCode finished,
                                      const grpc::CallbackServerContext& context) {
  const grpc::StatusCode counted = context.IsCancelled() ? grpc::StatusCode::CANCELLED : finished;
  engine_->metrics().RecordRequest(method, GrpcCodeName(counted));
}

grpc::ServerUnaryReactor* KvpackService::FinishUnary(grpc::CallbackServerContext* context, const char* method,
                                                     const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(Finished(method, status));
  return reactor;
}

grpc::ServerReadReactor<v1::WeightsRequest>* KvpackService::RegisterWeights(grpc::CallbackServerContext* context,
                                                                            v1::WeightsResponse* response) {
  return NewWeightsCall(this, context, response);
}

grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse>* KvpackService::AttentionLayer(
    grpc::CallbackServerContext* context) {
  return NewLayerCall(this, context, LayerMode::kFull);
}

grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse>* KvpackService::Project(
    grpc::CallbackServerContext* context) {
  return NewLayerCall(this, context, LayerMode::kProject);
}

grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse>* KvpackService::Attend(
    grpc::CallbackServerContext* context) {
  return NewLayerCall(this, context, LayerMode::kAttend);
}

grpc::ServerUnaryReactor* KvpackService::AttentionLayerRegions(grpc::CallbackServerContext* context,
                                                               const v1::LayerHeader* header, v1::LayerResult* result) {
  return NewLayerRegionsCall(this, context, LayerMode::kFull, header, result);
}

grpc::ServerUnaryReactor* KvpackService::ProjectRegions(grpc::CallbackServerContext* context,
                                                        const v1::LayerHeader* header, v1::LayerResult* result) {
  return NewLayerRegionsCall(this, context, LayerMode::kProject, header, result);
}

grpc::ServerUnaryReactor* KvpackService::AttendRegions(grpc::CallbackServerContext* context,
                                                       const v1::LayerHeader* header, v1::LayerResult* result) {
  return NewLayerRegionsCall(this, context, LayerMode::kAttend, header, result);
}

grpc::ServerUnaryReactor* KvpackService::ReleaseWeights(grpc::CallbackServerContext* context,
                                                        const v1::ReleaseRequest* request, v1::ReleaseResponse*) {
  absl::StatusOr<std::string> tenant = Admit(*context);
  if (!tenant.ok()) return FinishUnary(context, "ReleaseWeights", tenant.status());
  return FinishUnary(context, "ReleaseWeights", engine_->registry().ReleaseWeights(*tenant, request->handle()));
}

grpc::ServerUnaryReactor* KvpackService::ReleaseKv(grpc::CallbackServerContext* context,
                                                   const v1::ReleaseRequest* request, v1::ReleaseResponse*) {
  absl::StatusOr<std::string> tenant = Admit(*context);
  if (!tenant.ok()) return FinishUnary(context, "ReleaseKv", tenant.status());
  return FinishUnary(context, "ReleaseKv", engine_->registry().ReleaseKv(*tenant, request->handle()));
}

absl::Status PlanCall(Engine& engine, const std::string& tenant, const ServiceLimits& limits,
                      const v1::PlanRequest& request, v1::PlanResponse* response) {
  const v1::LayerHeader& header = request.header();
  bool has_bias = request.has_bias();
  int norm_len = header.options().qk_norm().weight_len();
  if (!header.weights_handle().empty()) {
    absl::StatusOr<std::shared_ptr<WeightsEntry>> w =
        engine.registry().GetWeights(tenant, header.weights_handle(), "header.weights_handle");
    if (!w.ok()) return w.status();
    has_bias = (*w)->has_bias;
    norm_len = (*w)->norm_len;
  }
  absl::StatusOr<LayerRequest> layer = LayerRequestFromProto(header, has_bias, norm_len);
  if (!layer.ok()) return layer.status();
  if (absl::Status s = CheckLimits(layer->shape, limits); !s.ok()) return s;
  if (absl::Status s = engine.policies().Resolve(&*layer); !s.ok()) return s;
  if (request.has_sample()) {
    if (absl::Status s = EstimateFromSampleProto(request.sample(), &*layer); !s.ok()) return s;
  }
  absl::StatusOr<LayerPlan> plan = engine.Plan(tenant, *layer);
  if (!plan.ok()) return plan.status();
  response->set_fits(plan->fits);
  response->set_reason(plan->reason);
  PlanToProto(*plan, response->mutable_plan());
  response->mutable_plan()->set_mma(MmaPathName(engine.backend().ResolvedMma(plan->config)));
  if (layer->estimate.present) EstimateToProto(layer->estimate, response->mutable_plan()->mutable_estimated_rel_error());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* KvpackService::Plan(grpc::CallbackServerContext* context, const v1::PlanRequest* request,
                                              v1::PlanResponse* response) {
  return Guarded(context, "Plan", [&]() -> grpc::ServerUnaryReactor* {
    constexpr char kMethod[] = "Plan";
    absl::StatusOr<std::string> tenant = Admit(*context);
    if (!tenant.ok()) return FinishUnary(context, kMethod, tenant.status());
    return FinishUnary(context, kMethod, PlanCall(*engine_, *tenant, limits_, *request, response));
  });
}

grpc::ServerUnaryReactor* KvpackService::RegisterPolicies(grpc::CallbackServerContext* context,
                                                          const v1::RegisterPoliciesRequest* request,
                                                          v1::RegisterPoliciesResponse* response) {
  return Guarded(context, "RegisterPolicies", [&]() -> grpc::ServerUnaryReactor* {
    constexpr char kMethod[] = "RegisterPolicies";
    absl::StatusOr<std::string> tenant = Admit(*context);
    if (!tenant.ok()) return FinishUnary(context, kMethod, tenant.status());
    absl::StatusOr<std::vector<Policy>> policies = ParsePolicies(request->text());
    if (!policies.ok()) {
      return FinishUnary(context, kMethod,
                         absl::InvalidArgumentError(absl::StrCat("text: ", policies.status().message())));
    }
    for (const Policy& p : *policies) response->add_names(p.name);
    return FinishUnary(context, kMethod, engine_->policies().Add(std::move(*policies)));
  });
}

grpc::ServerUnaryReactor* KvpackService::Status(grpc::CallbackServerContext* context, const v1::StatusRequest*,
                                                v1::StatusResponse* response) {
  return Guarded(context, "Status", [&]() -> grpc::ServerUnaryReactor* {
    absl::StatusOr<std::string> tenant = Admit(*context);
    if (!tenant.ok()) return FinishUnary(context, "Status", tenant.status());
    Engine& e = *engine_;
    const PoolSnapshot s = e.pool().Snapshot();
    response->set_version(e.options().version);
    response->set_backend(e.backend().name());
    response->set_budget_bytes(s.budget);
    response->set_pool_bytes(s.allocated);
    response->set_kv_active_bytes(s.by_state[static_cast<int>(PoolState::kKvActive)]);
    response->set_kv_kept_bytes(s.by_state[static_cast<int>(PoolState::kKvKept)]);
    response->set_weights_bytes(s.by_state[static_cast<int>(PoolState::kWeights)]);
    response->set_workspace_bytes(s.by_state[static_cast<int>(PoolState::kWorkspace)]);
    response->set_int4_bytes(s.by_format[static_cast<int>(PageFormat::kInt4)]);
    response->set_int8_bytes(s.by_format[static_cast<int>(PageFormat::kInt8)]);
    response->set_bf16_bytes(s.by_format[static_cast<int>(PageFormat::kBf16)]);
    response->set_high_water_bytes(s.high_water);
    response->set_mapped_bytes(s.mapped);
    response->set_reserved_bytes(s.reserved);
    const GaugeValues g = e.Gauges();
    response->set_queue_depth(g.queue_depth);
    response->set_running(e.Running());
    response->set_max_queue(static_cast<int>(e.scheduler().options().max_queue));
    response->set_weights_handles(g.weights_handles);
    response->set_kv_handles(g.kv_handles);
    response->set_shm_regions(g.shm_regions);
    response->set_cuda_ipc_regions(g.cuda_ipc_regions);
    response->set_gpu_free_bytes(g.gpu_free);
    response->set_gpu_total_bytes(g.gpu_total);
    response->set_serving(!draining_ && e.Healthy());
    const DeviceIdentity device = e.backend().Identity();
    response->set_device_uuid(device.uuid);
    response->set_device_pci_bus_id(device.pci_bus_id);
    response->set_device_ordinal(device.ordinal);
    response->set_inline_bytes_received(inline_received_.load());
    response->set_inline_bytes_sent(inline_sent_.load());
    response->set_cuda_wait_event(e.backend().TakesIpcEvents());
    response->set_cuda_done_event(e.backend().TakesIpcEvents());
    response->set_lanes(lanes_.Count());
    const KernelInfo kernel = e.backend().Kernel();
    response->set_compute_capability(kernel.compute_capability);
    response->set_attention_kernel(kernel.attention_kernel);
    response->set_cuda_archs_built(kernel.cuda_archs_built);
    response->set_sm_count(kernel.sm_count);
    v1::TenantUsage* t = response->mutable_tenant();
    t->set_tenant(*tenant);
    auto it = s.by_tenant.find(*tenant);
    t->set_pool_bytes(it == s.by_tenant.end() ? 0 : it->second);
    const RegistryCounts c = e.registry().TenantCounts(*tenant);
    t->set_weights_handles(c.weights);
    t->set_kv_handles(c.kv);
    t->set_regions(c.shm + c.cuda_ipc);
    const auto queued = e.scheduler().QueuedByTenant();
    if (auto q = queued.find(*tenant); q != queued.end()) t->set_queued(q->second);
    const auto running = e.RunningByTenant();
    if (auto r = running.find(*tenant); r != running.end()) t->set_running(r->second);
    t->set_quota_bytes(e.options().tenant_quota_bytes);
    return FinishUnary(context, "Status", absl::OkStatus());
  });
}

grpc::ServerUnaryReactor* KvpackService::RegisterRegion(grpc::CallbackServerContext* context,
                                                        const v1::RegisterRegionRequest* request,
                                                        v1::RegisterRegionResponse* response) {
  return Guarded(context, "RegisterRegion", [&]() -> grpc::ServerUnaryReactor* {
    constexpr char kMethod[] = "RegisterRegion";
    absl::StatusOr<std::string> tenant = Admit(*context);
    if (!tenant.ok()) return FinishUnary(context, kMethod, tenant.status());
    switch (request->kind()) {
      case v1::REGION_SHM: {
        absl::StatusOr<std::shared_ptr<Region>> region =
            MapShmRegion(*tenant, request->shm_name(), request->size_bytes(), engine_->options().faults);
        if (!region.ok()) return FinishUnary(context, kMethod, region.status());
        response->set_region_id((*region)->id());
        response->set_lease_seconds(absl::ToDoubleSeconds(engine_->registry().lease()));
        return FinishUnary(context, kMethod, engine_->registry().AddRegion(std::move(*region)));
      }
      case v1::REGION_CUDA_IPC: {
        if (request->cuda_ipc_handle().size() != 64) {
          return FinishUnary(context, kMethod,
                             absl::InvalidArgumentError(absl::StrCat("cuda_ipc_handle: ", request->cuda_ipc_handle().size(),
                                                                     " bytes, expected the 64 of a cudaIpcMemHandle_t")));
        }
        if (request->size_bytes() == 0) {
          return FinishUnary(context, kMethod, absl::InvalidArgumentError("size_bytes: must be positive"));
        }
        absl::StatusOr<Backend::IpcMapping> mapping =
            engine_->backend().OpenIpcRegion(request->cuda_ipc_handle(), request->device(), request->size_bytes());
        if (!mapping.ok()) return FinishUnary(context, kMethod, mapping.status());
        auto region = std::make_shared<Region>(Registry::NewId("r-"), *tenant, RegionKind::kCudaIpc, "", mapping->base,
                                               request->size_bytes(), std::move(mapping->close));
        response->set_region_id(region->id());
        response->set_lease_seconds(absl::ToDoubleSeconds(engine_->registry().lease()));
        return FinishUnary(context, kMethod, engine_->registry().AddRegion(std::move(region)));
      }
      default:
        return FinishUnary(context, kMethod,
                           absl::InvalidArgumentError(absl::StrCat("kind = ", request->kind(), ": expected REGION_SHM or REGION_CUDA_IPC")));
    }
  });
}

grpc::ServerUnaryReactor* KvpackService::UnregisterRegion(grpc::CallbackServerContext* context,
                                                          const v1::UnregisterRegionRequest* request,
                                                          v1::UnregisterRegionResponse*) {
  constexpr char kMethod[] = "UnregisterRegion";
  absl::StatusOr<std::string> tenant = Admit(*context);
  if (!tenant.ok()) return FinishUnary(context, kMethod, tenant.status());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  lanes_.CloseRegion(*tenant, request->region_id());  // a lane over it lets go after its call in flight
  // Finishes when the last request using the region lets go (maybe at once).
  absl::Status s = engine_->registry().UnregisterRegion(
      *tenant, request->region_id(), [this, reactor] { reactor->Finish(Finished("UnregisterRegion", absl::OkStatus())); });
  if (!s.ok()) reactor->Finish(Finished(kMethod, s));
  return reactor;
}

grpc::ServerUnaryReactor* KvpackService::RegionStatus(grpc::CallbackServerContext* context,
                                                      const v1::RegionStatusRequest* request,
                                                      v1::RegionStatusResponse* response) {
  return Guarded(context, "RegionStatus", [&]() -> grpc::ServerUnaryReactor* {
    constexpr char kMethod[] = "RegionStatus";
    absl::StatusOr<std::string> tenant = Admit(*context);
    if (!tenant.ok()) return FinishUnary(context, kMethod, tenant.status());
    bool found = request->region_id().empty();
    for (const std::shared_ptr<Region>& r : engine_->registry().Regions(*tenant)) {
      if (!request->region_id().empty() && r->id() != request->region_id()) continue;
      found = true;
      v1::RegionInfo* info = response->add_regions();
      info->set_region_id(r->id());
      info->set_kind(r->kind() == RegionKind::kShm ? v1::REGION_SHM : v1::REGION_CUDA_IPC);
      info->set_shm_name(r->name());
      info->set_size_bytes(r->size());
      info->set_users(r->users());
    }
    if (!found) {
      return FinishUnary(context, kMethod,
                         absl::NotFoundError(absl::StrCat("region_id = \"", Bounded(request->region_id()), "\": no such region for this tenant")));
    }
    return FinishUnary(context, kMethod, absl::OkStatus());
  });
}

grpc::ServerUnaryReactor* KvpackService::OpenLane(grpc::CallbackServerContext* context,
                                                  const v1::OpenLaneRequest* request, v1::OpenLaneResponse* response) {
  return Guarded(context, "OpenLane", [&]() -> grpc::ServerUnaryReactor* {
    absl::StatusOr<std::string> tenant = Admit(*context);
    if (!tenant.ok()) return FinishUnary(context, "OpenLane", tenant.status());
    absl::StatusOr<v1::OpenLaneResponse> opened = lanes_.Open(*tenant, *request);
    if (opened.ok()) *response = *std::move(opened);
    return FinishUnary(context, "OpenLane", opened.status());
  });
}

grpc::ServerUnaryReactor* KvpackService::CloseLane(grpc::CallbackServerContext* context,
                                                   const v1::CloseLaneRequest* request, v1::CloseLaneResponse*) {
  return Guarded(context, "CloseLane", [&]() -> grpc::ServerUnaryReactor* {
    absl::StatusOr<std::string> tenant = Admit(*context);
    if (!tenant.ok()) return FinishUnary(context, "CloseLane", tenant.status());
    return FinishUnary(context, "CloseLane", lanes_.Close(*tenant, request->lane_id()));
  });
}

grpc::ServerUnaryReactor* KvpackService::KeepAlive(grpc::CallbackServerContext* context,
                                                   const v1::KeepAliveRequest* request, v1::KeepAliveResponse* response) {
  return Guarded(context, "KeepAlive", [&]() -> grpc::ServerUnaryReactor* {
    absl::StatusOr<std::string> tenant = Admit(*context);
    if (!tenant.ok()) return FinishUnary(context, "KeepAlive", tenant.status());
    const std::vector<std::string> ids(request->ids().begin(), request->ids().end());
    response->set_renewed(engine_->registry().KeepAlive(*tenant, ids));
    response->set_lease_seconds(absl::ToDoubleSeconds(engine_->registry().lease()));
    return FinishUnary(context, "KeepAlive", absl::OkStatus());
  });
}

}  // namespace kvpack::server
