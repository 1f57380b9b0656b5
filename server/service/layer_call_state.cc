// See layer_call_state.h. The checks here are the whole of a layer call's validation: the stream
// (layer_call.cc) and the unary form (layer_regions_call.cc) add none of their own.
#include "server/service/layer_call_state.h"

#include <chrono>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/service/convert.h"
#include "server/service/service.h"
#include "server/service/status_map.h"

namespace kvpack::server {
namespace {

const char* TensorName(v1::TensorId id) {
  switch (id) {
    case v1::TENSOR_X: return "header.x";
    case v1::TENSOR_Q: return "header.projected.q";
    case v1::TENSOR_K: return "header.projected.k";
    case v1::TENSOR_V: return "header.projected.v";
    default: return "header.positions";
  }
}

// A host buffer of `bytes`, or RESOURCE_EXHAUSTED naming `field` when the allocation fails (a
// failed new[] would otherwise throw through gRPC's callback machinery and the call never end).
absl::Status AllocateHost(uint64_t bytes, const char* field, std::unique_ptr<uint8_t[]>* out) {
  out->reset(bytes <= SIZE_MAX ? new (std::nothrow) uint8_t[bytes] : nullptr);
  if (*out == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat(field, ": the daemon cannot allocate ", bytes, " bytes of host memory for it; use a region"));
  }
  return absl::OkStatus();
}

}  // namespace

const char* LayerMethodName(LayerMode mode, LayerTransport transport) {
  constexpr const char* kNames[3][3] = {{"AttentionLayer", "AttentionLayerRegions", "AttentionLayerLane"},
                                         {"Project", "ProjectRegions", "ProjectLane"},
                                         {"Attend", "AttendRegions", "AttendLane"}};
  const int t = static_cast<int>(transport);
  switch (mode) {
    case LayerMode::kFull: return kNames[0][t];
    case LayerMode::kProject: return kNames[1][t];
    case LayerMode::kAttend: return kNames[2][t];
  }
  return "AttentionLayer";
}

LayerCallState::LayerCallState(KvpackService* service, grpc::CallbackServerContext* context, LayerMode mode,
                               LayerTransport transport)
    : service_(service),
      context_(context),
      deadline_(context->deadline() == std::chrono::system_clock::time_point::max()
                    ? absl::InfiniteFuture()
                    : absl::FromChrono(context->deadline())),
      mode_(mode),
      transport_(transport),
      method_(LayerMethodName(mode, transport)) {}

LayerCallState::LayerCallState(KvpackService* service, std::string tenant, absl::Time deadline, LayerMode mode)
    : service_(service),
      context_(nullptr),
      deadline_(deadline),
      mode_(mode),
      transport_(LayerTransport::kLane),
      method_(LayerMethodName(mode, LayerTransport::kLane)),
      tenant_(std::move(tenant)) {}

absl::Status LayerCallState::Admit() {
  if (context_ == nullptr) {  // a lane: its tenant was admitted at OpenLane
    if (service_->draining()) return absl::UnavailableError("kvpackd is draining before it exits");
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> tenant = service_->Admit(*context_);
  if (!tenant.ok()) return tenant.status();
  tenant_ = *std::move(tenant);
  return absl::OkStatus();
}

absl::Status LayerCallState::OnHeader(const v1::LayerHeader& header) {
  have_header_ = true;
  header_start_ = absl::Now();
  Engine& engine = service_->engine();
  auto job = std::make_shared<LayerJob>();
  job->mode = mode_;
  job->method = method_;
  job->tenant = tenant_;
  job->priority = header.priority();
  job->keep_kv = header.keep_kv() || mode_ == LayerMode::kProject;
  if (deadline_ != absl::InfiniteFuture()) job->deadline = deadline_;
  if (absl::Status s = BindWaitEvent(header, job.get()); !s.ok()) return s;

  // Pre-projected q, k, v take the place of x and the weights (AttentionLayer only).
  projected_ = header.input_case() == v1::LayerHeader::kProjected;
  if (projected_ && mode_ != LayerMode::kFull) {
    return absl::InvalidArgumentError(absl::StrCat("header.projected: only AttentionLayer takes projected q, k, v; ",
                                                   method_, " needs x and a weights handle"));
  }
  absl::StatusOr<LayerRequest> request;
  if (projected_) {
    request = LayerRequestFromProto(header, /*has_bias=*/false, /*qk_norm_weight_len=*/0);
    if (!request.ok()) return request.status();
    if (absl::Status s = CheckLimits(request->shape, service_->limits()); !s.ok()) return s;
  } else {
    absl::StatusOr<std::shared_ptr<WeightsEntry>> weights =
        engine.registry().GetWeights(tenant_, header.weights_handle(), "header.weights_handle");
    if (!weights.ok()) return weights.status();
    job->weights = *weights;
    const WeightsEntry& w = **weights;
    request = LayerRequestFromProto(header, w.has_bias, w.norm_len);
    if (!request.ok()) return request.status();
    if (absl::Status s = CheckLimits(request->shape, service_->limits()); !s.ok()) return s;
    const LayerShape& shape = request->shape;
    if (shape.hidden != w.hidden || shape.n_heads != w.n_heads || shape.head_dim != w.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.shape (hidden ", shape.hidden, ", n_heads ", shape.n_heads, ", head_dim ", shape.head_dim,
          ") does not match the weights (hidden ", w.hidden, ", n_heads ", w.n_heads, ", head_dim ", w.head_dim, ")"));
    }
    if (request->qk_norm.enabled && w.norm_len == 0) {
      return absl::InvalidArgumentError("header.options.qk_norm.enabled: the weights have no q/k norm weights");
    }
  }
  if (job->keep_kv) {  // fail fast; the engine checks again when it registers the entry
    if (absl::Status s = engine.registry().CheckHandleRoom(tenant_); !s.ok()) return s;
  }

  if (mode_ == LayerMode::kAttend) {
    absl::StatusOr<std::shared_ptr<KvEntry>> kv = engine.registry().GetKv(tenant_, header.kv_handle(), "header.kv_handle");
    if (!kv.ok()) return kv.status();
    job->kv_in = *kv;
    if (absl::Status s = MatchKv(**kv, *request, *job->weights); !s.ok()) return s;
    // The entry's transforms are the ones its pages were written with.
    request->transforms = (*kv)->config.transforms;
    request->rope = (*kv)->config.rope;
    request->qk_norm = (*kv)->config.qk_norm;
  } else if (!header.kv_handle().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("header.kv_handle: only Attend takes a K/V handle, not ", method_));
  }

  if (transport_ != LayerTransport::kStream && mode_ != LayerMode::kProject &&
      header.output().mode() == v1::OUTPUT_INLINE) {
    return absl::InvalidArgumentError(absl::StrCat("header.output.mode: ", method_,
                                                   " writes into a region (OUTPUT_REGION, or OUTPUT_IN_PLACE over x "
                                                   "in a region); an inline output needs the streamed call"));
  }

  // Tensors in CUDA IPC regions are device memory: the plan reserves no staging copies for them.
  const v1::OutputSpec& output = header.output();
  request->resident.x = InDeviceRegion(header.x());
  request->resident.positions = InDeviceRegion(header.positions());
  if (projected_) {
    request->resident.q = InDeviceRegion(header.projected().q());
    request->resident.k = InDeviceRegion(header.projected().k());
    request->resident.v = InDeviceRegion(header.projected().v());
  }
  request->resident.out = mode_ == LayerMode::kProject ||
                          (output.mode() == v1::OUTPUT_REGION && InDeviceRegion(output.region().region_id())) ||
                          (output.mode() == v1::OUTPUT_IN_PLACE && request->resident.x);
  job->resident = request->resident;

  const absl::Time plan_start = absl::Now();
  if (absl::Status s = engine.policies().Resolve(&*request); !s.ok()) return s;
  absl::StatusOr<LayerPlan> plan = engine.Plan(tenant_, *request, job->kv_in.get());
  plan_seconds_ = absl::ToDoubleSeconds(absl::Now() - plan_start);
  if (!plan.ok()) return plan.status();
  if (!plan->fits) return absl::ResourceExhaustedError(plan->reason);
  job->plan = std::move(*plan);

  if (absl::Status s = BindInputs(header, *request, job.get()); !s.ok()) return s;
  const LayerShape& shape = request->shape;
  if (absl::Status s = BindOutput(header, static_cast<uint64_t>(shape.n_tokens) * shape.HeadCols() * 2, job.get());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = BindDoneEvent(header, *request, job.get()); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  job_ = std::move(job);
  return absl::OkStatus();
}

absl::Status LayerCallState::BindInputs(const v1::LayerHeader& header, const LayerRequest& request, LayerJob* job) {
  const LayerShape& shape = request.shape;
  if (projected_) {
    const uint64_t span = 2ull * static_cast<uint64_t>(request.projected.SpanElements(shape));
    const v1::ProjectedQkv& p = header.projected();
    const v1::TensorRef* refs[3] = {&p.q(), &p.k(), &p.v()};
    const char* fields[3] = {"header.projected.q", "header.projected.k", "header.projected.v"};
    for (int i = 0; i < 3; ++i) {
      qkv_[i].field = fields[i];
      qkv_[i].size = span;
      qkv_[i].align = 16;  // the GPU epilogue loads a lane's channels as one 8-byte word
      if (absl::Status s = Bind(*refs[i], &qkv_[i], job, /*required=*/true); !s.ok()) return s;
    }
  } else {
    x_.field = "header.x";
    x_.size = static_cast<uint64_t>(shape.n_tokens) * shape.hidden * 2;
    if (absl::Status s = Bind(header.x(), &x_, job, /*required=*/true); !s.ok()) return s;
  }
  const bool rope = request.rope.layout != RopeLayout::kNone;
  positions_.field = "header.positions";
  positions_.size = rope ? static_cast<uint64_t>(shape.n_tokens) * request.rope.n_axes * 4 : 0;
  if (!rope && header.positions().location_case() != v1::TensorRef::LOCATION_NOT_SET) {
    return absl::InvalidArgumentError("header.positions: given without RoPE (options.rope.layout is LAYOUT_NONE)");
  }
  if (rope) {
    if (absl::Status s = Bind(header.positions(), &positions_, job, /*required=*/true); !s.ok()) return s;
  }
  uint64_t inline_total = 0;
  for (const Input* input : Inputs()) inline_total += input->is_inline ? input->size : 0;
  if (inline_total > service_->limits().max_inline_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("inline tensors of ", inline_total,
                                                     " bytes exceed this daemon's limit of ",
                                                     service_->limits().max_inline_bytes, " per request; use a region"));
  }
  // Host bytes of this call outside the pool: inline inputs and an inline output, claimed from the
  // daemon's in-flight budget before any is allocated; the lease goes with the job.
  const uint64_t out_size = static_cast<uint64_t>(shape.n_tokens) * shape.HeadCols() * 2;
  const bool out_is_inline = mode_ != LayerMode::kProject && header.output().mode() == v1::OUTPUT_INLINE;
  if (const uint64_t host = inline_total + (out_is_inline ? out_size : 0); host > 0) {
    absl::StatusOr<InlineBudget::Lease> lease = service_->engine().inline_budget().Acquire(host);
    if (!lease.ok()) return lease.status();
    job->inline_lease = std::move(*lease);
  }
  if (x_.is_inline) {
    if (absl::Status s = AllocateHost(x_.size, x_.field, &job->x_buf); !s.ok()) return s;
    x_.data = job->x_buf.get();
  }
  if (positions_.is_inline) {
    if (absl::Status s = AllocateHost(positions_.size, positions_.field, &job->positions_buf); !s.ok()) return s;
    positions_.data = job->positions_buf.get();
  }
  for (int i = 0; i < 3; ++i) {
    if (!qkv_[i].is_inline) continue;
    if (absl::Status s = AllocateHost(qkv_[i].size, qkv_[i].field, &job->qkv_buf[i]); !s.ok()) return s;
    qkv_[i].data = job->qkv_buf[i].get();
  }
  job->tensors.x = reinterpret_cast<const uint16_t*>(x_.data);
  job->tensors.q = reinterpret_cast<const uint16_t*>(qkv_[0].data);
  job->tensors.k = reinterpret_cast<const uint16_t*>(qkv_[1].data);
  job->tensors.v = reinterpret_cast<const uint16_t*>(qkv_[2].data);
  job->tensors.positions = rope ? reinterpret_cast<const float*>(positions_.data) : nullptr;
  return absl::OkStatus();
}

absl::Status LayerCallState::BindOutput(const v1::LayerHeader& header, uint64_t out_size, LayerJob* job) {
  const v1::OutputMode out_mode = header.output().mode();
  job->out_bytes = out_size;
  if (mode_ == LayerMode::kProject) {
    if (out_mode != v1::OUTPUT_INLINE && out_mode != v1::OUTPUT_NONE) {
      return absl::InvalidArgumentError("header.output.mode: Project writes no output (use OUTPUT_NONE)");
    }
    return absl::OkStatus();
  }
  switch (out_mode) {
    case v1::OUTPUT_INLINE:
      if (absl::Status s = AllocateHost(out_size, "header.output", &job->out_buf); !s.ok()) return s;
      job->tensors.out = reinterpret_cast<uint16_t*>(job->out_buf.get());
      out_inline_ = job->out_buf.get();
      return absl::OkStatus();
    case v1::OUTPUT_IN_PLACE:
      job->tensors.out = reinterpret_cast<uint16_t*>(x_.data);
      if (x_.is_inline) out_inline_ = x_.data;
      return absl::OkStatus();
    case v1::OUTPUT_REGION: {
      const v1::RegionSlice& slice = header.output().region();
      if (slice.size_bytes() != out_size) {
        return absl::InvalidArgumentError(absl::StrCat("header.output.region.size_bytes = ", slice.size_bytes(),
                                                       ", expected N * n_heads * head_dim * 2 = ", out_size));
      }
      Engine& engine = service_->engine();
      absl::StatusOr<RegionUse> use = engine.registry().UseRegion(tenant_, slice.region_id(), "header.output.region");
      if (!use.ok()) return use.status();
      absl::StatusOr<uint8_t*> p = use->get()->Slice(slice.offset(), out_size, "header.output.region");
      if (!p.ok()) return p.status();
      job->tensors.out = reinterpret_cast<uint16_t*>(*p);
      job->regions.push_back(std::move(*use));
      return absl::OkStatus();
    }
    case v1::OUTPUT_NONE:
      return absl::InvalidArgumentError(absl::StrCat("header.output.mode: ", method_, " writes an output"));
    default:
      return absl::InvalidArgumentError(absl::StrCat("header.output.mode = ", out_mode, " is not known"));
  }
}

// Checks that an Attend request describes the tokens its K/V entry was projected from.
absl::Status LayerCallState::MatchKv(const KvEntry& kv, const LayerRequest& request, const WeightsEntry& w) const {
  if (kv.weights_id != w.id) {
    return absl::InvalidArgumentError("header.kv_handle: the entry was projected with other weights");
  }
  const LayerShape& a = kv.config.shape;
  if (a.n_tokens != request.shape.n_tokens || a.n_heads != request.shape.n_heads ||
      a.head_dim != request.shape.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("header.shape: the K/V entry has ", a.n_tokens, " tokens, ",
                                                   a.n_heads, " heads of ", a.head_dim, "; the request differs"));
  }
  if (kv.config.ranges.size() != request.ranges.size()) {
    return absl::InvalidArgumentError(absl::StrCat("header.ranges: the K/V entry has ", kv.config.ranges.size(), " ranges"));
  }
  for (size_t i = 0; i < request.ranges.size(); ++i) {
    const TokenRange& k = kv.config.ranges[i];
    const RangeRequest& r = request.ranges[i];
    if (k.begin != r.begin || k.end != r.end || k.seq_id != r.seq_id) {
      return absl::InvalidArgumentError(absl::StrCat("header.ranges[", i, "]: differs from the K/V entry's [", k.begin,
                                                     ", ", k.end, ") seq ", k.seq_id));
    }
  }
  return absl::OkStatus();
}

// header.cuda_wait_event: the caller's event the job waits for (Engine::WaitForCaller).
absl::Status LayerCallState::BindWaitEvent(const v1::LayerHeader& header, LayerJob* job) {
  constexpr size_t kIpcEventHandleBytes = 64;  // sizeof(cudaIpcEventHandle_t)
  const std::string& event = header.cuda_wait_event();
  if (event.empty()) return absl::OkStatus();
  if (event.size() != kIpcEventHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("header.cuda_wait_event: ", event.size(),
                                                   " bytes, expected the 64 of a cudaIpcEventHandle_t"));
  }
  Backend& backend = service_->engine().backend();
  if (!backend.TakesIpcEvents()) return backend.WaitIpcEvent(event, absl::InfinitePast());  // says why not
  job->wait_event = event;
  return absl::OkStatus();
}

// header.cuda_done_event: recorded after the attention's last kernel, the answer sent before the
// kernels finish (Engine::RunLocked). Only where nothing is staged through host memory after the
// attention (every tensor in a CUDA IPC region) and nothing is registered after it (no keep_kv).
absl::Status LayerCallState::BindDoneEvent(const v1::LayerHeader& header, const LayerRequest& request,
                                           LayerJob* job) {
  constexpr size_t kIpcEventHandleBytes = 64;  // sizeof(cudaIpcEventHandle_t)
  const std::string& event = header.cuda_done_event();
  if (event.empty()) return absl::OkStatus();
  if (event.size() != kIpcEventHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("header.cuda_done_event: ", event.size(),
                                                   " bytes, expected the 64 of a cudaIpcEventHandle_t"));
  }
  if (mode_ == LayerMode::kProject || job->keep_kv) {
    return absl::InvalidArgumentError(absl::StrCat("header.cuda_done_event: ", method_,
                                                   " answers after its work (Project, keep_kv); only "
                                                   "AttentionLayer and Attend without keep_kv take it"));
  }
  const TensorResidency& r = request.resident;
  const bool rope = request.rope.layout != RopeLayout::kNone;
  const bool inputs_on_device = projected_ ? (r.q && r.k && r.v) : r.x;
  if (!inputs_on_device || (rope && !r.positions) || !r.out) {
    return absl::InvalidArgumentError(
        "header.cuda_done_event: every tensor of the call (inputs, positions, output) must be in a CUDA IPC "
        "region");
  }
  Backend& backend = service_->engine().backend();
  if (!backend.TakesIpcEvents()) {
    return absl::FailedPreconditionError(absl::StrCat("header.cuda_done_event: CUDA IPC events need the CUDA "
                                                      "backend; this daemon serves on the ", backend.name(),
                                                      " backend"));
  }
  job->done_event = event;
  return absl::OkStatus();
}

// Whether `region_id` names one of this tenant's CUDA IPC regions (device memory, used in place).
// An unknown id is answered later, where the tensor is bound, with the field named.
bool LayerCallState::InDeviceRegion(const std::string& region_id) const {
  absl::StatusOr<RegionUse> use = service_->engine().registry().UseRegion(tenant_, region_id, "");
  return use.ok() && use->get()->kind() == RegionKind::kCudaIpc;
}

bool LayerCallState::InDeviceRegion(const v1::TensorRef& ref) const {
  return ref.location_case() == v1::TensorRef::kRegion && InDeviceRegion(ref.region().region_id());
}

absl::Status LayerCallState::Bind(const v1::TensorRef& ref, Input* input, LayerJob* job, bool required) {
  switch (ref.location_case()) {
    case v1::TensorRef::LOCATION_NOT_SET:
      return required ? absl::InvalidArgumentError(absl::StrCat(input->field, ": required")) : absl::OkStatus();
    case v1::TensorRef::kInlineBytes:
      if (transport_ != LayerTransport::kStream) {
        return absl::InvalidArgumentError(absl::StrCat(input->field, ".inline_bytes: ", method_,
                                                       " takes tensors in regions only; send inline tensors over the "
                                                       "streamed call"));
      }
      if (ref.inline_bytes() != input->size) {
        return absl::InvalidArgumentError(absl::StrCat(input->field, ".inline_bytes = ", ref.inline_bytes(),
                                                       ", expected ", input->size));
      }
      input->is_inline = true;
      return absl::OkStatus();
    case v1::TensorRef::kRegion: {
      const v1::RegionSlice& slice = ref.region();
      const std::string field = absl::StrCat(input->field, ".region");
      if (slice.size_bytes() != input->size) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".size_bytes = ", slice.size_bytes(), ", expected ",
                                                       input->size));
      }
      absl::StatusOr<RegionUse> use = service_->engine().registry().UseRegion(tenant_, slice.region_id(), field);
      if (!use.ok()) return use.status();
      absl::StatusOr<uint8_t*> p = use->get()->Slice(slice.offset(), input->size, field);
      if (!p.ok()) return p.status();
      if (reinterpret_cast<uintptr_t>(*p) % input->align != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".offset = ", slice.offset(), " is not ", input->align, "-byte aligned"));
      }
      input->data = *p;
      job->regions.push_back(std::move(*use));
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(input->field, ": unknown location"));
}

absl::Status LayerCallState::OnChunk(const v1::TensorChunk& chunk) {
  if (++chunks_ > service_->limits().max_chunks_per_call) return TooManyChunks(service_->limits());
  Input* input = nullptr;
  switch (chunk.tensor()) {
    case v1::TENSOR_X: input = &x_; break;
    case v1::TENSOR_POSITIONS: input = &positions_; break;
    case v1::TENSOR_Q: input = &qkv_[0]; break;
    case v1::TENSOR_K: input = &qkv_[1]; break;
    case v1::TENSOR_V: input = &qkv_[2]; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("chunk.tensor = ", chunk.tensor(), ": ", method_,
                                                     " takes TENSOR_X (or TENSOR_Q, _K, _V), TENSOR_POSITIONS"));
  }
  if (input->size == 0 && !input->is_inline) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.tensor: ", TensorName(chunk.tensor()),
                                                   " is not an input of this header"));
  }
  if (!input->is_inline) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.tensor: ", input->field, " was not declared inline"));
  }
  if (chunk.offset() != input->received) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.offset = ", chunk.offset(), " for ", input->field,
                                                   ": chunks must arrive in order; expected ", input->received));
  }
  const uint64_t n = chunk.data().size();
  if (n > input->size - input->received) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.data: ", input->field, " is ", input->size,
                                                   " bytes; this chunk ends at ", chunk.offset() + n));
  }
  std::memcpy(input->data + input->received, chunk.data().data(), n);
  input->received += n;
  service_->CountInline(n, 0);
  return absl::OkStatus();
}

absl::Status LayerCallState::Submit(std::function<void(absl::Status)> done) {
  if (context_ != nullptr && context_->IsCancelled()) return absl::CancelledError("the client cancelled the call");
  if (!have_header_) {
    short_upload_ = true;
    return absl::InvalidArgumentError("header: the stream ended before a header");
  }
  for (const Input* input : Inputs()) {
    if (input->is_inline && input->received != input->size) {
      short_upload_ = true;
      return absl::InvalidArgumentError(absl::StrCat(input->field, ": received ", input->received, " of ", input->size,
                                                     " bytes before the stream closed"));
    }
  }
  upload_seconds_ = absl::ToDoubleSeconds(absl::Now() - header_start_) - plan_seconds_;
  std::shared_ptr<LayerJob> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job = job_;
    if (cancelled_) job->cancelled = true;
  }
  job->done = std::move(done);
  submitted_ = true;
  service_->engine().Submit(job);
  return absl::OkStatus();
}

void LayerCallState::Cancel() {
  std::shared_ptr<LayerJob> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    job = job_;
  }
  if (job) job->cancelled = true;
  if (job && submitted_) service_->engine().Cancel(job);
}

absl::Status LayerCallState::Complete(absl::Status status, v1::LayerResult* result) {
  // A shared-memory object truncated while the job read or wrote it was swapped for zero pages
  // (shm_guard.h): what the job computed from or into it is void, a kept K/V entry included.
  for (const RegionUse& use : job_->regions) {
    if (absl::Status s = use.get()->Intact(); !s.ok() && status.ok()) status = s;
  }
  if (!status.ok() && !job_->kv_handle.empty()) {
    (void)service_->engine().registry().ReleaseKv(tenant_, job_->kv_handle);
  }
  // Handles and regions are let go before the client hears back, so a release it sends next frees
  // their memory at once; except when the answer comes before the kernels finish
  // (header.cuda_done_event): the job holds them until then, and drops them when Run returns.
  if (!job_->replied) {
    job_->weights.reset();
    job_->kv_in.reset();
    job_->regions.clear();
  }
  if (!status.ok()) return status;
  if (job_->estimate.present) {  // the run's own estimate replaces the one the plan was given
    for (size_t i = 0; i < job_->plan.ranges.size(); ++i) {
      RangePlan& r = job_->plan.ranges[i];
      r.estimated_rel_error = job_->estimate.rel_error[static_cast<int>(r.format)];
    }
    EstimateToProto(job_->estimate, result->mutable_estimated_rel_error());
  }
  PlanToProto(job_->plan, result->mutable_plan());
  result->mutable_plan()->set_mma(MmaPathName(service_->engine().backend().ResolvedMma(job_->plan.config)));
  result->set_kv_handle(job_->kv_handle);
  result->set_peak_bytes(job_->peak_bytes);
  result->set_routed_fraction(job_->sparse_report.RoutedFraction());
  v1::StageSeconds* sec = result->mutable_seconds();
  sec->set_queue(job_->queue_seconds);
  sec->set_project(job_->project_seconds);
  sec->set_attend(job_->attend_seconds);
  sec->set_transfer(upload_seconds_ + job_->transfer_seconds);
  sec->set_plan(plan_seconds_);
  sec->set_allocate(job_->allocate_seconds);
  sec->set_turn_wait(job_->turn_wait_seconds);
  sec->set_release(job_->release_seconds);
  sec->set_total(absl::ToDoubleSeconds(absl::Now() - header_start_));
  if (out_inline_ != nullptr) result->set_output_bytes(job_->out_bytes);
  return absl::OkStatus();
}

uint64_t LayerCallState::output_bytes() const { return out_inline_ != nullptr ? job_->out_bytes : 0; }

bool LayerCallState::FinishOnce(absl::Status status, grpc::Status* out) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return false;
    finished_ = true;
  }
  // A client whose deadline passes cancels the call (RST_STREAM) a little before the daemon's copy
  // of the deadline (computed from grpc-timeout on arrival) passes; name that cause.
  constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(100);
  if (status.code() == absl::StatusCode::kCancelled && deadline_ != absl::InfiniteFuture() &&
      absl::Now() >= deadline_ - kDeadlineSlack) {
    status = absl::DeadlineExceededError(status.message());
  }
  if (short_upload_ && !status.ok()) {
    *out = ToGrpcStatus(status);  // counted in OnDone
    uncounted_ = out->error_code();
  } else {
    *out = service_->Finished(method_, status);
  }
  return true;
}

void LayerCallState::OnDone() {
  if (uncounted_ && context_ != nullptr) service_->RecordShortUpload(method_, *uncounted_, *context_);
}

}  // namespace kvpack::server
